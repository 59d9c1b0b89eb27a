"""The pure-PyTorch rollout engine: paged KV cache, continuous batching, CUDA-graph decode steps.

The engine holds its own copy of the policy (rl/model/decoder.py) in the engine dtype, built
empty and filled by `load_weights` with the HF names the trainer pushes; with `precision="fp8"` each block's
matrices are quantized to FP8 as they arrive (rl/model/fp8.py), the rest copied as they are. A generate() call keeps
up to `max_batch_size` sequences in fixed rows of device-resident state (last token, position,
block table, ...). One decode step — forward, sampling, recording the token and its logprob,
stop checks, advancing the row — runs entirely on the device, so on CUDA it is captured once per
batch-size bucket and replayed; the host looks at the rows only every `steps_per_poll` steps,
collects finished sequences, compacts the survivors to the front and refills the free rows from
the waiting queue at once (prefilling each distinct prompt once; rl/rollout/scheduler.py). When
no request waits, that look happens behind the next chunk of steps (see `generate`).

A call may keep finished sequences' KV under the caller's keys (`keep`): a later call whose prompt goes on
from a kept sequence (an episode's next turn: the model's turn, then what its environment appended) reuses
those pages and prefills only the tokens after them (rl/rollout/scheduler.py). Kept KV is dropped when
the caller releases it, when pages run short, and whenever it could go stale: new weights, a prefix-cache
reset, sleep.

Sliding-window layers (Gemma 3's local ones) keep their KV in a second, smaller cache (`kv_window`) where each
sequence holds only its last window: a running row writes its tokens into a ring of `cdiv(window, page_size)` pages
that decode steps recycle in place (its block table into that cache never changes, so graphs replay it), and pages
outside every later token's window go back once a prompt is prefilled (rl/rollout/scheduler.py says how, and why two
caches). That cache is sized by rows, not by context (`window_cache_pages`), so a long Gemma 3 rollout's KV grows with
its global layers alone.

Sleep levels mirror vLLM's: level 1 moves the weights to pinned host memory and frees the KV
cache, level 2 frees both; `wake_up(tags)` restores what is asked. Graphs hold raw pointers: on a
CUDA driver with virtual memory management, weights and cache live in address ranges that survive
sleep (rl/rollout/vmem.py), so the graphs are kept; elsewhere they are dropped at sleep and
re-captured on first use.

A mixture-of-experts model's forward returns the top-k expert ids each token took in each MoE layer: the prefill's
for every prompt token, each decode step's for the token it fed, written into the row's columns as its token was.
Each completion carries them for its prompt and response tokens (`Completion.routed_experts`), so the trainer can
replay them; a kept sequence keeps its routing beside its KV, and a prompt continued from it (or from a shared
base) takes the routing of the tokens it did not prefill from there. Their decode steps run in CUDA graphs where the
experts run as torch's grouped GEMM (bf16 on a recent GPU, rl/model/moe.py's `grouped_mm_runs`), whose segments stay
on the device; elsewhere the loop over experts reads each expert's count on the host, and they decode eagerly.

Qwen3.5's linear-attention (Gated DeltaNet) layers keep a state per sequence instead of KV: the short convolution's
last inputs and the delta rule's matrix (`LinearState`). Each running row holds its own in `Rows` (row i's state at
index i, moved with the row when rows compact), a decode step advances the live rows' states in place, and a prefill
runs those layers over the prompts packed end to end, each from the state after its cached tokens (zero for a fresh
prompt, a kept sequence's, or its base's) to the state after its last token, which the prompt holds until its last
request starts: each request copies it into its row. A kept sequence keeps its row's state beside its KV, so a turn
continued from it goes on from there. Their decode steps run in CUDA graphs as a dense model's do: the states are
`Rows` tensors at fixed addresses and the step (`gated_deltanet_step_`, its delta rule one Triton kernel over them)
reads nothing on the host; the prefill, which packs the prompts by their lengths on the host, runs outside graphs, as
every prefill does.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

import torch

from rl.model.decoder import DecoderModel, LinearState, WindowCache
from rl.model.kernels.attention import invariant_num_splits
from rl.model.moe import grouped_mm_runs
from rl.rollout import vmem
from rl.rollout.engine import TAGS, Completion, Engine, SamplingParams
from rl.rollout.scheduler import Kept, PagePool, PromptKV, Request, Scheduler, cdiv
from rl.rollout.stop_text import STOPPED

# Stop ids a call may pass: the torch bookkeeping compares each token with all the slots, the fused GPU step
# with the call's ids alone (rl/model/kernels/advance_triton.py).
MAX_STOP_IDS = 512
# Padded prompt tokens per prefill forward, the kept ones of a continued prompt included (bounds its activation
# memory, and the keys and values its attention reads back from the cache).
PREFILL_TOKENS = 16384
PAGE_SIZE = 64  # KV cache tokens per page
EXPERT_IDS = torch.int16  # the recorded expert ids (MoE models have at most a few hundred experts)


def kv_cache_pages(kv_cache_tokens: int, max_batch_size: int, max_context_len: int, page_size: int = PAGE_SIZE) -> int:
    """Pages of the KV cache, the scratch page idle rows attend to included. `kv_cache_tokens` 0: a full batch of
    the longest sequences fits, each holding a page more than its length needs (its copy of the prompt's last,
    partial page)."""
    if kv_cache_tokens:
        return cdiv(kv_cache_tokens, page_size) + 1
    return max_batch_size * (cdiv(max_context_len, page_size) + 1) + 1


def window_layers(shape, max_context_len: int, page_size: int = PAGE_SIZE) -> tuple[int, ...]:
    """The layers whose KV the engine keeps in its window cache: the sliding-window ones, where a window's ring of
    pages is shorter than the longest sequence (a longer window saves nothing and stays with the global layers)."""
    return tuple(i for i in range(shape.num_layers)
                 if 0 < shape.window(i) and cdiv(shape.window(i), page_size) < cdiv(max_context_len, page_size))


def window_cache_pages(window: int, max_batch_size: int, max_context_len: int, page_size: int = PAGE_SIZE,
                       window_cache_tokens: int = 0) -> int:
    """Pages of the window cache, its scratch page included. `window_cache_tokens` 0: every row's ring
    (cdiv(window, page_size) pages) and its prompt's last window (at most that and two pages more), and one prefill's
    prompts held whole while they are prefilled (the longest sequence, or PREFILL_TOKENS, whichever is longer)."""
    if window_cache_tokens:
        return cdiv(window_cache_tokens, page_size) + 1
    ring = cdiv(window, page_size)
    prefill = cdiv(max(max_context_len, PREFILL_TOKENS), page_size)
    return max_batch_size * (2 * ring + 2) + prefill + 1


def prefill_chunks(lengths: list[int], budget: int) -> list[list[int]]:
    """The prompts of one prefill, as index lists of padded forwards of at most `budget` tokens (a prompt longer
    than that goes alone). Shortest first: a chunk pads to its longest, and prompts of mixed lengths (continued
    samples of a partial rollout, 150 to 4,000 tokens, among fresh 150-token prompts) in arrival order padded
    ~2.8x the real tokens, against ~1.1x sorted."""
    chunks: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):  # each prompt is its chunk's longest so far
        if chunks and lengths[i] * (len(chunks[-1]) + 1) <= budget:
            chunks[-1].append(i)
        else:
            chunks.append([i])
    return chunks


def truncate_logits(logits: torch.Tensor, top_k: int, top_p: float | torch.Tensor | None) -> torch.Tensor:
    """Sets logits outside the top-k / top-p nucleus to -inf (top_p None: no nucleus cut)."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop_sorted = probs.cumsum(dim=-1) - probs >= top_p  # always keeps the first token
        logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))
    return logits


