"""The `pkg.module:function` paths a config names (reward functions, data loaders, environments), imported.

A path may also name a factory call, `pkg.module:factory(key=literal, ...)` (reward.functions), whose result is the
function, made once per process. Every failure is a ConfigError of one line naming the config key and the path.
Paths to the built-in modules from before rl/ was split into packages (`rl.code_reward`,
`rl.envs.python_tool`, ...) are read as their new homes, so a saved config keeps resuming.
"""

from __future__ import annotations

import ast
import functools
import importlib
from typing import Any, Callable

from rl.config import ConfigError

MOVED = {"rl.envs": "rl.env", "rl.code_reward": "rl.env.code_reward", "rl.code_tasks": "rl.env.code_tasks",
         "rl.answers": "rl.env.answers", "rl.reward": "rl.env.reward"}


def current_module(name: str) -> str:
    """A module path as it is now: one of the built-ins under its name from before the packages, moved."""
    for old, new in MOVED.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old):]
    return name


def load_function(path: str, key: str = "reward.user_fn") -> Callable[..., Any]:
    """Imports "pkg.module:function"; for a factory call "pkg.module:factory(key=value, ...)" (reward.functions), the
    function the factory returns, made once per process. A ConfigError names `key` and the path."""
    if "(" in path:
        return built_function(path, key)
    module_name, colon, fn_name = path.partition(":")
    if not colon or not module_name or not fn_name:
        raise ConfigError(f"{key} must look like 'pkg.module:function', got {path!r}")
    try:
        module = importlib.import_module(current_module(module_name))
    except Exception as e:
        raise ConfigError(f"{key}={path!r}: cannot import module {module_name!r} "
                          f"({type(e).__name__}: {e})") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ConfigError(f"{key}={path!r}: module {module_name!r} has no function {fn_name!r}")
    return fn


def function_call(entry: str) -> tuple[str, dict[str, Any] | None]:
    """A reward.functions entry -> (its "pkg.module:name", None), or for a factory written as a call,
    "pkg.module:factory(key=literal, ...)", (its path, the keyword arguments): its result is the reward function, as
    TRL's `get_soft_overlong_punishment(max_completion_len=..., soft_punish_cache=...)`. ValueError: what is wrong."""
    path, paren, arguments = entry.partition("(")
    if not paren:
        return entry, None
    try:
        call = ast.parse(f"f({arguments}", mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"its arguments do not parse ({e.msg})") from None
    if not isinstance(call, ast.Call) or call.args or any(k.arg is None for k in call.keywords):
        raise ValueError("a factory call takes keyword arguments only: 'pkg.module:factory(key=value, ...)'")
    try:
        return path.strip(), {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    except ValueError:
        raise ValueError("a factory's arguments must be literals (numbers, text, lists, dicts)") from None


@functools.cache  # one call of the factory per process: a factory may keep state in what it returns
def built_function(entry: str, key: str) -> Callable[..., Any]:
    try:
        path, kwargs = function_call(entry)
    except ValueError as e:
        raise ConfigError(f"{key} entry {entry!r}: {e}") from None
    factory = load_function(path, key)
    try:
        fn = factory(**kwargs)
    except Exception as e:
        raise ConfigError(f"{key}={entry!r}: the factory raised {type(e).__name__}: {e}") from e
    if not callable(fn):
        raise ConfigError(f"{key}={entry!r}: the factory returned {type(fn).__name__} {fn!r:.100}, not a function")
    return fn
