"""Rollout: the engines (one contract, rl/rollout/engine.py) and the function that turns prompt groups into
responses."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from tqdm import tqdm

from rl.config import RolloutConfig
from rl.data import Sample, Status
from rl.rollout.engine import Completion, Engine, EngineStats, SamplingParams, derive_seed  # noqa: F401


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
        fed = len(sample.tokens) - 1  # the tokens the sample's routing already covers as inputs
        sample.append_response_tokens(out.token_ids, out.logprobs, version=weight_version)
        if out.routed_experts is not None:
            sample.routed_experts = merge_routing(sample.routed_experts, out.routed_experts, fed, sample)
        sample.status = {"stop": Status.COMPLETED, "length": Status.TRUNCATED}.get(out.finish_reason, Status.ABORTED)
        if out.token_ids:
            sample.weight_version = weight_version
    for sample, text in zip(samples, decode_responses(tokenizer, samples), strict=True):
        sample.response = text


def merge_routing(kept, recorded, fed: int, sample: Sample):
    """A continued sample's routing: the tokens it had already fed keep the experts they were generated with
    (`kept`, the routing that sampled them: what the trainer replays), the rest take the engine's new record, which
    covers the whole sequence. RuntimeError when the record does not cover the sample's tokens."""
    if recorded.shape[1] != len(sample.tokens):
        raise RuntimeError(f"sample {sample.index}: the engine recorded routing for {recorded.shape[1]} tokens of "
                           f"its {len(sample.tokens)}")
    if kept is None or fed <= 0:
        return recorded
    merged = recorded.clone()
    merged[:, :fed] = kept[:, :fed]
    return merged


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
                 batch_invariant: bool = False) -> Engine:
    """The configured engine, built empty: weights arrive with the first sync. The rollout keys both engines read,
    and the engine's own table (rollout.native, rollout.vllm).

    Ranks of one tensor-parallel group (contiguous, `rank // tensor_parallel_size`) share a
    seed so they sample identically; groups differ."""
    dtype = engine_dtype(cfg.dtype, device)
    seed = cfg.seed + rank // cfg.tensor_parallel_size
    if cfg.engine == "vllm":
        from rl.rollout.vllm import VllmEngine

        return VllmEngine(model_path, cfg, device, dtype, seed)
    from rl.rollout.native import NativeEngine

    return NativeEngine(hf_config, device, dtype, cfg.max_batch_size, seed, max_context_len=cfg.max_context_len,
                        batch_invariant=batch_invariant, precision=cfg.precision, fp8_scale=cfg.fp8_scale,
                        kv_precision=cfg.kv_precision,
                        **dataclasses.asdict(cfg.native))


def engine_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)
