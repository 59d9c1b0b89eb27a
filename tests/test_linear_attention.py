"""The gated delta rule, the short convolution and the Gated DeltaNet layer (rl/model/linear_attention.py): the chunked
form against the token-by-token step and transformers' torch references, packed rows against each sequence
alone, continued sequences against one pass, the layer against transformers' Qwen3-Next and Qwen3.5 modules."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_next import modeling_qwen3_next
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig

from rl.model.linear_attention import (
    causal_conv1d,
    causal_conv1d_step,
    chunk_gated_delta_rule,
    gated_delta_step,
    gated_deltanet_forward,
    gated_deltanet_step,
    weights_from_module,
)

HEADS, KEY_DIM, VALUE_DIM, CHANNELS, WIDTH = 2, 8, 6, 5, 4
LENGTHS = [70, 5, 131]  # a packed row: one sequence past a chunk boundary, one shorter than the conv, one of 3 chunks


def close(actual, expected):
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-5)


def rule_inputs(batch, length, seed=0):
    """q, k (unit length, as the layer makes them), v, g (log decay <= 0) and beta of a random sequence batch."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(batch, length, HEADS, KEY_DIM, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(batch, length, HEADS, VALUE_DIM, generator=gen)
    g = F.logsigmoid(torch.randn(batch, length, HEADS, generator=gen) + 2)
    beta = torch.rand(batch, length, HEADS, generator=gen)
    return q, k, v, g, beta


def initial_states(n, seed=1):
    return torch.randn(n, HEADS, KEY_DIM, VALUE_DIM, generator=torch.Generator().manual_seed(seed))


def stepwise(q, k, v, g, beta, state):
    """The rule one token at a time: (B, T, ...) inputs through `gated_delta_step`."""
    outs = []
    for t in range(q.shape[1]):
        o, state = gated_delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        outs.append(o)
    return torch.stack(outs, dim=1), state


def packed(xs):
    """Sequences (1, L_i, ...) as one packed row and its cu_seqlens."""
    cu = torch.tensor([0] + [x.shape[1] for x in xs]).cumsum(0)
    return torch.cat(xs, dim=1), cu


def test_step_by_hand():
    """One head, K = V = 1, scale 1. Token 1: S = 0.5 * 2 = 1, read 1, S = 1 + 0.5 * (3 - 1) = 2, o = 1 * 2.
    Token 2: no decay, beta 1: S = 2 + (-1 - 2) = -1, o = 2 * -1."""
    q, k, v = (torch.tensor([[[[a]], [[b]]]]) for a, b in ((1.0, 2.0), (1.0, 1.0), (3.0, -1.0)))
    g, beta = torch.tensor([[[0.5], [1.0]]]).log(), torch.tensor([[[0.5], [1.0]]])
    state = torch.tensor([[[[2.0]]]])
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, scale=1.0)
    close(o.flatten(), torch.tensor([2.0, -2.0]))
    close(final.flatten(), torch.tensor([-1.0]))
    o1, s1 = gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state, scale=1.0)
    close((o1.flatten(), s1.flatten()), (torch.tensor([2.0]), torch.tensor([2.0])))


@pytest.mark.parametrize("chunk_size", [64, 16])
def test_chunked_equals_stepwise(chunk_size):
    """Outputs, final states and gradients of the chunked form equal the step's, token by token, over lengths that
    end inside a chunk."""
    inputs = [x.requires_grad_() for x in rule_inputs(2, 150)]
    state = initial_states(2)
    o, final = chunk_gated_delta_rule(*inputs, initial_state=state, chunk_size=chunk_size)
    o_ref, final_ref = stepwise(*inputs, state)
    close(o, o_ref)
    close(final, final_ref)
    weight = torch.randn_like(o)
    grads = torch.autograd.grad((o * weight).sum() + final.sum(), inputs)
    grads_ref = torch.autograd.grad((o_ref * weight).sum() + final_ref.sum(), inputs)
    for grad, grad_ref in zip(grads, grads_ref):
        close(grad, grad_ref)


