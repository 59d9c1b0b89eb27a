"""Packed rows (train.packing) train like padded ones: the same logprobs, loss and gradients on the CPU in float32
(block-diagonal mask), the varlen kernel close to padded rows on CUDA in bf16, and compiled blocks that meet
packed rows of new lengths compile nothing after the first rollout."""

import copy

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from transformers import AttentionInterface

from rl.config import AlgoConfig, TrainConfig
from rl.model.rope import unfuse_rope
from rl.train import packing
from rl.train.measure import graphs_compiled
from rl.train.packing import cut_packed, documents, kernel_layout, packed_width, use_packed_attention
from rl.train.policy import compile_blocks
from rl.train.step import build_schedule, collate, collate_packed, token_logprobs, train_on_rollout
from tests.test_train_options import samples
from tests.test_zero_advantage_skip import RecordingSGD, max_rel_err
from tests.tiny import tiny_model

KERNEL_LAYOUT = packing.kernel_layout


def test_rows_are_cut_longest_first_and_widths_stay_in_one_band():
    assert cut_packed([9, 7, 5, 3, 2], 12) == [[0], [1, 2], [3, 4]]  # next-fit: 9 | 7 + 5 | 3 + 2
    assert cut_packed([20, 3], 12) == [[0], [1]]  # longer than the budget: a row of its own
    assert [packed_width(n, 64, 8) for n in (1, 30, 33, 64)] == [32, 32, 40, 64]


def test_documents_restart_positions_and_pad_as_documents_of_their_own():
    docs = documents([3, 2], 7, 4, 2, torch.device("cpu"))
    assert docs.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 0]]
    assert docs.document_ids.tolist() == [[0, 0, 0, 1, 1, 2, 2]]
    assert docs.cu_seqlens.tolist() == [0, 3, 5, 7] and docs.max_seqlen == 4
    assert docs.targets.tolist() == [[0, 1], [3, 4]]
    # padding longer than max_seqlen: pieces of at most max_seqlen tokens, so max_seqlen holds for every row
    docs = documents([3, 2], 15, 4, 2, torch.device("cpu"))
    assert docs.cu_seqlens.tolist() == [0, 3, 5, 9, 13, 15] and docs.max_seqlen == 4
    assert docs.position_ids.tolist() == [[0, 1, 2, 0, 1] + [0] * 10]


