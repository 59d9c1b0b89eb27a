"""The docs hold together: README stays a page, every docs/ page is reachable from it, every relative link and
#anchor in README.md, docs/*.md and the benchmark results pages lands on a file and a heading, the docs pages that
`--help` names exist, and docs/configuration.md's key tables are what rl/config.py says today."""

import re
from pathlib import Path

import pytest

from rl import config

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md"))
RESULTS = [ROOT / "benchmarks/RESULTS.md", ROOT / "benchmarks/ARCHIVE.md"]  # where the docs' measured numbers live
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens and underscores dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {anchor(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:", target)]


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in links(path):
        file, _, fragment = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target} (no such heading)")
    return broken


def test_the_readme_fits_a_page_and_keeps_the_commands_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 220
    ci = (ROOT / ".ci/run").read_text().strip().splitlines()[-1]
    assert f"```bash\n{ci}\n```" in readme
    assert "```bash\nbash launch.sh --install configs/quickstart.toml\n```" in readme


@pytest.mark.parametrize("path", [ROOT / "README.md", *PAGES, *RESULTS], ids=lambda p: p.name)
def test_relative_links_land_on_files_and_headings(path):
    assert not broken_links(path)


def test_every_docs_page_is_linked_from_the_readme_or_another_page():
    linked = {(path.parent / target.partition("#")[0]).resolve()
              for path in [ROOT / "README.md", *PAGES] for target in links(path) if target.partition("#")[0]}
    assert PAGES and [page.name for page in PAGES if page.resolve() not in linked] == []


def test_the_pages_help_names_exist_and_help_names_no_readme_section():
    text = " ".join(config.help_text().split())
    assert "README" not in text
    named = set(re.findall(r"docs/[\w.]+\.md", text + (ROOT / "rl/config.py").read_text()))
    assert named and [name for name in named if not (ROOT / name).exists()] == []


def test_the_configuration_page_is_help_text_as_it_is_today():
    page = (ROOT / "docs/configuration.md").read_text()
    assert config.KEY_TABLES in page, "docs/configuration.md lost its generated part"
    assert page.split(config.KEY_TABLES, 1)[1] == config.help_markdown(), \
        "docs/configuration.md differs from rl/config.py: run python -m rl.config docs/configuration.md"
    for key in re.findall(r"^  (\S+) = ", config.help_text(), flags=re.M):
        assert f"| `{key}` |" in page


def variant_rows(text: str) -> dict[str, list[str]]:
    """Each `| `key` | `value` | ... |` row group of the page's tables whose key picks a variant -> the cells after
    its key, one per row: the row of the key and the `| | `value` | ... |` rows that continue it."""
    groups, key = {}, None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if cells and re.fullmatch(r"`[\w.]+`", cells[0]) and cells[0].strip("`") in config.choices():
            key = cells[0].strip("`")
            groups.setdefault(key, []).append(" | ".join(cells[1:]))
        elif cells and cells[0] == "" and key:
            groups[key].append(" | ".join(cells[1:]))
        else:
            key = None
    return groups


def named_variants(rows: list[str]) -> set[str]:
    """The names a row group lists: its value column, row by row; a single row names them in its text (`k1` = ...)."""
    if len(rows) > 1:
        return {row.split(" | ")[0].strip("`") for row in rows}
    return set(re.findall(r"`([a-z0-9_]+)`", rows[0]))


@pytest.mark.parametrize("path", [ROOT / "README.md", *PAGES], ids=lambda p: p.name)
def test_a_docs_table_of_a_variant_kind_names_exactly_its_table(path):
    text = path.read_text().split(config.KEY_TABLES)[0]  # the generated key tables read the tables themselves
    for key, rows in variant_rows(text).items():
        assert named_variants(rows) == set(config.choices()[key]), f"{path.name}: {key}"