def test_rule_matches_transformers():
    """transformers' torch chunked and recurrent gated delta rules (the functions behind its hub-kernel wrappers)
    give the same outputs and final states."""
    inputs = rule_inputs(2, 150)
    state = initial_states(2)
    o, final = chunk_gated_delta_rule(*inputs, initial_state=state)
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        reference = getattr(modeling_qwen3_next, name)
        reference = getattr(reference, "__wrapped__", reference)
        o_ref, final_ref = reference(*inputs, initial_state=state, output_final_state=True)
        close(o, o_ref)
        close(final, final_ref)


@pytest.mark.parametrize("with_state", [False, True])
def test_packed_rule_equals_each_sequence_alone(with_state):
    """A packed row of three sequences gives each one's outputs and final state as if it ran alone: the state
    starts afresh (or from that sequence's own initial state) at every boundary."""
    sequences = [rule_inputs(1, n, seed=i) for i, n in enumerate(LENGTHS)]
    states = initial_states(len(LENGTHS)) if with_state else torch.zeros(len(LENGTHS), HEADS, KEY_DIM, VALUE_DIM)
    row = [packed([s[i] for s in sequences]) for i in range(5)]
    cu = row[0][1]
    o, final = chunk_gated_delta_rule(*(x for x, _ in row), cu_seqlens=cu,
                                      initial_state=states if with_state else None)
    for i, sequence in enumerate(sequences):
        o_alone, final_alone = chunk_gated_delta_rule(*sequence, initial_state=states[i:i + 1])
        close(o[:, cu[i]:cu[i + 1]], o_alone)
        close(final[i:i + 1], final_alone)


def conv_inputs(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(1, n, CHANNELS, generator=gen) for n in lengths]
    return xs, torch.randn(CHANNELS, WIDTH, generator=gen), torch.randn(len(lengths), CHANNELS, WIDTH - 1,
                                                                           generator=gen)


def test_conv_matches_torch_conv1d():
    """Without a state the convolution is torch's causal depthwise conv1d (left padding) and SiLU; its final state
    is the last W-1 inputs."""
    xs, weight, _ = conv_inputs([9])
    out, final = causal_conv1d(xs[0], weight)
    expected = F.conv1d(xs[0].transpose(1, 2), weight[:, None], padding=WIDTH - 1, groups=CHANNELS)[..., :9]
    close(out, F.silu(expected).transpose(1, 2))
    close(final, xs[0][:, -(WIDTH - 1):].transpose(1, 2))


@pytest.mark.parametrize("with_state", [False, True])
def test_packed_conv_equals_each_sequence_alone(with_state):
    """The packed convolution never reads the sequence before: each sequence's outputs and final state equal its
    own, including the one shorter than the kernel, whose final state reaches into its conv state."""
    xs, weight, states = conv_inputs(LENGTHS)
    row, cu = packed(xs)
    out, final = causal_conv1d(row, weight, cu_seqlens=cu, conv_state=states if with_state else None)
    for i, x in enumerate(xs):
        out_alone, final_alone = causal_conv1d(x, weight, conv_state=states[i:i + 1] if with_state else None)
        close(out[:, cu[i]:cu[i + 1]], out_alone)
        close(final[i:i + 1], final_alone)