def step(model, batch, packing: bool, algo: AlgoConfig) -> tuple[list, dict]:
    """One optimizer step's gradients over `batch` through the trainer's own schedule."""
    train = TrainConfig(global_batch_size=len(batch), micro_batch_tokens=48, clip_grad=0.0, packing=packing)
    optimizer = RecordingSGD(model.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    schedule = build_schedule(batch, train, 0, 1, torch.device("cpu"))
    out = train_on_rollout(model, optimizer, scheduler, schedule, dp_size=1, train=train, algo=algo, temperature=0.8)
    out["shapes"] = [tuple(mb.input_ids.shape) for mb in schedule.steps[0]]
    return optimizer.grads, out


@pytest.mark.parametrize("algo", [AlgoConfig(eps_clip_high=0.28, entropy_coef=0.01),
                                  AlgoConfig(eps_clip_high=0.28, policy_loss="gspo", loss_agg="seq_mean_token_mean",
                                             tis_cap=2.0, tis_level="sequence")], ids=["ppo_entropy", "gspo_seq"])
def test_packed_rows_give_the_padded_rows_loss_and_gradients(algo, one_cpu_thread):
    batch = samples(10, seed=5)
    padded = tiny_model(seed=1)
    packed = copy.deepcopy(padded)
    use_packed_attention(packed)
    want, want_out = step(padded, batch, False, algo)
    got, got_out = step(packed, batch, True, algo)
    assert {rows for rows, _ in got_out["shapes"]} == {1}
    for key in ("loss_sum", "entropy_sum", "tokens", "sequences", "clipped_tokens"):
        assert got_out[key] == pytest.approx(want_out[key], rel=1e-5, abs=1e-7), key
    assert got_out["sample_mismatch"] == pytest.approx(want_out["sample_mismatch"], rel=1e-5)
    assert max_rel_err(got, want) < 1e-5


def test_each_packed_sample_sees_only_itself():
    """A sample's logprobs in a packed row equal its logprobs alone, whatever shares the row."""
    model = tiny_model(seed=2)
    use_packed_attention(model)
    batch = samples(4, seed=6)
    with torch.no_grad():
        together, _ = token_logprobs(model, collate_packed(batch, torch.device("cpu"), 96, 16), 1.0)
        for row, s in enumerate(batch):
            alone, _ = token_logprobs(model, collate([s], torch.device("cpu")), 1.0)
            n = len(s.tokens) - 1
            assert torch.allclose(together[row, :n], alone[0], atol=1e-5), s.index


def test_compiled_blocks_compile_nothing_after_the_first_rollout():
    """Packed rows stay between half a budget and a budget and always one row: after the first rollout's
    passes (with and without grad), rollouts of other lengths and counts compile no graph."""
    model = tiny_model(seed=3)
    use_packed_attention(model)
    compile_blocks(model)
    algo = AlgoConfig(eps_clip_high=0.2)
    graphs = []
    try:
        for seed, n in ((7, 12), (8, 5), (9, 17)):
            counts: dict[str, float] = {}
            with graphs_compiled(counts, "graphs"):
                batch = samples(n, seed=seed)
                train = TrainConfig(global_batch_size=n, micro_batch_tokens=96, packing=True)
                schedule = build_schedule(batch, train, 0, 1, torch.device("cpu"))
                with torch.no_grad():  # an old-logprob pass
                    token_logprobs(model, schedule.steps[0][0], 1.0)
                step(model, batch, True, algo)
            graphs.append(counts["graphs"])
    finally:
        unfuse_rope()
    assert graphs[0] > 0 and graphs[1:] == [0, 0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the varlen kernel runs on CUDA")
def test_varlen_rows_on_cuda_match_padded_rows():
    """On CUDA a packed row runs FlashAttention's varlen kernel: bf16 logprobs and gradients as padded rows'."""
    batch = samples(10, seed=5)
    padded = tiny_model(seed=1).cuda().to(torch.bfloat16)
    packed = copy.deepcopy(padded)
    use_packed_attention(packed)
    results = []
    for model, packing in ((padded, False), (packed, True)):
        mbs = build_schedule(batch, TrainConfig(global_batch_size=10, micro_batch_tokens=64, packing=packing), 0, 1,
                             torch.device("cuda")).steps[0]
        model.zero_grad(set_to_none=True)
        lps = {}
        for mb in mbs:
            lp, _ = token_logprobs(model, mb, 1.0)
            (lp * mb.loss_mask).sum().backward()
            lps |= {i: (row * m)[m > 0] for i, row, m in zip(mb.indices, lp.detach(), mb.loss_mask)}
        results.append((lps, [p.grad.float() for p in model.parameters()]))
    (want_lp, want_grads), (got_lp, got_grads) = results
    for i in want_lp:
        assert torch.allclose(got_lp[i], want_lp[i], atol=5e-2), i
    assert max_rel_err(got_grads, want_grads) < 5e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the varlen kernel runs on CUDA")
def test_grouped_kv_heads_go_to_the_kernel_unrepeated_and_match_repeated_ones():
    """`causal_gqa` (grouped KV heads straight into FlashAttention's varlen kernels, for torch without
    `enable_gqa`) against the same kernel given K and V repeated to the query's heads: outputs and all three
    gradients, from strided views as the attention interface passes them, eager and compiled (a compiled block
    traces through the custom ops)."""
    from torch.nn.attention.varlen import varlen_attn

    from rl.train.packing import VARLEN_PARAMS, causal_gqa

    torch.manual_seed(0)
    docs = documents([37, 200, 5, 64], 384, 128, 1, torch.device("cuda"))
    # (heads, T, head_dim) leaves, handed over as (T, heads, head_dim) views as transformers' layout gives them
    leaves = [torch.randn(h, 384, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (14, 2, 2)]
    q, k, v = (t.transpose(0, 1) for t in leaves)
    grad = torch.randn(384, 14, 64, device="cuda", dtype=torch.bfloat16)
    causal = {"window_size": (-1, 0)} if "window_size" in VARLEN_PARAMS else {"is_causal": True}

    def repeated(q, k, v):
        k, v = (t.repeat_interleave(7, dim=1) for t in (k, v))
        return varlen_attn(q, k, v, docs.cu_seqlens, docs.cu_seqlens, docs.max_seqlen, docs.max_seqlen,
                           scale=0.125, **causal)

    def grouped(q, k, v):
        return causal_gqa(q, k, v, docs.cu_seqlens, docs.max_seqlen, 0.125)[0]

    def run(fn):
        out = fn(q, k, v)
        return [out.detach().float(), *(g.float() for g in torch.autograd.grad(out, leaves, grad))]

    want = run(repeated)
    for fn in (grouped, torch.compile(grouped, fullgraph=True)):
        for got, ref in zip(run(fn), want):
            assert got.shape == ref.shape
            assert torch.allclose(got, ref, atol=2e-2, rtol=2e-2), (got - ref).abs().max()


def test_packed_rows_reach_the_varlen_kernels_and_come_back_by_views_alone():
    """`kernel_layout` gives the varlen kernels (T, heads, head_dim) views of a packed row's (1, heads, T,
    head_dim) projections, and its backward is views too. A select of the row (`t[0]`) made the compiled
    backward copy every q, k and v gradient into new buffers (five kernels a layer in the 0.5B replay's H200
    profile, 58.6 ms of 1.38 s)."""
    projection = torch.randn(1, 5, 3, 4, requires_grad=True)  # (1, T, heads, head_dim), as a projection's view
    row = projection.transpose(1, 2)  # transformers' (1, heads, T, head_dim)
    got = kernel_layout(row)
    assert got.shape == (5, 3, 4) and torch.equal(got, projection[0])
    assert got.data_ptr() == projection.data_ptr() and got.is_contiguous()  # the projection's own memory
    steps, fn = [], got.grad_fn
    while fn is not None and fn.name() != "torch::autograd::AccumulateGrad":
        steps.append(fn.name())
        fn = fn.next_functions[0][0]
    assert set(steps) <= {"SqueezeBackward0", "SqueezeBackward1", "TransposeBackward0", "ViewBackward0",
                          "UnsqueezeBackward0"}, steps
    grad = torch.randn(5, 3, 4)
    got.backward(grad)
    assert torch.equal(projection.grad, grad[None])


def test_the_compiled_backward_of_the_varlen_path_copies_no_gradient_through_a_select():
    """The compiled decoder block on the packed path (the varlen branch, run on the CPU with stand-in kernels
    for the two attention ops: only the graph around them is under test) generates no `select_backward`
    kernel, where a select of the row generated three a layer; the gradients are the same either way."""
    lib = torch.library.Library("rl", "IMPL")
    lib.impl("causal_gqa", lambda q, k, v, cu, most, scale: (  # the kernels' shapes and strides, not their maths
        torch.empty_like(q).copy_(q * 0.5), q.new_zeros((q.shape[1], q.shape[0]))), "CPU")
    lib.impl("causal_gqa_backward", lambda grad, q, k, v, out, lse, cu, most, scale: (
        torch.empty_like(q).copy_(grad), torch.zeros_like(k), torch.zeros_like(v)), "CPU")

    def varlen_branch(module, query, key, value, attention_mask, dropout=0.0, scaling=None, cu_seq_lens_q=None,
                      max_length_q=None, **kwargs):  # packed_attention's CUDA branch, through `causal_gqa`
        return packing.varlen_attention(query, key, value, cu_seq_lens_q, max_length_q, scaling), None

    batch = samples(4)
    results = {}
    varlen_causal = packing.varlen_causal
    packing.varlen_causal = lambda q, k, v, cu, most, scale: packing.causal_gqa(q, k, v, cu, most, scale)[0]
    try:
        for layout in ("views", "select"):
            torch._dynamo.reset()
            if layout == "select":
                packing.kernel_layout = lambda t: t[0].transpose(0, 1)
            model = tiny_model(seed=1)
            use_packed_attention(model)
            AttentionInterface.register(packing.ATTENTION, varlen_branch)
            compile_blocks(model)
            mb = collate_packed(batch, torch.device("cpu"), 64, 64)

            def step():
                logprobs, _ = token_logprobs(model, mb, 1.0)
                (logprobs * mb.loss_mask).sum().backward()

            _, code = run_and_get_code(step)
            results[layout] = ("select_backward" in "".join(code),
                               {n: p.grad.clone() for n, p in model.named_parameters()})
    finally:
        packing.kernel_layout = KERNEL_LAYOUT
        packing.varlen_causal = varlen_causal
        AttentionInterface.register(packing.ATTENTION, packing.packed_attention)
        unfuse_rope()
        torch._dynamo.reset()
        lib._destroy()
    assert results["select"][0], "the stand-in graph no longer shows the select's copies: the test sees nothing"
    assert not results["views"][0]
    assert all(torch.equal(results["views"][1][n], g) for n, g in results["select"][1].items())
