"""Triton kernel of the end of an engine decode step: record each row's token, apply the stop rules,
advance the row. Its torch form is the CPU branch of `NativeEngine._advance` (rl/rollout/native.py);
here it is one launch instead of ~25 small torch kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _advance_kernel(tokens_ptr, logprobs_ptr, done_ptr, n_gen_ptr, out_tokens_ptr, out_logprobs_ptr, out_width,
                    input_ids_ptr, positions_ptr, context_lens_ptr, slots_ptr, block_tables_ptr, bt_row_stride,
                    stop_ids_ptr, max_new_ptr, rows, page_size, stop_state_ptr, stop_table_ptr, vocab,
                    NUM_STOP: tl.constexpr, HAS_TEXT: tl.constexpr, BLOCK: tl.constexpr):
    """Records each row's sampled token and advances its state; see NativeEngine._advance for the torch form."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = r < rows
    r64 = r.to(tl.int64)
    token = tl.load(tokens_ptr + r64, mask=live, other=0)
    active = (tl.load(done_ptr + r64, mask=live, other=1) == 0) & live
    n = tl.load(n_gen_ptr + r64, mask=live, other=0)
    column = tl.where(active, n, out_width - 1)
    tl.store(out_tokens_ptr + r64 * out_width + column, token, mask=live)
    tl.store(out_logprobs_ptr + r64 * out_width + column, tl.load(logprobs_ptr + r64, mask=live, other=0.0),
             mask=live)
    n += active.to(tl.int64)
    tl.store(n_gen_ptr + r64, n, mask=live)
    hit = tl.zeros([BLOCK], tl.int1)
    # The call's stop ids lead the padded vector (-1 after them): read only those, however wide it is.
    j = 0
    stop = tl.load(stop_ids_ptr)
    while stop >= 0:
        hit = hit | (token == stop)
        j += 1
        stop = tl.load(stop_ids_ptr + j, mask=j < NUM_STOP, other=-1)
    if HAS_TEXT:  # the stop text's automaton (rl/rollout/stop_text.py): a state per row, a table row per state
        state = tl.load(stop_state_ptr + r64, mask=live, other=0)
        after = tl.load(stop_table_ptr + tl.maximum(state, 0).to(tl.int64) * vocab + token, mask=live, other=0)
        hit = hit | (after == -1)
        tl.store(stop_state_ptr + r64, tl.where(active, after, state), mask=live)
    done = ~active | hit | (n >= tl.load(max_new_ptr))
    tl.store(done_ptr + r64, done.to(tl.int8), mask=live)
    advance = ~done
    old = tl.load(input_ids_ptr + r64, mask=live, other=0)
    tl.store(input_ids_ptr + r64, tl.where(advance, token, old), mask=live)
    pos = tl.load(positions_ptr + r64, mask=live, other=0) + advance.to(tl.int64)
    tl.store(positions_ptr + r64, pos, mask=live)
    ctx = tl.load(context_lens_ptr + r64, mask=live, other=0) + advance.to(tl.int32)
    tl.store(context_lens_ptr + r64, ctx, mask=live)
    page = tl.load(block_tables_ptr + r64 * bt_row_stride + pos // page_size, mask=live, other=0).to(tl.int64)
    tl.store(slots_ptr + r64, page * page_size + pos % page_size, mask=live)


def advance(tokens: torch.Tensor, logprobs: torch.Tensor, done: torch.Tensor, n_gen: torch.Tensor,
            out_tokens: torch.Tensor, out_logprobs: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
            context_lens: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor, stop_ids: torch.Tensor,
            max_new_tokens: torch.Tensor, page_size: int, stop_state: torch.Tensor,
            stop_table: torch.Tensor | None) -> None:
    """All of a decode step's bookkeeping in one launch instead of ~25 small torch kernels. `stop_table`: the
    call's stop text (None: none), `stop_state` each row's state in it."""
    rows = tokens.shape[0]
    block = 128
    _advance_kernel[(triton.cdiv(rows, block),)](
        tokens, logprobs, done.view(torch.int8), n_gen, out_tokens, out_logprobs, out_tokens.shape[1], input_ids,
        positions, context_lens, slots, block_tables, block_tables.stride(0), stop_ids, max_new_tokens, rows,
        page_size, stop_state, stop_state if stop_table is None else stop_table,
        1 if stop_table is None else stop_table.shape[1], NUM_STOP=stop_ids.shape[0],
        HAS_TEXT=stop_table is not None, BLOCK=block, num_warps=4)