@pytest.mark.parametrize("split", [2, 100])
def test_continued_sequences_equal_one_pass(split):
    """Three packed sequences prefilled up to `split` tokens (the short one all of it when shorter), then their rest
    from the returned conv and delta states, chunked or one decode step at a time, equal one pass over all
    tokens."""
    xs, weight, _ = conv_inputs(LENGTHS)
    sequences = [rule_inputs(1, n, seed=i) for i, n in enumerate(LENGTHS)]
    conv_full, delta_full = [], []
    for x, s in zip(xs, sequences):
        conv_full.append(causal_conv1d(x, weight)[0])
        delta_full.append(chunk_gated_delta_rule(*s))
    heads = [min(split, n) for n in LENGTHS]
    conv_head, cu = packed([x[:, :h] for x, h in zip(xs, heads)])
    rule_head = [packed([s[i][:, :h] for s, h in zip(sequences, heads)])[0] for i in range(5)]
    _, conv_state = causal_conv1d(conv_head, weight, cu_seqlens=cu)
    _, delta_state = chunk_gated_delta_rule(*rule_head, cu_seqlens=cu)
    conv_tail, cu_tail = packed([x[:, h:] for x, h in zip(xs, heads)])
    rule_tail = [packed([s[i][:, h:] for s, h in zip(sequences, heads)])[0] for i in range(5)]
    conv_out, _ = causal_conv1d(conv_tail, weight, cu_seqlens=cu_tail, conv_state=conv_state)
    rule_out, final = chunk_gated_delta_rule(*rule_tail, cu_seqlens=cu_tail, initial_state=delta_state)
    for i, h in enumerate(heads):
        close(conv_out[:, cu_tail[i]:cu_tail[i + 1]], conv_full[i][:, h:])
        close(rule_out[:, cu_tail[i]:cu_tail[i + 1]], delta_full[i][0][:, h:])
        close(final[i:i + 1], delta_full[i][1])
    state_c, state_d = conv_state[2:], delta_state[2:]  # the longest sequence's next tokens, one decode step each
    for t in range(heads[2], heads[2] + 5):
        y, state_c = causal_conv1d_step(xs[2][:, t], weight, state_c)
        o, state_d = gated_delta_step(*(x[:, t] for x in sequences[2]), state_d)
        close(y, conv_full[2][:, t])
        close(o, delta_full[2][0][:, t])


def tiny_module(family, seed=0):
    """A transformers Gated DeltaNet module of `family` with random weights (two value heads per key head)."""
    config_class, module_class = {
        "qwen3_next": (Qwen3NextConfig, modeling_qwen3_next.Qwen3NextGatedDeltaNet),
        "qwen3_5": (Qwen3_5TextConfig, modeling_qwen3_5.Qwen3_5GatedDeltaNet),
    }[family]
    config = config_class(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                          linear_value_head_dim=6, linear_conv_kernel_dim=WIDTH, num_hidden_layers=4,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    torch.manual_seed(seed)
    module = module_class(config, layer_idx=0)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0, 0.3)  # ones and zeros at init would hide a swapped norm weight or bias
    return module


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_layer_matches_transformers(family):
    """The layer over a packed row of three sequences equals transformers' module on each sequence alone, and a
    sequence continued from the returned states, by the layer or by decode steps, equals the module over all its
    tokens."""
    module = tiny_module(family)
    weights = weights_from_module(module)
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(1, n, 32, generator=gen) for n in LENGTHS]
    row, cu = packed(xs)
    with torch.no_grad():
        out, _, _ = gated_deltanet_forward(row, weights, cu_seqlens=cu)
        for i, x in enumerate(xs):
            close(out[:, cu[i]:cu[i + 1]], module(x))
        x = xs[2]
        head, conv_state, recurrent_state = gated_deltanet_forward(x[:, :50], weights)
        tail, _, _ = gated_deltanet_forward(x[:, 50:], weights, conv_state=conv_state,
                                            recurrent_state=recurrent_state)
        expected = module(x)
        close(torch.cat([head, tail], dim=1), expected)
        for t in range(50, 55):
            out, conv_state, recurrent_state = gated_deltanet_step(x[:, t], weights, conv_state, recurrent_state)
            close(out, expected[:, t])


