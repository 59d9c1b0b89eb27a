"""The two programs of the code reward (rl/code_reward.py), each in a sandbox of its own, joined by two pipes.

- The candidate's side, `serve`: imports the candidate (solution.py) and calls its functions when asked, sending
  each result back as plain data. Nothing of the tests is ever in its process: not the expected values, not the
  mark that says the tests ran to their end.
- The tests' side, `run_tests`: runs the row's setup and tests, in which each function the candidate was to
  write is a stand-in that asks the other side and decodes the answer. What the tests compare are objects this
  process built from plain data (None, bool, int, float, complex, str, bytes and lists, tuples, dicts, sets and
  frozensets of them, by exact type: no subclass crosses), so an answer cannot lie about equality, and a program
  that prints or exits early on its side cannot pass: the mark is printed here, after the last test, only when
  every call was answered.

The wire: one JSON line a message. Request {"fn": name, "args": [...], "kwargs": {...}}; answer {"value": ...},
{"raised": [exception type's name, message]} or {"failed": why}. Values are tagged (`encode`). A candidate that
raises a built-in exception raises the same type on the tests' side, so tests that expect one still pass.
Standard library only: this file is copied into both sandboxes as harness.py.
"""

from __future__ import annotations

import builtins
import json
import math
import os
import sys

MAX_DEPTH = 64  # of nested containers in one value
MAX_LINE_BYTES = 64 * 2**20  # of one message


class CandidateFailed(BaseException):
    """The candidate's side gave no usable answer (died, refused, sent garbage): the tests fail, whatever they
    catch (a BaseException, so `except Exception` in a test does not hide it)."""


class NotPlainData(TypeError):
    pass


SCALARS = {type(None): "n", bool: "b", int: "i", str: "s"}
SEQUENCES = {list: "l", tuple: "t", set: "e", frozenset: "z"}


def encode(value, depth: int = 0):
    """A JSON-able, tagged form of a plain value ([tag, payload]); NotPlainData for anything else."""
    if depth > MAX_DEPTH:
        raise NotPlainData(f"nested deeper than {MAX_DEPTH}")
    kind = type(value)
    if kind in SCALARS:
        return [SCALARS[kind], value]
    if kind is float:
        return ["f", value if math.isfinite(value) else repr(value)]
    if kind is complex:
        return ["c", [encode(value.real, depth + 1), encode(value.imag, depth + 1)]]
    if kind is bytes:
        return ["y", value.hex()]
    if kind in SEQUENCES:
        return [SEQUENCES[kind], [encode(v, depth + 1) for v in value]]
    if kind is dict:
        return ["d", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]]
    raise NotPlainData(f"an object of type {kind.__module__}.{kind.__qualname__}: only plain data crosses")


def decode(tagged):
    """The value `encode` tagged; NotPlainData for a malformed one."""
    try:
        tag, payload = tagged
        if tag in ("n", "b", "i", "s"):
            if type(payload) is not {"n": type(None), "b": bool, "i": int, "s": str}[tag]:
                raise NotPlainData(f"a {tag!r} value holding {type(payload).__name__}")
            return payload
        if tag == "f":
            return float(payload) if type(payload) in (float, int, str) else _bad(tag)
        if tag == "c":
            return complex(decode(payload[0]), decode(payload[1]))
        if tag == "y":
            return bytes.fromhex(payload)
        if tag in ("l", "t", "e", "z"):
            items = [decode(v) for v in payload]
            return {"l": list, "t": tuple, "e": set, "z": frozenset}[tag](items)
        if tag == "d":
            return {decode(k): decode(v) for k, v in payload}
    except NotPlainData:
        raise
    except Exception as e:
        raise NotPlainData(f"malformed value ({type(e).__name__}: {e})") from None
    return _bad(tag)


def _bad(tag):
    raise NotPlainData(f"unknown tag {tag!r}")


