"""A pure-PyTorch rollout engine: the policy architecture in inference mode with a KV cache.

It holds its own copy of the model in the engine dtype, built empty and filled by
`load_weights` (the trainer pushes every parameter and buffer after each optimizer
step; the engine never reads a checkpoint). Generation runs whole batches of
left-padded prompts through one KV cache; sampling (temperature, top-k, top-p) and
the sampled token's log-probability happen on the device. Sleep levels mirror
vLLM's: level 1 keeps weights in host memory, level 2 drops them; both free the KV.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from rl.rollout import Completion, SamplingParams

TAGS = ("weights", "kv_cache")


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples one token per row; returns (tokens (B,), logprobs (B,)).

    The log-probability is taken under the full tempered distribution, not the
    top-k/top-p truncated one, because that is what the trainer recomputes.
    """
    logits = logits.float() / temperature  # (B, V)
    logprobs = torch.log_softmax(logits, dim=-1)
    filtered = logits
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(filtered, dim=-1, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p  # keeps the first token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        filtered = filtered.masked_fill(drop, float("-inf"))
    probs = torch.softmax(filtered, dim=-1)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


class NativeEngine:
    def __init__(self, hf_config, device: torch.device, dtype: torch.dtype, max_batch_size: int = 256,
                 seed: int = 0, attn_implementation: str = "sdpa"):
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_batch_size = max_batch_size
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=attn_implementation)
        self.model = model.to_empty(device=self.device).eval().requires_grad_(False)
        # transformers renamed `past_key_values` to `cache` (5.2x); speak whichever this version takes.
        self.cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.pad_token_id = 0
        self.asleep = {tag: False for tag in TAGS}
        self.weights_valid = False  # nothing loaded yet
        self.loaded_names: set[str] = set()

    # ------------------------------------------------------------------ weights and memory

    def _tensors(self) -> dict[str, torch.Tensor]:
        named = dict(self.model.named_parameters(remove_duplicate=False))
        named.update(self.model.named_buffers(remove_duplicate=False))
        return named

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies tensors in place by name; a first (or post-level-2) load must cover every tensor."""
        if self.asleep["weights"]:
            raise RuntimeError("load_weights on a sleeping engine: call wake_up(['weights']) first")
        targets = self._tensors()
        for name, tensor in weights:
            if name not in targets:
                raise KeyError(f"engine has no tensor named {name!r}")
            if targets[name].shape != tensor.shape:
                raise ValueError(f"{name}: engine shape {tuple(targets[name].shape)} != pushed {tuple(tensor.shape)}")
            targets[name].copy_(tensor)
            self.loaded_names.add(name)
        # Buckets arrive in several calls; the engine is usable once every tensor has been written.
        self.weights_valid = not (targets.keys() - self.loaded_names)

    def sleep(self, level: int) -> None:
        if level == 0:
            return
        if level == 1:
            self.model.to("cpu")
        elif level == 2:
            self.model.to("meta")
            self.weights_valid = False
            self.loaded_names.clear()
        else:
            raise ValueError(f"sleep level must be 0, 1 or 2, got {level}")
        self.asleep = {tag: True for tag in TAGS}
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self, tags: list[str] | None = None) -> None:
        for tag in tags or TAGS:
            if tag not in TAGS:
                raise ValueError(f"unknown wake-up tag {tag!r}; expected one of {TAGS}")
            if tag == "weights" and self.asleep["weights"]:
                if self.weights_valid:
                    self.model.to(self.device)
                else:
                    self.model.to_empty(device=self.device)
            self.asleep[tag] = False

    def reset_prefix_cache(self) -> None:
        """No KV outlives a generate() call here, so there is no prefix cache to invalidate."""

    def close(self) -> None:
        self.model = None

    # ------------------------------------------------------------------ generation

    def _check_ready(self) -> None:
        if any(self.asleep.values()):
            raise RuntimeError(f"generate on a sleeping engine ({self.asleep}); call wake_up() first")
        if not self.weights_valid:
            missing = sorted(self._tensors().keys() - self.loaded_names)
            raise RuntimeError(f"engine weights incomplete; missing e.g. {missing[:3]}")

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 on_finish: Callable[[int], None] | None = None) -> list[Completion]:
        self._check_ready()
        out: list[Completion] = []
        for start in range(0, len(prompts), self.max_batch_size):
            batch = self._generate_batch(prompts[start : start + self.max_batch_size], params)
            out.extend(batch)
            if on_finish is not None:
                on_finish(len(batch))
        return out

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        batch, width = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding keeps every row's next token in the last column
            input_ids[i, width - len(p):] = torch.tensor(p)
            attention_mask[i, width - len(p):] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        stop_ids = torch.tensor(params.stop_token_ids or [-1], device=self.device)

        cache = DynamicCache()
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=True, logits_to_keep=1, **{self.cache_kwarg: cache}).logits[:, -1]
        done = torch.zeros(batch, dtype=torch.bool, device=self.device)
        stopped = torch.zeros_like(done)
        tokens, logprobs = [], []
        for _ in range(params.max_new_tokens):
            tok, lp = sample_tokens(logits, params.temperature, params.top_p, params.top_k, self.generator)
            tok = tok.masked_fill(done, self.pad_token_id)
            tokens.append(tok)
            logprobs.append(lp)
            hit_stop = torch.isin(tok, stop_ids) & ~done
            stopped |= hit_stop
            done |= hit_stop
            if len(tokens) == params.max_new_tokens or bool(done.all()):
                break
            attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
            position_ids = position_ids[:, -1:] + 1
            logits = self.model(input_ids=tok[:, None], attention_mask=attention_mask, position_ids=position_ids,
                                use_cache=True, **{self.cache_kwarg: cache}).logits[:, -1]
        return self._completions(torch.stack(tokens, 1), torch.stack(logprobs, 1), stopped, stop_ids)

    @staticmethod
    def _completions(tokens: torch.Tensor, logprobs: torch.Tensor, stopped: torch.Tensor,
                     stop_ids: torch.Tensor) -> list[Completion]:
        # A row's response ends at its first stop token (inclusive) or at max_new_tokens.
        is_stop = torch.isin(tokens, stop_ids)
        first_stop = torch.where(is_stop.any(1), is_stop.float().argmax(1), tokens.shape[1] - 1)
        lengths = (first_stop + 1).tolist()
        tokens, logprobs, stopped = tokens.tolist(), logprobs.float().tolist(), stopped.tolist()
        return [Completion(tokens[i][:n], logprobs[i][:n], "stop" if stopped[i] else "length")
                for i, n in enumerate(lengths)]
