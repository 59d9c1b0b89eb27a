"""The docs hold together: README stays a page, every docs/ page is reachable from it, every relative link and
#anchor in README.md and docs/*.md lands on a file and a heading, the docs pages that `--help` names exist, and
docs/configuration.md's key tables are what rl/config.py says today."""

import re
from pathlib import Path

import pytest

from rl import config

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md"))
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


@pytest.mark.parametrize("path", [ROOT / "README.md", *PAGES], ids=lambda p: p.name)
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