def send(fd: int, message: dict) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def receive(stream) -> dict:
    line = stream.readline(MAX_LINE_BYTES + 1)
    if not line.endswith(b"\n"):
        raise CandidateFailed("the candidate's side ended without an answer" if not line else "an answer too long")
    try:
        message = json.loads(line)
    except ValueError:
        raise CandidateFailed("the candidate's side sent something that is not a message") from None
    if not isinstance(message, dict):
        raise CandidateFailed("the candidate's side sent something that is not a message")
    return message


# ---------------------------------------------------------------------------- the candidate's side


def serve(requests_fd: int, answers_fd: int) -> None:
    """Imports solution.py, then answers each request until the tests' side closes its pipe."""
    requests = os.fdopen(requests_fd, "rb")
    try:
        import solution
    except BaseException as e:  # a syntax error, an import that raised or exited: every call fails
        solution, failed = None, f"importing the candidate raised {type(e).__name__}: {e}"
    while True:
        line = requests.readline()
        if not line:
            return
        request = json.loads(line)
        if solution is None:
            send(answers_fd, {"failed": failed})
            continue
        send(answers_fd, answer(solution, request))


def answer(module, request: dict) -> dict:
    fn = vars(module).get(request["fn"])
    if not callable(fn):
        return {"raised": ["NameError", f"name {request['fn']!r} is not defined by the candidate"]}
    try:
        result = fn(*[decode(a) for a in request["args"]], **{k: decode(v) for k, v in request["kwargs"].items()})
    except Exception as e:
        return {"raised": [type(e).__name__, str(e)]}
    except BaseException as e:  # SystemExit, KeyboardInterrupt: no answer a test could expect
        return {"failed": f"the candidate's {request['fn']} raised {type(e).__name__}"}
    try:
        return {"value": encode(result)}
    except NotPlainData as e:
        return {"failed": f"the candidate's {request['fn']} returned {e}"}
    except RecursionError:
        return {"failed": f"the candidate's {request['fn']} returned a value nested too deep"}


# ---------------------------------------------------------------------------- the tests' side


class StandIn:
    """A function the candidate was to write: each call is a request to the candidate's side."""

    def __init__(self, name: str, link: "Link"):
        self.__name__, self.link = name, link

    def __call__(self, *args, **kwargs):
        return self.link.call(self.__name__, args, kwargs)


class Link:
    def __init__(self, requests_fd: int, answers_fd: int):
        self.requests_fd, self.answers = requests_fd, os.fdopen(answers_fd, "rb")
        self.failure = ""

    def call(self, name: str, args: tuple, kwargs: dict):
        if self.failure:
            raise CandidateFailed(self.failure)
        try:
            send(self.requests_fd, {"fn": name, "args": [encode(a) for a in args],
                                    "kwargs": {k: encode(v) for k, v in kwargs.items()}})
            message = receive(self.answers)
            if "value" in message:
                return decode(message["value"])
            if "raised" in message:
                kind, text = message["raised"]
                raise_as = getattr(builtins, str(kind), None)
                if not (isinstance(raise_as, type) and issubclass(raise_as, Exception)):
                    raise_as = RuntimeError
                raise raise_as(f"{text}" if raise_as is not RuntimeError else f"{kind}: {text}")
            raise CandidateFailed(str(message.get("failed", "an answer of no known kind")))
        except (CandidateFailed, NotPlainData, OSError) as e:
            self.failure = self.failure or f"{type(e).__name__}: {e}"
            raise CandidateFailed(self.failure) from None


def run_tests(requests_fd: int, answers_fd: int, stand_ins: list[str], mark: str) -> None:
    """setup.py, then tests.py with `stand_ins` asking the candidate's side; the mark once every call was answered."""
    link = Link(requests_fd, answers_fd)
    scope = {"__name__": "__main__", "__builtins__": builtins}
    for name in ("setup.py", "tests.py"):
        with open(name, encoding="utf-8") as f:
            source = f.read()
        exec(compile(source, name, "exec"), scope)
        if name == "setup.py":
            scope.update({fn: StandIn(fn, link) for fn in stand_ins})
    if link.failure:  # a test that caught the failure must not pass
        sys.exit(f"the candidate's side failed: {link.failure}")
    print(mark)
