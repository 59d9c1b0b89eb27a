"""The two programs of the code reward (rl/env/code_reward.py), each in a sandbox of its own, joined by two pipes.

- The candidate's side, `serve`: imports the candidate (solution.py) and calls its functions when asked, sending
  each result back as plain data. Nothing of the tests is ever in its process: not the expected values, not the
  mark that says the tests ran to their end.
- The tests' side, `run_tests`: runs the row's setup and tests, in which each function the candidate was to
  write is a stand-in that asks the other side and decodes the answer. What the tests compare are objects this
  process built from plain data (None, bool, int, float, complex, str, bytes and lists, tuples, dicts, sets and
  frozensets of them; a subclass, a Counter say, crosses as its plain type, read through that type's own
  methods), so an answer cannot lie about equality, and a program that prints or exits early on its side cannot
  pass: the mark is printed here, after the last test, only when every call was answered.

The wire: one JSON line a message. Request {"fn": name, "args": [...], "kwargs": {...}}; answer {"value": ...},
{"raised": [exception type's name, message]} or {"failed": why}. Values are tagged (`encode`; integers in hex, so
no digit limit applies). A candidate that raises a built-in exception raises the same type on the tests' side, so
tests that expect one still pass (StopIteration excepted: see `exception_as`). Arguments cross the same way: a
test that passes a function or an object of its own to the candidate fails, and one that checks an argument the
candidate changed in place sees its own copy.
Standard library only: this file is copied into both sandboxes as harness.py.
"""

from __future__ import annotations

import builtins
import importlib
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


# What crosses, by the plain type it is (subclasses as that type, read through the type's own methods, so that
# what a subclass overrides never runs): (type, tag, how its payload is read); bool before int, its base.
PLAIN = [(type(None), "n", lambda v, d: None), (bool, "b", lambda v, d: bool(v)),
         (int, "i", lambda v, d: int.__index__(v).__format__("x")),  # hex: no digit limit on the way back
         (float, "f", lambda v, d: float.__float__(v) if math.isfinite(v) else float.__repr__(v)),
         (complex, "c", lambda v, d: [encode(complex.__complex__(v).real, d), encode(complex.__complex__(v).imag, d)]),
         (str, "s", lambda v, d: str.__str__(v)), (bytes, "y", lambda v, d: bytes.hex(v)),
         (list, "l", lambda v, d: [encode(x, d) for x in list.__iter__(v)]),
         (tuple, "t", lambda v, d: [encode(x, d) for x in tuple.__iter__(v)]),
         (set, "e", lambda v, d: [encode(x, d) for x in set.__iter__(v)]),
         (frozenset, "z", lambda v, d: [encode(x, d) for x in frozenset.__iter__(v)]),
         (dict, "d", lambda v, d: [[encode(k, d), encode(x, d)] for k, x in dict.items(v)])]
BUILD = {"l": list, "t": tuple, "e": set, "z": frozenset}


def encode(value, depth: int = 0):
    """A JSON-able, tagged form of a plain value ([tag, payload]); NotPlainData for anything else."""
    if depth > MAX_DEPTH:
        raise NotPlainData(f"nested deeper than {MAX_DEPTH}")
    for kind, tag, payload in PLAIN:
        if isinstance(value, kind):
            return [tag, payload(value, depth + 1)]
    kind = type(value)
    raise NotPlainData(f"an object of type {kind.__module__}.{kind.__qualname__}: only plain data crosses")


def decode(tagged):
    """The value `encode` tagged, built here of plain types; NotPlainData for a malformed one."""
    try:
        tag, payload = tagged
        if tag == "n" and payload is None:
            return None
        if tag == "b" and type(payload) is bool:
            return payload
        if tag in ("i", "s", "y") and type(payload) is str:
            return int(payload, 16) if tag == "i" else payload if tag == "s" else bytes.fromhex(payload)
        if tag == "f" and type(payload) in (float, int, str):
            return float(payload)
        if tag == "c":
            return complex(decode(payload[0]), decode(payload[1]))
        if tag in BUILD and type(payload) is list:
            return BUILD[tag](decode(v) for v in payload)
        if tag == "d" and type(payload) is list:
            return {decode(k): decode(v) for k, v in payload}
    except NotPlainData:
        raise
    except Exception as e:
        raise NotPlainData(f"malformed value ({type(e).__name__}: {e})") from None
    raise NotPlainData(f"malformed value with tag {tag!r}" if isinstance(tagged, list) else "malformed value")


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
    except (NotPlainData, RecursionError) as e:
        return {"failed": f"the candidate's {request['fn']} returned {e}"}
    except Exception as e:  # a container that changed while it was read, say
        return {"failed": f"the candidate's {request['fn']} returned a value that could not be read ({e})"}


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
            if "raised" not in message:
                raise CandidateFailed(str(message.get("failed", "an answer of no known kind")))
            kind, text = (str(part) for part in message["raised"])
        except (CandidateFailed, NotPlainData, OSError, ValueError, TypeError) as e:
            self.failure = self.failure or f"{type(e).__name__}: {e}"
            raise CandidateFailed(self.failure) from None
        raise exception_as(kind, text)


def exception_as(kind: str, text: str) -> Exception:
    """The candidate's exception, raised again here: a built-in type by its name, any other as RuntimeError.
    StopIteration would end the test's own loop over the candidate's results (`all(map(f, cases))` passes on
    an empty run), so it comes back as RuntimeError, as a generator turns it."""
    raise_as = getattr(builtins, kind, None)
    if not (isinstance(raise_as, type) and issubclass(raise_as, Exception)) \
            or issubclass(raise_as, (StopIteration, StopAsyncIteration)):
        return RuntimeError(f"{kind}: {text}")
    try:
        return raise_as(text)
    except Exception:  # a type whose constructor wants other arguments (UnicodeDecodeError, ...)
        return RuntimeError(f"{kind}: {text}")


def run_tests(requests_fd: int, answers_fd: int, stand_ins: list[str], modules: list[str], mark: str) -> None:
    """setup.py, then tests.py with `stand_ins` asking the candidate's side and `modules` imported (the standard
    library's modules that the tests use without importing, as they found them in the candidate's namespace);
    the mark, alone on the real stdout (what the tests print goes nowhere), once every call was answered."""
    link = Link(requests_fd, answers_fd)
    scope = {"__name__": "__main__", "__builtins__": builtins}
    scope.update({name: importlib.import_module(name) for name in modules})
    sys.stdout = open(os.devnull, "w")
    for name in ("setup.py", "tests.py"):
        with open(name, encoding="utf-8") as f:
            source = f.read()
        exec(compile(source, name, "exec"), scope)
        if name == "setup.py":
            scope.update({fn: StandIn(fn, link) for fn in stand_ins})
    if link.failure:  # a test that caught the failure must not pass
        sys.exit(f"the candidate's side failed: {link.failure}")
    print(mark, file=sys.__stdout__)
