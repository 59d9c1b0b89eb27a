"""Batch-invariant mode end to end through Triton's interpreter on the CPU (float32), started by
tests/test_invariant.py as `TRITON_INTERPRET=1 python tests/invariant_checks.py OUT.json [FAMILY]` (the tiny
Qwen2 model, or `qwen3` / `gemma3` for tests/test_families.py's tiny Qwen3 (QK-norm) and Gemma 3 (windows,
sandwich norms, GeGLU)).

The native engine (batch_invariant=True) generates; the trainer's forward of the same sequences,
patched by `make_batch_invariant`, scores them through `rl.train.step.token_logprobs` in one
right-padded micro-batch. Splits are cut every 64 tokens here (512 in production) so that Qwen2's short
contexts already cross split bounds and exercise the merge; the other families' contexts fit one split. Each
family's context bound is the least that holds its sequences: the interpreter runs every split of every row.
"""

import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rl.model.kernels.attention  # noqa: E402
from rl.data import Sample  # noqa: E402
from rl.model.invariant import make_batch_invariant  # noqa: E402
from rl.rollout import SamplingParams  # noqa: E402
from rl.rollout.native import NativeEngine  # noqa: E402
from rl.train.step import collate, token_logprobs  # noqa: E402
from tests.test_engine import full_weights  # noqa: E402
from tests.test_families import gemma3_config, qwen3_config, random_model  # noqa: E402
from tests.tiny import tiny_model  # noqa: E402

rl.model.kernels.attention.INVARIANT_SPLIT_TOKENS = 64
PROMPTS = [[1, 5, 9, 13] * 18, [1, 7], [1, 3, 3, 3, 3, 3, 8] * 9, [2]]  # 72, 2, 63 and 1 tokens


def trainer_logprobs(model, seqs, prompt_lens, responses, logprobs):
    samples = []
    for i, (seq, n) in enumerate(zip(seqs, prompt_lens)):
        s = Sample(prompt="", tokens=list(seq[:n]), index=i, group_index=i)
        s.append_response_tokens(responses[i], [float(x) for x in logprobs[i]])
        samples.append(s)
    mb = collate(samples, torch.device("cpu"))
    lp, _ = token_logprobs(model, mb, 1.0)
    return [lp[i][mb.loss_mask[i].bool()] for i in range(len(samples))], mb


def main(out: str, family: str = "qwen2") -> None:
    configs = {"qwen3": qwen3_config, "gemma3": gemma3_config}
    hf = random_model(configs[family](), seed=1) if family in configs else tiny_model(seed=1).eval()
    max_context = 128 if family == "qwen2" else 64  # two splits, one
    engine = NativeEngine(hf.config, torch.device("cpu"), torch.float32, max_batch_size=8, seed=0,
                          max_context_len=max_context, batch_invariant=True)
    engine.load_weights(full_weights(hf))
    seqs = list(PROMPTS) if family == "qwen2" else [p[:12] for p in PROMPTS]  # the splits are qwen2's to cross
    outs = engine.generate(seqs, SamplingParams(max_new_tokens=8, temperature=1.0), keep=list(range(len(seqs))))
    responses = [list(o.token_ids) for o in outs]
    engine_lp = [torch.tensor(o.logprobs) for o in outs]
    lens = [len(p) for p in seqs]
    full = [p + r for p, r in zip(seqs, responses)]

    # A second turn continued from the first turn's kept KV, and the same turn prefilled whole.
    turn_2 = [f + [4, 4, 4] for f in full]
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=1)
    continued = engine.generate(turn_2, params, keep=list(range(len(seqs))))
    engine.reset_prefix_cache()
    whole = engine.generate(turn_2, params)

    patched = make_batch_invariant(copy.deepcopy(hf), max_context)
    with torch.no_grad():
        batched, _ = trainer_logprobs(patched, full, lens, responses, engine_lp)
        alone = [trainer_logprobs(patched, [f], [n], [r], [e])[0][0]
                 for f, n, r, e in zip(full, lens, responses, engine_lp)]
        plain, _ = trainer_logprobs(hf, full, lens, responses, engine_lp)

    # Gradients of the patched forward against the HF forward's (same weights, float32).
    grads = []
    for model in (patched, hf):
        model.zero_grad()
        lp, mb = trainer_logprobs(model, full, lens, responses, engine_lp)
        torch.stack([x.sum() for x in lp]).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    grad_rel = max(float((grads[0][n] - grads[1][n]).norm() / grads[1][n].norm().clamp_min(1e-12)) for n in grads[1])

    def gap(a, b):
        return max(float((x - y).abs().max()) for x, y in zip(a, b))

    Path(out).write_text(json.dumps({
        "tokens": sum(len(r) for r in responses), "lengths": [len(f) for f in full],
        "engine_vs_trainer": gap(engine_lp, batched), "engine_vs_trainer_exact": all(
            torch.equal(x, y) for x, y in zip(engine_lp, batched)),
        "batched_vs_alone_exact": all(torch.equal(x, y) for x, y in zip(batched, alone)),
        "batched_vs_alone": gap(batched, alone),
        "trainer_vs_hf": gap(batched, plain), "grad_rel": grad_rel, "grad_names": len(grads[1]),
        "continued_reused": [o.reused_tokens for o in continued],
        "continued_same_tokens": [o.token_ids for o in continued] == [o.token_ids for o in whole],
        "continued_vs_whole": gap([torch.tensor(o.logprobs) for o in continued],
                                  [torch.tensor(o.logprobs) for o in whole]),
    }))


if __name__ == "__main__":
    main(*sys.argv[1:])
