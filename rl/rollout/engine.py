"""The engine contract: what every rollout engine does the same way, whichever generates the tokens.

An engine speaks token ids in and token ids out (no re-tokenisation) and reports, per sampled token, its
log-probability under the temperature-scaled full-vocabulary distribution: exactly what the trainer recomputes,
so the two can be compared token by token. `Engine` holds what the native engine (rl/rollout/native.py) and
vLLM (rl/rollout/vllm.py) share:

- The memory state machine. An engine sleeps at a level like vLLM's (1: weights to host memory, KV cache freed;
  2: both freed) and wakes by tags ("weights", "kv_cache") so the trainer can borrow its memory. A sleeping engine
  neither generates nor loads weights; after a level-2 sleep it generates only once weights are loaded again; no
  transition happens while a generate() call runs (from its `on_finish`). `calls` records every transition and
  weight load in order.
- Request checks, the same for both engines, before any work.
- Stop text (`SamplingParams.stop_text`): an engine that matches it while decoding (`matches_stop_text`) ends a
  sequence at the token that completes a string; one that cannot (vLLM, which runs without a tokenizer) stops at
  the tokens that complete a string from any state, and its completions are cut after the fact. Callers see the
  same completions from both.
- Identical prompts of a call (with the same prior tokens) are one group, generated from one prefill
  (`prompt_groups`).
- Counters over the engine's life (`EngineStats`), which the rollout metrics difference around each call.

An engine implements loading (`_load_weights`), generating (`_generate`), sleeping (`_sleep`) and waking
(`_wake_up`), and, where it has them, `_reset_prefix_cache`, `_release` and `_close`.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

import torch

from rl.config import RolloutConfig
from rl.rollout.stop_text import StopText

TAGS = ("weights", "kv_cache")


def derive_seed(*parts: int) -> int:
    """A 31-bit seed from a tuple of integers (base seed, rollout, round, engine, request, ...). Hashed,
    not summed: `seed + rollout * a + engine * b + i` makes different tuples collide once i reaches b."""
    digest = hashlib.blake2b(",".join(str(int(p)) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**31


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None  # restarts the engine's sampling stream for this call (None: continue it)
    stop_text: StopText | None = None  # strings that end a sequence, across tokens (rl/rollout/stop_text.py)

    @classmethod
    def from_config(cls, cfg: RolloutConfig, eos_token_ids: Iterable[int]) -> SamplingParams:
        stops = tuple(dict.fromkeys([*cfg.stop_token_ids, *eos_token_ids]))
        return cls(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k, stops)


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort" (the call ended before the request finished)
    # Prompt tokens whose KV the engine kept from an earlier call instead of prefilling them (None: the engine does
    # not count them, as vLLM, whose prefix cache serves them unseen).
    reused_tokens: int | None = None
    # (MoE layers, prompt + response tokens, k) the expert ids each token took in each MoE layer, for routing replay;
    # -1 where no forward took the token (the last response token, never fed back). None: a dense model, or an
    # engine that does not record them (vLLM). Left out of ==: a tensor has no single truth value.
    routed_experts: torch.Tensor | None = dataclasses.field(default=None, compare=False)


@dataclass
class EngineStats:
    """Counters over an engine's life; the difference of two snapshots is what the calls between them did."""

    decode_steps: int = 0  # decode steps (a step advances every running sequence by one token)
    decode_row_steps: int = 0  # the sequences running, summed over decode steps (/ steps: the batch a step ran)
    prefill_tokens: int = 0  # prompt tokens prefilled, past those whose KV was kept (an engine that counts them)

    def __sub__(self, other: EngineStats) -> EngineStats:
        return EngineStats(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


def prompt_groups(prompts: list[list[int]], prior: list[int] | None = None) -> list[list[int]]:
    """The indices of each distinct prompt (with its prior tokens: a continued sample asks for fewer), in the order
    each first appears: the samples that one prefill serves."""
    groups: dict[tuple[tuple[int, ...], int], list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault((tuple(prompt), prior[i] if prior else 0), []).append(i)
    return list(groups.values())


def cut_at_stop(out: Completion, stop_text: StopText) -> Completion:
    """`out` up to and with the token that completes a stop string, which ended it ("stop"); as it is without one."""
    end = stop_text.cut(out.token_ids)
    if end is None or end == len(out.token_ids) and out.finish_reason == "stop":
        return out
    routed = out.routed_experts
    if routed is not None:  # the tokens cut off the end lose their routing too
        routed = routed[:, : routed.shape[1] - (len(out.token_ids) - end)]
    return dataclasses.replace(out, token_ids=out.token_ids[:end], logprobs=out.logprobs[:end], finish_reason="stop",
                               routed_experts=routed)


def cut_before_telling(on_finish: Callable[[dict[int, Completion]], bool | None],
                       stop_text: StopText) -> Callable[[dict[int, Completion]], bool | None]:
    """`on_finish` told of finished requests as cut at the stop text."""
    return lambda finished: on_finish({i: cut_at_stop(out, stop_text) for i, out in finished.items()})


class Engine(abc.ABC):
    """`generate(prompts, params, on_finish, prior, keep)`: `on_finish({index: completion})` is told which requests
    just finished, with what they generated (a caller may act on them while the rest generate); when it answers
    true the call ends early, and unfinished requests come back with the tokens they have ("abort"). `prior[i]`:
    response tokens prompt i already ends with (a sample continued from an earlier call, counted against
    max_new_tokens); the engine computes their KV anew, under the weights it holds now. `keep[i]`: a key under which
    the engine may keep request i's KV when it finishes, for a later call whose prompt goes on from it under the
    same key (an episode's next turn); `release(keys)` lets it go. The native engine then prefills only the tokens
    after the kept ones; vLLM ignores keys (its prefix cache serves the prefix). An engine keeps nothing across a
    weight load, reset_prefix_cache or sleep."""

    matches_stop_text = False  # ends sequences at stop text itself (else: stop ids, then a cut; module docstring)
    max_stop_ids: int | None = None  # the most stop ids a call may pass (None: any number)

    def __init__(self, max_context_len: int):
        self.max_context_len = max_context_len
        self.asleep = dict.fromkeys(TAGS, False)
        self.weights_loaded = False  # a load since the engine was built or last slept at level 2
        self.generating = False
        self.stats = EngineStats()
        self.calls: list[str] = []  # weight loads and memory transitions, in order

    # ------------------------------------------------------------------ memory and weights

    def sleep(self, level: int) -> None:
        if level not in (0, 1, 2):
            raise ValueError(f"sleep level must be 0, 1 or 2, got {level}")
        self._refuse_while_generating(f"sleep({level})")
        self.calls.append(f"sleep({level})")
        if level == 0:
            return
        self._sleep(level)
        self.asleep = dict.fromkeys(TAGS, True)
        if level == 2:
            self.weights_loaded = False

    def wake_up(self, tags: list[str] | None = None) -> None:
        tags = list(tags or TAGS)
        unknown = sorted(set(tags) - set(TAGS))
        if unknown:
            raise ValueError(f"unknown wake-up tags {unknown}; expected some of {TAGS}")
        self._refuse_while_generating("wake_up")
        self.calls.append(f"wake_up({','.join(tags)})")
        asleep = [tag for tag in TAGS if tag in tags and self.asleep[tag]]
        if asleep:
            self._wake_up(asleep)
        for tag in tags:
            self.asleep[tag] = False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Takes HF-named full tensors, consumed one by one as the iterator yields them (no second full copy of the
        model exists); a first load, and the first after a level-2 sleep, must cover every parameter."""
        if self.asleep["weights"]:
            raise RuntimeError("load_weights on a sleeping engine: call wake_up(['weights']) first")
        self._refuse_while_generating("load_weights")
        self.calls.append("load_weights")
        self._load_weights(weights)
        self.weights_loaded = True

    def reset_prefix_cache(self) -> None:
        """Drops every prompt's KV the engine keeps between calls."""
        self._refuse_while_generating("reset_prefix_cache")
        self.calls.append("reset_prefix_cache")
        self._reset_prefix_cache()

    def release(self, keys: Iterable[Hashable]) -> None:
        """Lets go of the sequences kept under `keys` (those it holds)."""
        self._refuse_while_generating("release")
        self._release(keys)

    def close(self) -> None:
        """Releases what the engine holds; the engine is not used again."""
        self._close()

    def _refuse_while_generating(self, what: str) -> None:
        if self.generating:
            raise RuntimeError(f"{what} while a generate() call runs: the engine's memory and weights change only "
                               f"between calls")

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 on_finish: Callable[[dict[int, Completion]], bool | None] | None = None,
                 prior: list[int] | None = None, keep: list[Hashable | None] | None = None) -> list[Completion]:
        self.check_request(prompts, params, prior, keep)
        cut = params.stop_text if params.stop_text is not None and not self.matches_stop_text else None
        if cut is not None:
            params = dataclasses.replace(params, stop_token_ids=tuple(dict.fromkeys(
                [*params.stop_token_ids, *cut.stopping_tokens()])))
            if on_finish is not None:
                on_finish = cut_before_telling(on_finish, cut)
        self.generating = True
        try:
            out = self._generate(prompts, params, on_finish, prior or [0] * len(prompts), keep)
        finally:
            self.generating = False
        return out if cut is None else [cut_at_stop(c, cut) for c in out]

    def check_request(self, prompts: list[list[int]], params: SamplingParams, prior: list[int] | None,
                      keep: list[Hashable | None] | None) -> None:
        """Refuses a call the engine cannot serve as asked, before any work."""
        if self.generating:
            raise RuntimeError("generate() while a generate() call runs")
        if any(self.asleep.values()):
            raise RuntimeError(f"generate on a sleeping engine ({self.asleep}); call wake_up() first")
        if not self.weights_loaded:
            raise RuntimeError("generate before weights were loaded (since the engine was built or slept at "
                               "level 2): call load_weights first")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt: every prompt needs at least one token")
        if prior is not None and len(prior) != len(prompts):
            raise ValueError(f"prior counts {len(prior)} samples for {len(prompts)} prompts: one per prompt")
        prior = prior or [0] * len(prompts)
        if any(not 0 <= done < min(params.max_new_tokens, len(p)) for p, done in zip(prompts, prior)):
            raise ValueError(f"prior response tokens must be fewer than max_new_tokens ({params.max_new_tokens}) "
                             f"and than the prompt's tokens")
        longest = max((len(p) - done for p, done in zip(prompts, prior)), default=0)
        if longest + params.max_new_tokens > self.max_context_len:
            raise ValueError(f"prompt of {longest} tokens + max_new_tokens {params.max_new_tokens} exceeds the "
                             f"engine's max_context_len {self.max_context_len}")
        if keep is not None and len(keep) != len(prompts):
            raise ValueError(f"keep names {len(keep)} keys for {len(prompts)} prompts: one (or None) per prompt")
        if not params.temperature > 0:
            raise ValueError(f"temperature must be > 0 (logprobs are under the tempered distribution), got "
                             f"{params.temperature}; for greedy decoding pass top_k=1")
        if self.max_stop_ids is not None and len(params.stop_token_ids) > self.max_stop_ids:
            raise ValueError(f"at most {self.max_stop_ids} stop token ids, got {len(params.stop_token_ids)}")

    # ------------------------------------------------------------------ what each engine implements

    @abc.abstractmethod
    def _generate(self, prompts: list[list[int]], params: SamplingParams,
                  on_finish: Callable[[dict[int, Completion]], bool | None] | None, prior: list[int],
                  keep: list[Hashable | None] | None) -> list[Completion]:
        """The completions of a checked call (`generate`): `prior` is a list, `params` holds the stop ids."""

    @abc.abstractmethod
    def _load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies the HF-named tensors into the engine's weights as the iterator yields them."""

    @abc.abstractmethod
    def _sleep(self, level: int) -> None:
        """Level 1 or 2, from any state; `self.asleep` still says what was awake."""

    @abc.abstractmethod
    def _wake_up(self, tags: list[str]) -> None:
        """Restores `tags`, each asleep now."""

    def _reset_prefix_cache(self) -> None:
        pass

    def _release(self, keys: Iterable[Hashable]) -> None:
        pass

    def _close(self) -> None:
        pass