def tiny_causal_lm(family, seed=0):
    """A whole transformers causal LM of `family`: three linear-attention layers, then one full-attention layer."""
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=WIDTH,
                  layer_types=["linear_attention"] * 3 + ["full_attention"], attn_implementation="sdpa")
    if family == "qwen3_next":
        config = Qwen3NextConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                 shared_expert_intermediate_size=16)
        model_class = modeling_qwen3_next.Qwen3NextForCausalLM
    else:
        config = Qwen3_5TextConfig(**common)
        model_class = modeling_qwen3_5.Qwen3_5ForCausalLM
    torch.manual_seed(seed)
    model = model_class(config).float()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.2)
    return model


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_trainer_packed_row_equals_each_sequence_alone(family):
    """The trainer's patched model over one packed row of three sequences (positions restarting, the block-diagonal
    mask for the full-attention layer, cu_seqlens for the linear ones) gives each sequence's logits and gradients as
    transformers' unpatched model does on that sequence alone: no state crosses a sequence boundary."""
    from rl.model.linear_attention import use_packed_linear_attention
    from rl.train.packing import documents, packed_forward

    reference, model = tiny_causal_lm(family), tiny_causal_lm(family)
    with pytest.raises(ValueError, match="train.packing: layers of kinds"):  # transformers' own forward: refused
        packed_forward(model, torch.zeros(1, 8, dtype=torch.long), documents([8], 8, 8, 7, torch.device("cpu")))
    assert len(use_packed_linear_attention(model)) == 3
    gen = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, 64, (1, n), generator=gen) for n in LENGTHS]
    row, cu = packed(ids)
    weights = torch.randn(1, row.shape[1], 64, generator=gen)
    docs = documents(LENGTHS, row.shape[1], max(LENGTHS), max(LENGTHS) - 1, torch.device("cpu"))
    logits = packed_forward(model, row, docs).logits
    (logits * weights).sum().backward()
    expected = []
    for i, x in enumerate(ids):
        alone = reference(input_ids=x, use_cache=False).logits
        (alone * weights[:, cu[i]:cu[i + 1]]).sum().backward()
        expected.append(alone.detach())
    # float32 logits of two different summation orders (transformers 5.19's Qwen3-Next gave 4e-5 on 4 of 13,184);
    # a state carried over a boundary moves them by tenths
    torch.testing.assert_close(logits.detach(), torch.cat(expected, dim=1), atol=2e-4, rtol=1e-4)
    grads = dict(reference.named_parameters())
    for name, parameter in model.named_parameters():  # float32 sums of gradients in the hundreds
        expected_grad = grads[name].grad
        torch.testing.assert_close(parameter.grad, expected_grad, atol=5e-5 * expected_grad.abs().max().item(),
                                   rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


def test_lora_on_the_linear_attention_projections_is_refused():
    """The packed forward reads the projections' weights, so an adapter there would train nothing: refused, one line
    naming the key; adapters on the other layers are left as they are."""
    from rl.config import ConfigError, LoraConfig
    from rl.model.linear_attention import use_packed_linear_attention
    from rl.train.lora import apply_lora

    model = tiny_causal_lm("qwen3_5")
    apply_lora(model, LoraConfig(rank=4, target_modules=["in_proj_qkv", "q_proj"]))
    with pytest.raises(ConfigError, match="lora.target_modules: .*in_proj_qkv"):
        use_packed_linear_attention(model)
    model = tiny_causal_lm("qwen3_5")
    apply_lora(model, LoraConfig(rank=4, target_modules=["q_proj", "o_proj"]))
    assert len(use_packed_linear_attention(model)) == 3


def fla_stand_in(calls):
    """fla's `chunk_gated_delta_rule` as its documentation defines it, in this module's torch: q and k of the key
    heads, normed in the kernel, value head i reading key head i // (Hv / Hk), packed sequences by cu_seqlens (a
    long tensor on q's device), float32 final states. Records each call's arguments."""
    import rl.model.linear_attention as la

    def rule(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
        calls.append(dict(heads=(q.shape[2], v.shape[2]), contiguous=all(x.is_contiguous() for x in (q, k, v)),
                          cu=None if cu_seqlens is None else (cu_seqlens.dtype, cu_seqlens.device.type)))
        assert output_final_state and use_qk_l2norm_in_kernel and q.shape[2] == k.shape[2]
        repeat = v.shape[2] // q.shape[2]
        q, k = (la._l2norm(x).repeat_interleave(repeat, dim=2) for x in (q, k))
        return la.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu_seqlens, initial_state=initial_state,
                                         scale=scale)

    return rule


def test_the_fla_path_hands_the_kernels_the_torch_rules_inputs(monkeypatch):
    """Where fla's kernels run (CUDA, bf16), the layer hands them q and k un-normed on the key heads (the kernel
    norms them and groups the value heads), the scale, each sequence's starts and its initial state: with a stand-in
    of fla's documented contract, the layer over a packed row, continued from states, gives the torch rule's outputs
    and states. (fla itself against the torch rule: test_fla_kernels_against_the_torch_rule, on a GPU.)"""
    import rl.model.linear_attention as la

    module = tiny_module("qwen3_5")  # two key heads, four value heads
    weights = weights_from_module(module)
    gen = torch.Generator().manual_seed(3)
    row, cu = packed([torch.randn(1, n, 32, generator=gen) for n in LENGTHS])
    conv = torch.randn(len(LENGTHS), 2 * 2 * 8 + 4 * 6, WIDTH - 1, generator=gen)
    state = torch.randn(len(LENGTHS), 4, 8, 6, generator=gen)
    with torch.no_grad():
        want = gated_deltanet_forward(row, weights, cu_seqlens=cu, conv_state=conv, recurrent_state=state)
        calls = []
        monkeypatch.setattr(la, "fla_delta_rule", lambda x: fla_stand_in(calls))
        got = gated_deltanet_forward(row, weights, cu_seqlens=cu, conv_state=conv, recurrent_state=state)
    assert calls == [dict(heads=(2, 4), contiguous=True, cu=(torch.long, "cpu"))]
    for a, b in zip(got, want):
        close(a, b)


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
                    reason="fla's Triton kernels: a CUDA device with flash-linear-attention installed")
