"""Rollout: the engine interface and the function that turns prompt groups into responses.

Every engine speaks token ids in and token ids out (no re-tokenisation) and
reports, per sampled token, its log-probability under the temperature-scaled
full-vocabulary distribution: exactly what the trainer recomputes, so the two can
be compared token by token. Engines sleep and wake by tags like vLLM's
("weights", "kv_cache") so the trainer can borrow their memory.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
from tqdm import tqdm

from rl.config import RolloutConfig
from rl.data import Sample, Status
from rl.rollout.stop_text import StopText


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


class Engine(Protocol):
    """`generate(prompts, params, on_finish, prior)`: `on_finish({index: completion})` is told which requests just
    finished, with what they generated (a caller may act on them while the rest generate); when it answers true
    the call ends early, and unfinished requests come back with the tokens they have
    ("abort"). `prior[i]`: response tokens prompt i already ends with (a sample continued from an earlier call,
    counted against max_new_tokens); the engine computes their KV anew, under the weights it holds now.
    `keep[i]`: a key under which the engine may keep request i's KV when it finishes, for a later call whose
    prompt i' goes on from it under the same key (an episode's next turn); `release(keys)` lets it go. The native
    engine then prefills only the tokens after the kept ones; vLLM ignores keys (its prefix cache serves the
    prefix). An engine keeps nothing across a weight load, reset_prefix_cache or sleep."""

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 on_finish: Callable[[dict[int, Completion]], bool | None] | None = None,
                 prior: list[int] | None = None, keep: list[Hashable | None] | None = None) -> list[Completion]: ...
    def release(self, keys: Iterable[Hashable]) -> None: ...
    def sleep(self, level: int) -> None: ...
    def wake_up(self, tags: list[str] | None = None) -> None: ...
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...
    def reset_prefix_cache(self) -> None: ...
    def close(self) -> None: ...


def generate_rollout(engine: Engine, groups: list[list[Sample]], params: SamplingParams, weight_version: int,
                     tokenizer, progress: bool = False, until: Callable[[list[Sample]], bool] | None = None
                     ) -> list[Sample]:
    """Generates every sample of `groups` (whole groups together so prompts can share KV), each where it left
    off. `until(finished samples)`, when given, may end the call early: samples still unfinished come back
    ABORTED, holding what they generated, to be continued by a later call."""
    samples = [s for group in groups for s in group]
    bar = tqdm(total=len(samples), desc="rollout", unit="sample", disable=not progress, leave=False)

    def on_finish(finished: dict[int, Completion]) -> bool:
        bar.update(len(finished))
        return until is not None and until([samples[i] for i in finished])

    completions = engine.generate([s.tokens for s in samples], params, on_finish=on_finish,
                                  prior=[s.response_length for s in samples])
    bar.close()
    append_completions(samples, completions, weight_version, tokenizer)
    return samples


def append_completions(samples: list[Sample], completions: list[Completion], weight_version: int,
                       tokenizer) -> None:
    """Appends each completion to its sample: tokens, logprobs, the weight version and the status it ends in, and
    the response's text (`decode_responses`)."""
    for sample, out in zip(samples, completions, strict=True):
        sample.append_response_tokens(out.token_ids, out.logprobs, version=weight_version)
        sample.status = {"stop": Status.COMPLETED, "length": Status.TRUNCATED}.get(out.finish_reason, Status.ABORTED)
        if out.token_ids:
            sample.weight_version = weight_version
    for sample, text in zip(samples, decode_responses(tokenizer, samples), strict=True):
        sample.response = text


def decode_responses(tokenizer, samples: list[Sample]) -> list[str]:
    """The samples' response texts, special tokens left out, as `tokenizer.decode` gives them. A fast tokenizer
    whose decoding needs no Python clean-up decodes them all in one call of its Rust backend, spread over the
    host's cores (a Python call per sample cost 1.4-3x the backend's own decoding, one sample at a time)."""
    ids = [s.tokens[s.prompt_length:] for s in samples]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return tokenizer.batch_decode(ids, skip_special_tokens=True)
    return backend.decode_batch(ids, skip_special_tokens=True)


def build_engine(cfg: RolloutConfig, model_path: str, hf_config, device: torch.device, rank: int,
                 batch_invariant: bool = False):
    """The configured engine, built empty: weights arrive with the first sync.

    Ranks of one tensor-parallel group (contiguous, `rank // tensor_parallel_size`) share a
    seed so they sample identically; groups differ."""
    dtype = engine_dtype(cfg.dtype, device)
    seed = cfg.seed + rank // cfg.tensor_parallel_size
    if cfg.engine == "vllm":
        from rl.rollout.vllm import VllmEngine

        return VllmEngine(model_path, cfg, device, dtype, seed)
    from rl.rollout.native import NativeEngine

    return NativeEngine(hf_config, device, dtype, cfg.max_batch_size, seed, max_context_len=cfg.max_context_len,
                        kv_cache_tokens=cfg.kv_cache_tokens, cuda_graphs=cfg.cuda_graphs,
                        steps_per_poll=cfg.steps_per_poll, batch_invariant=batch_invariant)


def engine_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)