def pick_tokens(scaled: torch.Tensor, top_k: int, top_p: float | torch.Tensor | None,
                draw: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of the tempered float32 logits `scaled` (B, V), and its log-probability.

    top_k == 1 is plain arg-max (greedy, ties to the lowest id, no noise); otherwise `draw` samples
    from the top-k / top-p truncated logits. The log-probability is taken under the full tempered
    distribution, not the truncated one, because that is what the trainer recomputes.
    """
    tokens = scaled.argmax(dim=-1) if top_k == 1 else draw(truncate_logits(scaled, top_k, top_p))
    return tokens, torch.log_softmax(scaled, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples one token per row with Gumbel-max (argmax of logit - log Exp(1)); returns (tokens
    (B,), logprobs (B,)) as `pick_tokens` defines them."""

    def gumbel_max(filtered: torch.Tensor) -> torch.Tensor:
        noise = torch.empty_like(filtered).exponential_(generator=generator)
        return (filtered - noise.log()).argmax(dim=-1)

    return pick_tokens(logits.float() / temperature, top_k, top_p if top_p < 1.0 else None, gumbel_max)


def decode_splits(rows: int, num_kv_heads: int, head_dim: int, num_sms: int) -> int:
    """KV splits per sequence in decode attention: enough work units to cover the GPU ~4 times.

    A program over a 128-wide head reads twice the bytes per token of a 64-wide one and counts
    twice. The cap of 16 is for the long tail: few rows with long contexts want many splits, while
    short contexts would do better with fewer (benchmarks/ARCHIVE.md, "Splits by batch rows").
    """
    units = rows * num_kv_heads * max(1, head_dim // 64)
    return min(16, 1 << max(0, (cdiv(4 * num_sms, units) - 1).bit_length()))


@dataclass
class Rows:
    """Per-row decode state on the device; a graph reads and advances the first `bucket` rows."""

    input_ids: torch.Tensor  # (R,) last token, fed next
    positions: torch.Tensor  # (R,) its position
    slots: torch.Tensor  # (R,) KV slot its key/value go to
    context_lens: torch.Tensor  # (R,) int32, tokens attended to, itself included
    block_tables: torch.Tensor  # (R, max pages) int32
    done: torch.Tensor  # (R,) bool; idle rows are done
    n_gen: torch.Tensor  # (R,) tokens generated
    out_tokens: torch.Tensor  # (R, max_context_len + 1); the last column swallows writes of done rows
    out_logprobs: torch.Tensor
    inv_temperature: torch.Tensor  # (1,) the sampling parameters of the current call
    top_p: torch.Tensor
    max_new_tokens: torch.Tensor
    stop_ids: torch.Tensor  # (MAX_STOP_IDS,) padded with -1
    stop_state: torch.Tensor  # (R,) int32, each row's state in the call's stop text (STOPPED: it ended there)
    # (R, width, MoE layers, k) the expert ids of each fed token, in its token's column (-1: not fed); None: dense
    out_experts: torch.Tensor | None = None
    # (R, max pages) int32, each row's block table into the window cache (its ring, repeated); None: no window cache
    window_tables: torch.Tensor | None = None
    # each row's linear-attention states, (R, linear layers, channels, kernel - 1) and (R, linear layers, Hv, K, V)
    conv_state: torch.Tensor | None = None
    recurrent_state: torch.Tensor | None = None

    @classmethod
    def allocate(cls, rows: int, max_pages: int, width: int, device: torch.device,
                 moe: tuple[int, int] | None = None, windowed: bool = False,
                 linear: tuple[tuple[int, ...], tuple[int, ...], torch.dtype] | None = None,
                 states: tuple[torch.Tensor, torch.Tensor] | None = None) -> Rows:
        """`moe`: (MoE layers, experts per token) of a model whose routing is recorded; `windowed`: the engine has a
        window cache; `linear`: a row's conv and recurrent state shapes and the conv state's dtype; `states`: the
        (conv, recurrent) state tensors of all rows to use (memory the engine maps and unmaps with its KV, zeroed
        by `clear`), else fresh ones."""
        long = dict(dtype=torch.long, device=device)
        return cls(torch.zeros(rows, **long), torch.zeros(rows, **long), torch.zeros(rows, **long),
                   torch.ones(rows, dtype=torch.int32, device=device),
                   torch.zeros(rows, max_pages, dtype=torch.int32, device=device),
                   torch.ones(rows, dtype=torch.bool, device=device), torch.zeros(rows, **long),
                   torch.zeros(rows, width, **long), torch.zeros(rows, width, dtype=torch.float32, device=device),
                   torch.ones(1, device=device), torch.ones(1, device=device), torch.ones(1, **long),
                   torch.full((MAX_STOP_IDS,), -1, **long), torch.zeros(rows, dtype=torch.int32, device=device),
                   None if moe is None else torch.full((rows, width, *moe), -1, dtype=EXPERT_IDS, device=device),
                   torch.zeros(rows, max_pages, dtype=torch.int32, device=device) if windowed else None,
                   *((None, None) if linear is None else states if states is not None else
                     (torch.zeros(rows, *linear[0], dtype=linear[2], device=device),
                      torch.zeros(rows, *linear[1], dtype=torch.float32, device=device))))

    def linear_states(self) -> list[torch.Tensor]:
        return [] if self.conv_state is None else [self.conv_state, self.recurrent_state]

    def per_row(self) -> list[torch.Tensor]:
        return [self.input_ids, self.positions, self.slots, self.context_lens, self.block_tables, self.done,
                self.n_gen, self.out_tokens, self.out_logprobs, self.stop_state,
                *([] if self.out_experts is None else [self.out_experts]),
                *([] if self.window_tables is None else [self.window_tables]), *self.linear_states()]

    def clear(self, start: int, end: int) -> None:
        """Makes rows [start, end) idle: done, one token of context on the scratch page, linear states zero."""
        for t in (self.input_ids, self.positions, self.slots, self.block_tables, self.n_gen, self.stop_state,
                  *([] if self.window_tables is None else [self.window_tables]), *self.linear_states()):
            t[start:end] = 0
        self.context_lens[start:end] = 1
        self.done[start:end] = True


def _aligned_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a tensor of `shape` and `dtype` in a stable buffer, rounded up to 256 so the next one starts aligned."""
    return cdiv(torch.Size(shape).numel() * dtype.itemsize, 256) * 256


class NativeEngine(Engine):
    matches_stop_text = True
    max_stop_ids = MAX_STOP_IDS

    def __init__(self, hf_config, device: torch.device, dtype: torch.dtype, max_batch_size: int = 256,
                 seed: int = 0, *, max_context_len: int = 4096, kv_cache_tokens: int = 0, cuda_graphs: bool = True,
                 steps_per_poll: int = 16, page_size: int = PAGE_SIZE, stable_memory: bool = True,
                 batch_invariant: bool = False, precision: str = "bf16", fp8_scale: str = "channel",
                 window_cache_tokens: int = 0, kv_precision: str = "auto"):
        """`window_cache_tokens`: the sliding-window layers' cache in tokens (0: `window_cache_pages`' size);
        `kv_precision` "fp8": both KV caches in FP8 e4m3 (rl/model/fp8.py), "auto": in `dtype`."""
        super().__init__(max_context_len)
        self.device, self.dtype = torch.device(device), dtype
        self.max_batch_size = max_batch_size
        self.page_size, self.steps_per_poll = page_size, steps_per_poll
        self.model = DecoderModel(hf_config, self.device, dtype, max_context_len, batch_invariant, precision, fp8_scale,
                                  kv_precision)
        self.on_gpu = self.device.type == "cuda"  # graphs, Triton sampling and bookkeeping, device syncs
        s = self.model.shape
        # A MoE block's grouped experts go in a graph where they run as torch's grouped GEMM (bf16 on a recent GPU):
        # the loop over experts that serves elsewhere reads each expert's token count on the host.
        self.use_graphs = cuda_graphs and self.on_gpu and (not s.moe_layers or grouped_mm_runs(self.device, dtype))
        self.linear = ((len(s.linear_layers), s.linear_conv_channels, s.linear_conv_kernel - 1),
                       (len(s.linear_layers), s.linear_value_heads, s.linear_key_dim, s.linear_value_dim),
                       dtype) if s.linear_layers else None
        self.moe = (len(s.moe_layers), s.experts_per_token) if s.moe_layers else None
        self.num_pages = kv_cache_pages(kv_cache_tokens, max_batch_size, max_context_len, page_size)
        self.buckets = sorted({*(b for b in (1, 2, 4, 8, *range(16, max_batch_size, 16)) if b < max_batch_size),
                               max_batch_size})
        if self.on_gpu:
            self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            self.seed = torch.full((1,), seed, dtype=torch.long, device=self.device)  # bumped on the device
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.params = SamplingParams(max_new_tokens=1)
        # The call's stop text as a transition table (rl/rollout/stop_text.py), one per set of strings, kept for
        # the engine's life: captured graphs read it by address.
        self.stop_tables: dict[tuple[str, ...], torch.Tensor] = {}
        self.stop_table: torch.Tensor | None = None
        self.kv: torch.Tensor | None = None
        self.kv_window: torch.Tensor | None = None
        self.rows: Rows | None = None
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.graph_pool = None
        # where a level-1 sleep parks the weights, kept from one sleep to the next (None after a level-2 sleep)
        self.host_weights: dict[str, torch.Tensor] | None = None
        self.required = {(key, start) for key, start, _ in self.model.name_map.values()}
        self.lay_out_memory(max_context_len, window_cache_tokens, stable_memory)
        self.loaded: set[tuple] = set()
        self.kept: dict[Hashable, Kept] = {}  # finished sequences' KV, by the caller's key (see `generate`)
        self.asleep = dict.fromkeys(TAGS, True)
        self.wake_up()
        self.calls.clear()

    # ------------------------------------------------------------------ weights and memory

    def lay_out_memory(self, max_context_len: int, window_cache_tokens: int, stable_memory: bool) -> None:
        """The global layers' KV cache and the sliding-window layers' (`window_layers`: none without such layers),
        their shapes, and with `stable_memory` (and graphs) the buffers at addresses that outlive sleep: the
        weights', and one for both caches."""
        s, page_size, dtype = self.model.shape, self.page_size, self.model.kv_dtype
        self.window_layers = window_layers(s, max_context_len, page_size)
        self.model.set_window_layers(self.window_layers)
        self.window = max((s.window(i) for i in self.window_layers), default=0)
        self.window_pages = window_cache_pages(self.window, self.max_batch_size, max_context_len, page_size,
                                               window_cache_tokens) if self.window else 0
        self.window_peak = 0  # the most window-cache pages the last call held at once
        self.kv_shape = (2, s.attention_layers - len(self.window_layers), self.num_pages * page_size, s.num_kv_heads,
                         s.head_dim)
        self.window_kv_shape = (2, len(self.window_layers), self.window_pages * page_size, s.num_kv_heads, s.head_dim)
        kv_bytes = _aligned_bytes(self.kv_shape, dtype)  # the caches' dtype
        # Weights and KV cache at addresses that outlive sleep, so captured graphs stay valid
        # (`stable_memory=False`: torch allocations, graphs dropped at sleep and captured again).
        self.stable = stable_memory and self.use_graphs and vmem.supported(self.device)
        if self.stable:
            self.weight_layout, size = {}, 0
            for key, (shape, own) in self.model.tensors.items():
                self.weight_layout[key] = (size, shape, own or self.dtype)
                size += _aligned_bytes(shape, own or self.dtype)
            self.weight_buffer = vmem.StableBuffer(size, self.device)
            # The rows' linear-attention states (GBs at a seed batch: 18 MiB a row at Qwen3.5-1.5B) live in the KV
            # buffer after both caches, so sleep returns them with the KV; the rest of `Rows` is small and stays.
            self.linear_layout, size = {}, kv_bytes + _aligned_bytes(self.window_kv_shape, dtype)
            if self.linear is not None:
                for name, shape, state_dtype in (("recurrent", self.linear[1], torch.float32),
                                                 ("conv", self.linear[0], self.linear[2])):
                    self.linear_layout[name] = (size, (self.max_batch_size, *shape), state_dtype)
                    size += _aligned_bytes((self.max_batch_size, *shape), state_dtype)
            self.kv_buffer = vmem.StableBuffer(size, self.device)
        self.kv_window_offset = kv_bytes

    @torch.no_grad()
    def _load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies tensors in place by HF name. Buffers the HF model registers (rotary inv_freq, ...) are accepted and
        ignored: the engine computes its own rotary tables from the config."""
        self.kept.clear()  # computed under the weights being replaced
        for name, tensor in weights:
            if name in self.model.hf_buffers:
                continue
            if name not in self.model.name_map:
                raise KeyError(f"engine has no tensor named {name!r}")
            if self.model.hf_shapes.get(name, tuple(tensor.shape)) != tuple(tensor.shape):
                raise ValueError(f"{name}: engine shape {self.model.hf_shapes[name]} != pushed {tuple(tensor.shape)}")
            key, start, end = self.model.name_map[name]
            if key in self.model.row_order:
                tensor = tensor[self.model.row_order[key].to(tensor.device)]  # a no-op for pushes on the device
            if key in self.model.fp8_ranges:  # quantized on arrival (rl/model/fp8.py)
                self.model.load_fp8(key, start, end, tensor)
            else:
                target = self.model.weights[key]
                (target if start is None else target[start:end]).copy_(tensor)
            self.loaded.add((key, start))

    def _sleep(self, level: int) -> None:
        if not self.stable:
            self._drop_graphs()
            self.rows = None
        self.kv = self.kv_window = None
        self.kept.clear()
        if level == 1 and not self.asleep["weights"]:
            # into host buffers kept from one sleep to the next: pinning them anew at every sleep took ~1 s for
            # the 1 GB of a 0.5B model (in 10 of a run's first 12 rollouts), the copy alone ~0.03 s
            if self.host_weights is None:
                self.host_weights = {k: _host_like(t) for k, t in self.model.weights.items()}
            for key, tensor in self.model.weights.items():
                self.host_weights[key].copy_(tensor)
        if level == 2:
            self.host_weights = None
            self.loaded.clear()
        self.model.weights = {}
        if self.stable:  # back to the driver; PyTorch's cached blocks stay cached for the trainer (`wake_up`)
            self.weight_buffer.unmap()
            self.kv_buffer.unmap()
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
            if not self.stable:  # the weights and KV were PyTorch's own blocks
                torch.cuda.empty_cache()

    def _wake_up(self, tags: list[str]) -> None:
        if self.stable:  # the train phase's cached blocks go back to the driver only if the mapping needs them
            buffers = {"weights": self.weight_buffer, "kv_cache": self.kv_buffer}
            vmem.make_room(self.device, sum(buffers[tag].nbytes for tag in tags))
        for tag in tags:
            if tag == "weights":
                self.model.weights = self._new_weights()
                if self.host_weights is not None:
                    for key, tensor in self.host_weights.items():
                        self.model.weights[key].copy_(tensor, non_blocking=True)
            else:
                if self.stable:
                    self.kv_buffer.map()
                    self.kv = self.kv_buffer.view(0, self.kv_shape, self.model.kv_dtype)
                    self.kv_window = self.kv_buffer.view(self.kv_window_offset, self.window_kv_shape,
                                                         self.model.kv_dtype)
                else:  # uninitialised (on the CPU, untouched pages then cost no memory)
                    self.kv = torch.empty(self.kv_shape, dtype=self.model.kv_dtype, device=self.device)
                    self.kv_window = torch.empty(self.window_kv_shape, dtype=self.model.kv_dtype, device=self.device)
                self.model.reset_kv_scales()  # an FP8 cache's scales come from its first writes (rl/model/fp8.py)
                self.kv[:, :, : self.page_size] = 0  # the scratch page idle rows attend to must be finite
                # All of the (small) window cache: a ring's slots that a window masks are still read by the torch
                # paths, and slots a ring has not written yet must be finite too.
                self.kv_window.zero_()
                if self.rows is None:
                    states = (self.kv_buffer.view(*self.linear_layout["conv"]),
                              self.kv_buffer.view(*self.linear_layout["recurrent"])) \
                        if self.stable and self.linear is not None else None
                    self.rows = Rows.allocate(self.max_batch_size, cdiv(self.max_context_len, self.page_size),
                                              self.max_context_len + 1, self.device, self.moe, bool(self.window),
                                              self.linear, states)
                self.rows.clear(0, self.max_batch_size)  # kept rows (stable memory) start idle too
        if self.on_gpu:
            torch.cuda.synchronize(self.device)

    def _new_weights(self) -> dict[str, torch.Tensor]:
        if not self.stable:
            return {k: torch.empty(shape, dtype=own or self.dtype, device=self.device)
                    for k, (shape, own) in self.model.tensors.items()}
        self.weight_buffer.map()
        return {k: self.weight_buffer.view(offset, shape, own)
                for k, (offset, shape, own) in self.weight_layout.items()}

    def _reset_prefix_cache(self) -> None:
        """Drops every kept sequence: the only KV that outlives a generate() call."""
        self.kept.clear()

    def _release(self, keys: Iterable[Hashable]) -> None:
        """Drops the sequences kept under `keys` (those it holds): their pages go back to the cache."""
        for key in keys:
            self.kept.pop(key, None)

    def kept_pages(self) -> int:
        """Pages of the KV cache that kept sequences hold between calls."""
        return len({page for kept in self.kept.values() for page in kept.pages})

    def _close(self) -> None:
        """Releases the engine's device and host memory: sleep level 2, and the graphs too."""
        self.sleep(2)
        self._drop_graphs()
        self.rows = None
        if self.on_gpu:
            torch.cuda.empty_cache()

    def _drop_graphs(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs, self.graph_pool = {}, None

    # ------------------------------------------------------------------ generation

    def check_request(self, prompts: list[list[int]], params: SamplingParams, prior: list[int] | None,
                      keep: list[Hashable | None] | None) -> None:
        super().check_request(prompts, params, prior, keep)
        missing = self.required - self.loaded
        if missing:
            names = sorted(n for n, (k, s, _) in self.model.name_map.items() if (k, s) in missing)
            raise RuntimeError(f"engine weights incomplete; missing e.g. {names[:3]}")

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]], params: SamplingParams,
                  on_finish: Callable[[dict[int, Completion]], bool | None] | None, prior: list[int],
                  keep: list[Hashable | None] | None) -> list[Completion]:
        """`on_finish({index: completion})` hears of finished requests after each poll; a true answer ends the call
        early (rl/rollout/engine.py). `prior`: response tokens each prompt already ends with (a continued sample),
        counted against max_new_tokens; their KV is computed anew, like the prompt's, unless a kept sequence
        holds it. `keep[i]`: a key (None: none) under which request i's KV is kept when it finishes ("stop" or
        "length"), and from which its prompt continues if that key holds the start of it; a request that ends
        early keeps nothing."""
        self._set_sampling(params)
        window_pool = PagePool(self.window_pages, (k.ring for k in self.kept.values())) if self.window else None
        sched = Scheduler(prompts, params.max_new_tokens, self.page_size,
                          PagePool(self.num_pages, (k.pages for k in self.kept.values())), self.max_batch_size, prior,
                          keep, self.kept, self.window, window_pool)
        results: list[Completion | None] = [None] * len(prompts)
        stops = set(params.stop_token_ids)
        ahead: Callable[[], bool] | None = None  # "has a row finished?" after the chunk before the last
        while True:
            to_prefill, new = sched.admit()
            if to_prefill:
                self._prefill(to_prefill, sched)
            if new:
                self._start_rows(sched, new, len(sched.running) - len(new))
            self.window_peak = sched.window_peak
            if not sched.running:
                break
            # `generated` is an upper bound between polls (a row that stopped early stays put), so a
            # chunk never runs past the step where the longest-lived row must have finished.
            steps = min(self.steps_per_poll, min(params.max_new_tokens - r.generated for r in sched.running))
            if steps > 0:
                bucket = next(b for b in self.buckets if b >= len(sched.running))
                for _ in range(steps):
                    self._run_decode(bucket)
                for request in sched.running:
                    request.generated += steps
                self.stats.decode_steps += steps
                self.stats.decode_row_steps += steps * len(sched.running)
                # While no request waits for a row, the host reads a one-flag summary of the chunk
                # before this one as this one runs, and stops the GPU for a full poll only once a
                # row has finished: the device never idles on a poll that finds nothing. Finished
                # rows then wait up to one chunk longer, which costs nothing when no one is queued.
                if not sched.waiting and (ahead is None or not ahead()):
                    ahead = self._any_done(len(sched.running))
                    continue
            ahead = None
            finished = self._poll(sched, stops)
            for request, completion in finished:
                results[request.index] = completion
            if finished and on_finish is not None and on_finish({r.index: out for r, out in finished}):
                for request, completion in self._end_early(sched):
                    results[request.index] = completion
                break
        return results

    def _set_sampling(self, params: SamplingParams) -> None:
        self.params = params
        if params.seed is not None:  # a fixed stream per call: a resumed run draws what the first run drew
            self.generator.manual_seed(params.seed)
            if self.on_gpu:
                self.seed.fill_(params.seed)  # in place: captured graphs read this address
        r = self.rows
        r.inv_temperature.fill_(1.0 / params.temperature)
        r.top_p.fill_(params.top_p)
        r.max_new_tokens.fill_(params.max_new_tokens)
        r.stop_ids.fill_(-1)
        if params.stop_token_ids:
            r.stop_ids[: len(params.stop_token_ids)] = torch.tensor(params.stop_token_ids)
        self.stop_table = None
        if params.stop_text is not None:
            strings = params.stop_text.strings
            if strings not in self.stop_tables:
                self.stop_tables[strings] = params.stop_text.table(self.model.shape.vocab_size, self.device)
            self.stop_table = self.stop_tables[strings]

    def _prefill(self, prompts, sched: Scheduler | None = None) -> None:
        """Writes each prompt's KV into its pages (past the tokens a kept sequence or its base holds) and keeps
        the logits after its last token. Bases first: the prompts continued from them read their pages. `sched`:
        the scheduler that admitted them, which keeps their window-cache pages (needed where the model has a window
        cache)."""
        if self.window and sched is None:
            raise ValueError("a prefill into the window cache needs the scheduler that holds its pages")
        for batch in ([p for p in prompts if p.base is None], [p for p in prompts if p.base is not None]):
            for chunk in prefill_chunks([len(p.tokens) for p in batch], PREFILL_TOKENS):
                self._prefill_chunk(sched, [batch[i] for i in chunk])

    def _copy_window(self, src: list[int], dst: list[int]) -> None:
        """Copies slots of the window cache, every layer's keys and values."""
        if src:
            dev = self.device
            self.kv_window[:, :, torch.tensor(dst, device=dev)] = self.kv_window[:, :, torch.tensor(src, device=dev)]

    def _prefill_chunk(self, sched: Scheduler | None, prompts) -> None:
        tokens = torch.zeros(len(prompts), max(len(p.tokens) - p.cached for p in prompts), dtype=torch.long)
        tables = torch.zeros(len(prompts), max(len(p.pages) for p in prompts), dtype=torch.int32)
        window = torch.zeros(len(prompts), tables.shape[1], dtype=torch.int32) if self.window else None
        src, dst = [], []
        for n, p in enumerate(prompts):
            tokens[n, : len(p.tokens) - p.cached] = torch.tensor(p.tokens[p.cached :])
            tables[n, : len(p.pages)] = torch.tensor(p.pages, dtype=torch.int32)
            if window is not None:  # its window pages, and the window before its cached tokens' end copied in
                window[n, : len(p.window)] = torch.tensor(p.window, dtype=torch.int32)
                s, d = sched.prompt_window_copy(p)
                src += s
                dst += d
        self._copy_window(src, dst)
        starts = torch.tensor([p.cached for p in prompts])
        counts = torch.tensor([len(p.tokens) - p.cached for p in prompts])
        self.stats.prefill_tokens += int(counts.sum())
        dev = self.device
        linear = self._linear_start(prompts)
        logits, experts = self.model.prefill(tokens.to(dev), starts.to(dev), counts.to(dev), tables.to(dev), self.kv,
                                             self.page_size, None if window is None else
                                             WindowCache(self.kv_window, window.to(dev)), linear)
        for n, p in enumerate(prompts):
            p.logits = logits[n]
            if linear is not None:  # the states after its last token, which its requests start from
                p.state = (linear.conv[n], linear.recurrent[n])
            if sched is not None:
                sched.prefilled(p)
            if experts is not None:
                own = experts[:, n, : len(p.tokens) - p.cached].to(EXPERT_IDS)
                p.experts = torch.cat([self._cached_experts(p), own], dim=1) if p.cached else own

    def _linear_start(self, prompts: list[PromptKV]) -> LinearState | None:
        """The linear-attention states the prompts' prefill starts from (None without such layers): zero for a fresh
        prompt, after its cached tokens for one continued from its base or a kept sequence."""
        if self.linear is None:
            return None
        conv_shape, recurrent_shape, dtype = self.linear
        conv = torch.zeros(len(prompts), *conv_shape, dtype=dtype, device=self.device)
        recurrent = torch.zeros(len(prompts), *recurrent_shape, dtype=torch.float32, device=self.device)
        for n, p in enumerate(prompts):
            if p.cached:
                state = p.base.state if p.base is not None else p.kept_state
                if state is None:
                    raise RuntimeError("a prompt continued over cached tokens has no linear-attention state for them")
                conv[n], recurrent[n] = state
        return LinearState(conv, recurrent)

    def _cached_experts(self, prompt: PromptKV) -> torch.Tensor:
        """The routing of the prompt's first `cached` tokens, whose KV it did not prefill: its base's, or the kept
        sequence's it goes on from (-1 where neither holds them)."""
        if prompt.base is not None:
            return prompt.base.experts[:, : prompt.cached]
        if prompt.kept_experts is not None:
            return prompt.kept_experts.to(self.device)
        return torch.full((*self.moe[:1], prompt.cached, self.moe[1]), -1, dtype=EXPERT_IDS, device=self.device)

    def _start_rows(self, sched: Scheduler, new: list[Request], first: int) -> None:
        """Fills rows [first, first + len(new)): block tables, prompt-tail copies, first sampled tokens."""
        r, ps, dev = self.rows, self.page_size, self.device
        rows = slice(first, first + len(new))
        table = torch.zeros(len(new), r.block_tables.shape[1], dtype=torch.int32)
        src, dst, window_src, window_dst = [], [], [], []
        for j, request in enumerate(new):
            pages = sched.block_table(request)
            table[j, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
            s, d = sched.tail_copy(request)
            src += s
            dst += d
            s, d = sched.request_window_copy(request)
            window_src += s
            window_dst += d
        if src:
            self.kv[:, :, torch.tensor(dst, device=dev)] = self.kv[:, :, torch.tensor(src, device=dev)]
        self._copy_window(window_src, window_dst)
        if r.window_tables is not None:
            r.window_tables[rows] = torch.tensor([sched.ring_table(q, r.window_tables.shape[1]) for q in new],
                                                 dtype=torch.int32).to(dev)
        lengths = torch.tensor([len(q.prompt.tokens) for q in new])
        first_slot = torch.tensor([q.pages[0] for q in new]) * ps + lengths % ps
        tokens, logprobs = self._sample(torch.stack([q.prompt.logits for q in new]))
        r.block_tables[rows] = table.to(dev)
        if r.conv_state is not None:  # each row starts from its prompt's states, a copy of its own
            r.conv_state[rows] = torch.stack([q.prompt.state[0] for q in new])
            r.recurrent_state[rows] = torch.stack([q.prompt.state[1] for q in new])
        r.positions[rows] = lengths.to(dev)
        r.context_lens[rows] = (lengths + 1).to(dev, torch.int32)
        r.slots[rows] = first_slot.to(dev)
        r.input_ids[rows] = tokens
        # A continued sample's row counts its prior tokens: the stop rule and the output columns go on from there.
        prior = torch.tensor([q.prompt.prior for q in new], device=dev)
        r.n_gen[rows] = prior + 1
        r.out_tokens[rows] = r.out_tokens[rows].scatter(1, prior[:, None], tokens[:, None])
        r.out_logprobs[rows] = r.out_logprobs[rows].scatter(1, prior[:, None], logprobs[:, None])
        if r.out_experts is not None:
            r.out_experts[rows] = -1
        r.done[rows] = (tokens[:, None] == r.stop_ids[None, :]).any(1) | (prior + 1 >= r.max_new_tokens)
        r.stop_state[rows] = 0
        if self.stop_table is not None:
            r.stop_state[rows] = self.stop_table[0, tokens]
            r.done[rows] |= r.stop_state[rows] == STOPPED
        for request in new:
            request.generated = request.prompt.prior + 1

    def _sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p, r = self.params, self.rows
        if not self.on_gpu:
            return sample_tokens(logits, p.temperature, p.top_p, p.top_k, self.generator)
        from rl.model.kernels.sampling_triton import sample

        if p.top_k <= 0 and p.top_p >= 1.0:
            return sample(logits, r.inv_temperature, self.seed)
        unit = torch.ones_like(r.inv_temperature)  # the truncated logits are tempered already
        return pick_tokens(logits.float() * r.inv_temperature, p.top_k, r.top_p if p.top_p < 1.0 else None,
                           lambda filtered: sample(filtered, unit, self.seed)[0])

    def _num_splits(self, bucket: int) -> int:
        if self.model.batch_invariant:  # fixed-length splits: enough of them for the longest context
            return invariant_num_splits(self.max_context_len)
        if not self.model.fused:
            return 1
        s = self.model.shape
        return decode_splits(bucket, s.num_kv_heads, s.head_dim, self.num_sms)

    def _decode_step(self, bucket: int) -> None:
        """One token for rows [0, bucket): forward, sample, record, stop checks, advance. No host syncs."""
        r, ps = self.rows, self.page_size
        window = None
        if r.window_tables is not None:  # the fed tokens' slots in the window cache, through each row's ring
            positions = r.positions[:bucket]
            pages = r.window_tables[:bucket].gather(1, (positions // ps)[:, None]).squeeze(1)
            window = WindowCache(self.kv_window, r.window_tables[:bucket], pages.long() * ps + positions % ps)
        linear, slots = None, r.slots[:bucket]
        if r.conv_state is not None:
            # A row already done feeds its last token again. Its states stay, and its keys and values go to the
            # scratch slot: computed over states that already hold that token, they differ from those its slot holds.
            live = ~r.done[:bucket]
            linear = LinearState(r.conv_state[:bucket], r.recurrent_state[:bucket], live)
            slots = torch.where(live, slots, 0)
        logits, experts = self.model.decode(r.input_ids[:bucket], r.positions[:bucket], slots, self.kv,
                                            r.block_tables[:bucket], r.context_lens[:bucket], self.page_size,
                                            self._num_splits(bucket), window, linear)
        if experts is not None:
            self._record_experts(bucket, experts)
        tokens, logprobs = self._sample(logits)
        self._advance(bucket, tokens, logprobs)

    def _record_experts(self, bucket: int, experts: torch.Tensor) -> None:
        """Writes the expert ids (MoE layers, bucket, k) of the tokens rows [0, bucket) fed into those tokens'
        columns: the row's last sampled token, column n_gen - 1 (done rows into the last column, which swallows)."""
        r = self.rows
        column = torch.where(r.done[:bucket], r.out_experts.shape[1] - 1, r.n_gen[:bucket] - 1)  # (bucket,)
        ids = experts.transpose(0, 1)[:, None].to(EXPERT_IDS)  # (bucket, 1, MoE layers, k)
        r.out_experts[:bucket].scatter_(1, column[:, None, None, None].expand(ids.shape), ids)

    def _advance(self, bucket: int, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Records the sampled tokens of rows [0, bucket), applies the stop rules, moves live rows on."""
        r = self.rows
        if self.on_gpu:  # the same bookkeeping in one launch
            from rl.model.kernels.advance_triton import advance

            advance(tokens, logprobs, r.done[:bucket], r.n_gen[:bucket], r.out_tokens[:bucket],
                    r.out_logprobs[:bucket], r.input_ids[:bucket], r.positions[:bucket], r.context_lens[:bucket],
                    r.slots[:bucket], r.block_tables[:bucket], r.stop_ids, r.max_new_tokens, self.page_size,
                    r.stop_state[:bucket], self.stop_table)
            return
        active = ~r.done[:bucket]
        n_gen = r.n_gen[:bucket]
        column = torch.where(active, n_gen, r.out_tokens.shape[1] - 1)[:, None]
        r.out_tokens[:bucket].scatter_(1, column, tokens[:, None])
        r.out_logprobs[:bucket].scatter_(1, column, logprobs[:, None])
        n_gen += active
        hit_stop = (tokens[:, None] == r.stop_ids[None, :]).any(1)
        if self.stop_table is not None:  # the stop text's automaton, one state per row
            state = r.stop_state[:bucket]
            after = self.stop_table[state.clamp(min=0).long(), tokens]
            hit_stop |= after == STOPPED
            r.stop_state[:bucket] = torch.where(active, after, state)
        r.done[:bucket] |= active & (hit_stop | (n_gen >= r.max_new_tokens))
        advance = ~r.done[:bucket]
        r.input_ids[:bucket] = torch.where(advance, tokens, r.input_ids[:bucket])
        r.positions[:bucket] += advance
        r.context_lens[:bucket] += advance.int()
        positions = r.positions[:bucket]
        page = r.block_tables[:bucket].gather(1, (positions // self.page_size)[:, None]).squeeze(1)
        r.slots[:bucket] = page.long() * self.page_size + positions % self.page_size

    def _run_decode(self, bucket: int) -> None:
        key = (bucket, self.params.top_k, self.params.top_p < 1.0,
               self.params.stop_text.strings if self.params.stop_text else ())
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        self._decode_step(bucket)  # a real step; on CUDA it also warms up kernels before capture
        if self.use_graphs:
            if self.graph_pool is None:
                self.graph_pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool):
                self._decode_step(bucket)  # recorded, not run
            self.graphs[key] = graph

    def _any_done(self, rows: int) -> Callable[[], bool]:
        """Starts copying "has any of rows [0, rows) finished?" to the host; the call returned waits for it."""
        flag = self.rows.done[:rows].any()
        if not self.on_gpu:
            return lambda: bool(flag)
        host = torch.empty((), dtype=torch.bool, pin_memory=True)
        host.copy_(flag, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return lambda: copied.synchronize() or bool(host)

    def _poll(self, sched: Scheduler, stops: set[int]) -> list[tuple[Request, Completion]]:
        """Collects finished rows (one host sync), frees their pages and compacts the rest forward."""
        r, n = self.rows, len(sched.running)
        state = torch.stack([r.done[:n].long(), r.n_gen[:n], r.stop_state[:n].long()]).cpu()
        done, n_gen, text_stop = state[0].bool().tolist(), state[1].tolist(), (state[2] == STOPPED).tolist()
        for request, generated in zip(sched.running, n_gen):
            request.generated = generated
        finished_rows = [i for i in range(n) if done[i]]
        if not finished_rows:
            return []
        requests = [sched.running[i] for i in finished_rows]
        index = torch.tensor(finished_rows, device=self.device)
        width = max(n_gen[i] for i in finished_rows)
        tokens = r.out_tokens[index, :width].cpu().tolist()
        logprobs = r.out_logprobs[index, :width].cpu().tolist()
        experts = self._row_experts(index, width)
        # the linear-attention states of the rows whose sequences are kept, before the rows compact
        states = {j: tuple(t[i].clone() for t in r.linear_states()) for j, i in enumerate(finished_rows)
                  if r.conv_state is not None and sched.running[i].keep is not None}
        keep = [i for i in range(n) if not done[i]]
        if keep != list(range(len(keep))):
            keep_index = torch.tensor(keep, dtype=torch.long, device=self.device)
            for t in r.per_row():
                t[: len(keep)] = t[keep_index]
        r.clear(len(keep), n)
        finished = [(request, completion(request, toks, lps, "stop" if toks[request.generated - 1] in stops
                                         or text_stop[i] else "length", self._routing(request, experts, j)))
                    for j, (i, request, toks, lps) in enumerate(zip(finished_rows, requests, tokens, logprobs))]
        sched.finish(finished_rows, [out.token_ids for _, out in finished])
        for j, (request, out) in enumerate(finished):
            if request.keep is not None and out.routed_experts is not None:  # the sequence the scheduler kept
                kept = self.kept[request.keep]
                kept.experts = out.routed_experts[:, : len(kept.tokens)]
            if j in states:
                self.kept[request.keep].state = states[j]
        return finished

    def _row_experts(self, index: torch.Tensor, width: int) -> torch.Tensor | None:
        """The recorded expert ids of rows `index`' first `width` columns, on the host (None: a dense model)."""
        return None if self.rows.out_experts is None else self.rows.out_experts[index, :width].cpu()

    def _routing(self, request: Request, experts: torch.Tensor | None, j: int) -> torch.Tensor | None:
        """A request's routing as its completion carries it: its prompt's, then that of the columns it generated in
        this call (row j of `experts`)."""
        if experts is None:
            return None
        prompt = request.prompt.experts.cpu()
        response = experts[j, request.prompt.prior : request.generated].transpose(0, 1)  # (MoE layers, tokens, k)
        return torch.cat([prompt, response], dim=1)

    def _end_early(self, sched: Scheduler) -> list[tuple[Request, Completion]]:
        """Ends the call with requests unfinished: running ones hand back what they generated ("abort"),
        waiting ones nothing; the rows go idle for the next call. Follows a poll, so `generated` is exact."""
        n = len(sched.running)
        out = [(request, Completion([], [], "abort")) for request in sched.waiting]
        if n:
            width = max(request.generated for request in sched.running)
            tokens = self.rows.out_tokens[:n, :width].cpu().tolist()
            logprobs = self.rows.out_logprobs[:n, :width].cpu().tolist()
            experts = self._row_experts(torch.arange(n, device=self.device), width)
            out += [(request, completion(request, toks, lps, "abort", self._routing(request, experts, j)))
                    for j, (request, toks, lps) in enumerate(zip(sched.running, tokens, logprobs))]
            self.rows.clear(0, n)
        return out


def completion(request: Request, tokens: list[int], logprobs: list[float], reason: str,
               routed_experts: torch.Tensor | None = None) -> Completion:
    """A request's row read back as its completion: the columns it generated in this call (those before are the
    prior tokens its prompt already holds)."""
    start, end = request.prompt.prior, request.generated
    return Completion(tokens[start:end], logprobs[start:end], reason, reused_tokens=request.prompt.cached,
                      routed_experts=routed_experts)


def _host_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