def test_fla_kernels_against_the_torch_rule():
    """The layer in bf16 on a GPU through fla's kernels against the same layer through this module's torch rule
    (float32 throughout): outputs, final states and every weight's gradient over a packed row of sequences continued
    from states, at Qwen3.5's head widths with grouped value heads; within bf16 rounding."""
    import rl.model.linear_attention as la

    torch.manual_seed(0)
    module = modeling_qwen3_5.Qwen3_5GatedDeltaNet(Qwen3_5TextConfig(
        hidden_size=512, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, head_dim=128), layer_idx=0).cuda().bfloat16()
    lengths = [700, 3, 64, 1500, 129]
    row = torch.randn(1, sum(lengths), 512, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, *lengths]).cumsum(0)
    state = torch.randn(len(lengths), 4, 128, 128, device="cuda") * 0.1
    results, before = [], la.USE_FLA
    for use_fla in (True, False):
        la.USE_FLA = use_fla
        try:
            module.zero_grad()
            out, _, final = gated_deltanet_forward(row, weights_from_module(module), cu_seqlens=cu,
                                                   recurrent_state=state)
            (out.float() * torch.linspace(-1, 1, out.shape[-1], device="cuda")).sum().backward()
        finally:
            la.USE_FLA = before
        results.append((out.float(), final, {n: p.grad.float() for n, p in module.named_parameters()}))
    (out, final, grads), (out_ref, final_ref, grads_ref) = results

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    assert rel(out, out_ref) < 2e-2 and rel(final, final_ref) < 2e-2
    for name in grads_ref:
        assert rel(grads[name], grads_ref[name]) < 5e-2, name
