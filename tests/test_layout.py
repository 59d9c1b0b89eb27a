"""The package layout's one rule: imports only go down. rl/'s folders are layers, from the entry points at the top
to the config at the bottom; a module may import its own layer and those below it, never one above (README's
module table lists them in this order)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = [
    ("entry points", {"rl.main", "rl.launch", "rl.prepare", "rl.export", "rl.plot"}),
    ("run", {"rl.run"}),
    ("train", {"rl.train"}),
    ("rollout", {"rl.rollout"}),
    ("env", {"rl.env"}),
    ("model", {"rl.model"}),
    ("base", {"rl", "rl.config", "rl.parallel", "rl.data"}),
]
# The one import that goes up, inside a function: config's validation, --help and docs read the algorithm's variant
# tables where the maths is (rl/train/algo.py), so each variant's name is written once.
UPWARD_OK = {("rl.config", "rl.train.algo")}


def layer_of(module: str) -> int:
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (i, len(prefix))
    assert best is not None, f"{module} is in no layer"
    return best[0]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """Every rl module `path` imports, at the top or inside a function (`from rl.x import y` counts y when it is a
    module of its own)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "rl"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] == "rl":
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                where = ROOT / Path(*sub.split("."))
                is_module = where.with_suffix(".py").is_file() or where.is_dir()
                out.add(sub if is_module else node.module)
    return out


def edges() -> list[tuple[str, str]]:
    return [(module_name(p), m) for p in sorted((ROOT / "rl").rglob("*.py")) for m in sorted(imported(p))]


def test_every_module_has_a_layer():
    for source, target in edges():
        layer_of(source), layer_of(target)


def test_imports_only_go_down():
    up = [f"{s} ({LAYERS[layer_of(s)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})" for s, t in edges()
          if layer_of(t) < layer_of(s) and (s, t) not in UPWARD_OK]
    assert not up, "imports that go up:\n" + "\n".join(up)


def test_the_rule_is_checked():
    """The walk sees imports inside functions and `from rl.pkg import module` forms."""
    assert ("rl.config", "rl.train.algo") in edges()
    assert ("rl.run.checkpointer", "rl.run.checkpoint") in edges()
    assert layer_of("rl.train.step") > layer_of("rl.run.metrics")
    with pytest.raises(AssertionError):
        layer_of("elsewhere.module")


def test_every_module_is_on_the_architecture_page():
    """docs/architecture.md's module table names every file of rl/ (the kernels as their folder), so it shows the
    layout as it is."""
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "rl").rglob("*.py"))
               if "kernels" not in p.parts and p.name != "__init__.py" or p.parent.name in ("rollout", "env")
               if f"`{p.relative_to(ROOT)}`" not in page and f"`{p.name}`" not in page]
    assert not missing, f"docs/architecture.md does not name {missing}"


def test_readme_lists_the_layers():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for name, _ in LAYERS[1:-1]:
        assert f"`rl/{name}/`" in readme, name


def test_a_built_in_named_by_its_former_path_still_loads():
    """A config written before the packages (a resumed run's saved config) names the built-ins by their old
    module paths; they load from their new homes."""
    from rl.env import python_tool
    from rl.env.code_reward import all_tests_pass
    from rl.functions import load_function

    assert load_function("rl.code_reward:all_tests_pass") is all_tests_pass
    assert load_function("rl.envs.python_tool:make_env", "env.fn") is python_tool.make_env
    assert load_function("rl.env.code_reward:all_tests_pass") is all_tests_pass


def long_functions(limit: int = 60) -> list[str]:
    """Functions (methods and nested ones included) in rl/ longer than `limit` lines, outside the GPU kernels."""
    out = []
    for path in sorted((ROOT / "rl").rglob("*.py")):
        if "kernels" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= limit:
                out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} "
                           f"({node.end_lineno - node.lineno + 1} lines)")
    return out


def test_no_function_outside_the_kernels_is_over_60_lines():
    assert long_functions() == []


def test_the_length_check_sees_long_functions():
    assert any(" prefill " in f for f in long_functions(limit=40))
