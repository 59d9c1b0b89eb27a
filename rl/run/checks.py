"""Start-up checks of the model folder against the tokenizer and the rollout settings.

Pure functions, run once before any weights are loaded. Each mismatch they catch would otherwise
fail late and obscurely: a token id past the embedding is an `IndexError` on the CPU and a device
assert on a GPU; an EOS id the model cannot produce lets every response run to `max_new_tokens`;
a context past the model's positions silently extrapolates RoPE. Each raises a `ConfigError` whose
one line names the keys, folders and ids involved.
"""

from __future__ import annotations

from pathlib import Path

from rl.config import ConfigError, ModelConfig, RolloutConfig
from rl.rollout.native import MAX_STOP_IDS


def check_model_and_tokenizer(model_cfg: ModelConfig, rollout_cfg: RolloutConfig, hf_config, tokenizer) -> list[int]:
    """All start-up checks; returns the EOS and stop ids to sample with (each one the model can produce)."""
    text_config = hf_config.get_text_config()
    if rollout_cfg.engine == "native":
        check_native_architecture(model_cfg.path, text_config)
        if text_config is not hf_config:  # the engine builds its model from the folder's own config
            raise ConfigError(f"model.path {model_cfg.path!r}: model_type {hf_config.model_type!r} wraps a "
                              f"{text_config.model_type!r} text model; the native engine runs the text model's own "
                              f"folder (its config.json of model_type {text_config.model_type!r}); "
                              f"rollout.engine = 'vllm' serves it")
    check_vocab(model_cfg, text_config.vocab_size, len(tokenizer))
    check_positions(rollout_cfg.max_context_len, model_cfg.path, getattr(text_config, "max_position_embeddings", None))
    eos_ids = usable_eos_ids(model_cfg, rollout_cfg.stop_token_ids, tokenizer.eos_token_id, text_config.vocab_size)
    stops = set(rollout_cfg.stop_token_ids) | set(eos_ids)
    if rollout_cfg.engine == "native" and len(stops) > MAX_STOP_IDS:
        raise ConfigError(f"rollout.stop_token_ids: {len(stops)} stop ids with the model's EOS ids {eos_ids}; the "
                          f"native engine checks at most {MAX_STOP_IDS} at each step")
    return eos_ids


def check_native_architecture(model_path: str, text_config) -> None:
    """The native engine computes this model's forward (its own, not the HF one), or one line says why not."""
    from rl.model.decoder import Shape

    try:
        Shape.from_hf(text_config)
    except ValueError as e:
        raise ConfigError(f"model.path {model_path!r}: {e}; rollout.engine = 'vllm' serves it "
                          f"(docs/engines.md, model families)") from None


def _tokenizer_key(model_cfg: ModelConfig) -> str:
    return f"model.tokenizer {model_cfg.tokenizer!r}" if model_cfg.tokenizer else f"model.path {model_cfg.path!r}"


def check_vocab(model_cfg: ModelConfig, vocab_size: int, tokenizer_len: int) -> None:
    """Every id the tokenizer can emit must index a row of the model's embedding."""
    if tokenizer_len > vocab_size:
        raise ConfigError(f"{_tokenizer_key(model_cfg)}: the tokenizer has {tokenizer_len} tokens but the model "
                          f"(config.json of model.path {model_cfg.path!r}) has vocab_size {vocab_size}: ids >= "
                          f"{vocab_size} would index past the embedding; use the model's own tokenizer")


def check_positions(max_context_len: int, model_path: str, max_position_embeddings: int | None) -> None:
    if max_position_embeddings is not None and max_context_len > max_position_embeddings:
        raise ConfigError(f"rollout.max_context_len ({max_context_len}) exceeds max_position_embeddings "
                          f"({max_position_embeddings}) in config.json of model.path {model_path!r}: lower "
                          f"rollout.max_context_len (with data.max_prompt_len and rollout.max_new_tokens)")


def generation_config_eos_ids(model_path: str) -> list[int]:
    """`eos_token_id` of the folder's generation_config.json (an int or a list), or [] without one."""
    if not (Path(model_path).expanduser() / "generation_config.json").is_file():
        return []
    from transformers import GenerationConfig

    return _as_ids(GenerationConfig.from_pretrained(model_path).eos_token_id)


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def usable_eos_ids(model_cfg: ModelConfig, stop_token_ids: list[int], tokenizer_eos, vocab_size: int) -> list[int]:
    """The union of the tokenizer's EOS, generation_config.json's EOS and rollout.stop_token_ids, keeping
    the ids the model can produce (< vocab_size); raises when none is left."""
    bad_stops = [i for i in stop_token_ids if not 0 <= i < vocab_size]
    if bad_stops:
        raise ConfigError(f"rollout.stop_token_ids {bad_stops}: not ids the model can produce "
                          f"(model.path {model_cfg.path!r} has vocab_size {vocab_size})")
    candidates = list(dict.fromkeys([*_as_ids(tokenizer_eos), *generation_config_eos_ids(model_cfg.path),
                                     *stop_token_ids]))
    usable = [i for i in candidates if 0 <= i < vocab_size]
    if not candidates:
        raise ConfigError(f"no EOS token: neither the tokenizer of {_tokenizer_key(model_cfg)} nor "
                          f"generation_config.json of model.path {model_cfg.path!r} names one, and "
                          f"rollout.stop_token_ids is empty; every response would run to rollout.max_new_tokens "
                          f"(set rollout.stop_token_ids)")
    if not usable:
        raise ConfigError(f"EOS ids {candidates} (tokenizer of {_tokenizer_key(model_cfg)} and generation_config.json)"
                          f" are all >= the model's vocab_size {vocab_size}: the model can never stop; set "
                          f"rollout.stop_token_ids")
    return usable
