"""In-process vLLM checks, started by tests/test_vllm.py as
`torchrun --nproc-per-node 2 tests/vllm_checks.py OUT MODEL_DIR TP` (one rank per GPU on a GPU machine)."""

import dataclasses
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl import parallel  # noqa: E402
from rl.config import AlgoConfig, RolloutConfig, TrainConfig, VllmEngineConfig  # noqa: E402
from rl.data import Sample, Status  # noqa: E402
from rl.rollout import SamplingParams, build_engine, generate_rollout  # noqa: E402
from rl.train.policy import build_optimizer, shard_policy  # noqa: E402
from rl.train.step import Schedule, collate, token_logprobs, train_on_rollout  # noqa: E402
from rl.train.weights import sync_weights  # noqa: E402
from tests.tiny import tiny_tokenizer  # noqa: E402

PROMPTS = [[1, 5, 9, 13], [1, 7, 7], [1, 3, 3, 3, 8], [2, 40]]


def groups_of(prompts, n, start=0):
    return [[Sample(prompt="", tokens=list(p), group_index=g, index=g * n + k) for k in range(n)]
            for g, p in enumerate(prompts, start)]


def max_logprob_gap(model, samples, device):
    mb = collate(samples, device)
    with torch.no_grad():
        lp, _ = token_logprobs(model, mb, 1.0)
    model.reshard()
    return float(((lp - mb.rollout_logprobs).abs() * mb.loss_mask).max())


def main(out_dir: str, model_dir: str, tp: int) -> None:
    d = parallel.init_distributed()
    whole = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    policy = shard_policy(whole, d.mesh, d.device, False)
    cfg = RolloutConfig(engine="vllm", tensor_parallel_size=tp, vllm=VllmEngineConfig(kv_cache_memory_bytes=32 * 2**20),
                        max_context_len=256, max_batch_size=32)
    engine = build_engine(cfg, model_dir, policy.config, d.device, d.rank)
    sync_weights(policy, engine, torch.float32, bucket_mb=0.05)
    tokenizer = tiny_tokenizer()
    greedy = SamplingParams(max_new_tokens=8, top_k=1)
    sampled = SamplingParams(max_new_tokens=8, stop_token_ids=(tokenizer.eos_token_id,))
    results = {"greedy_before": [c.token_ids for c in engine.generate(PROMPTS, greedy)]}
    # A call seed: the same call draws the same samples whatever ran between (a resumed run redraws them).
    def draw(seed):
        return [c.token_ids for c in engine.generate(PROMPTS * 4, dataclasses.replace(sampled, seed=seed))]
    rng = torch.get_rng_state()
    first = draw(7)
    results["rng_untouched"] = torch.equal(rng, torch.get_rng_state())  # the trainer's stream is its own
    engine.generate(PROMPTS, sampled)
    results["seeded_again_equal"] = draw(7) == first
    results["other_seed_differs"] = draw(8) != first
    # No request has a generator of its own (vLLM's sampler fills those one request at a time).
    results["request_seeds"] = sorted({str(sp.seed) for sp in engine.requests(
        PROMPTS * 4, dataclasses.replace(sampled, seed=7))[1]})
    samples = generate_rollout(engine, groups_of(PROMPTS, 4), sampled, 1, tokenizer)
    results["weight_versions"] = sorted({s.weight_version for s in samples})
    results["tokens"] = [s.tokens for s in samples]
    results["gap_before"] = max_logprob_gap(policy, samples, d.device)
    # A partial rollout: the call ends once one group is finished; the rest carry over the weight push below.
    longer = dataclasses.replace(sampled, max_new_tokens=24, seed=11, stop_token_ids=tuple(range(100, 116)))
    partial = generate_rollout(engine, groups_of(PROMPTS, 4, start=8), longer, 1, tokenizer, until=lambda done: True)
    carried = [s for s in partial if s.status == Status.ABORTED]
    results["partial_statuses"] = [s.status.value for s in partial]
    results["carried_lengths"] = [s.response_length for s in carried]

    for s in samples:
        s.advantage = 1.0 if s.index % 2 else -1.0
    train_cfg = TrainConfig(lr=3e-3)
    optimizer, scheduler = build_optimizer(policy, train_cfg)
    mb = collate(samples, d.device)
    schedule = Schedule([[mb]], [int(mb.loss_mask.sum()) * d.world_size],
                        [int((mb.loss_mask.sum(-1) > 0).sum()) * d.world_size], padding=0)
    train_on_rollout(policy, optimizer, scheduler, schedule, dp_size=d.world_size, train=train_cfg,
                     algo=AlgoConfig(eps_clip_high=0.2), temperature=1.0)

    engine.sleep(2)
    engine.wake_up(["weights"])
    sync_weights(policy, engine, torch.float32, bucket_mb=0.05)
    engine.reset_prefix_cache()
    engine.wake_up(["kv_cache"])
    results["greedy_after"] = [c.token_ids for c in engine.generate(PROMPTS, greedy)]
    generate_rollout(engine, [carried], longer, 2, tokenizer)
    results["continued"] = [[s.status.value, s.response_length, s.token_versions] for s in carried]
    for s in carried:  # only the tokens sampled under the new weights are compared with them
        s.loss_mask = [int(v == 2) for v in s.token_versions]
    results["gap_continued"] = max_logprob_gap(policy, carried, d.device)
    after = generate_rollout(engine, groups_of(PROMPTS, 4, start=4), sampled, 2, tokenizer)
    results["gap_after"] = max_logprob_gap(policy, after, d.device)
    results["weight_versions_after"] = sorted({s.weight_version for s in after})
    results["calls"] = engine.calls
    (Path(out_dir) / f"vllm{d.rank}.json").write_text(json.dumps(results))
    engine.close()
    parallel.teardown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
