"""vLLM in the loop on a CUDA device at the default train settings (the training state stays on the device while
the engine runs), over responses of real, long-tailed lengths: the memory handoff between trainer and engine
must hold rollout after rollout, not only on the first.

Random weights of Qwen2.5-0.5B's shapes, with 300 of its token ids as stop ids: each sampled token ends a response
with probability ~300 / 151936, so lengths fall geometrically (mean ~500) under max_new_tokens, a long tail like a
real model's instead of the benchmark's every-response-at-the-limit. Skipped without CUDA or vLLM.
"""

import importlib.util
import json

import pytest
import torch

from tests.test_distributed import ROOT, torchrun
from tests.tiny import save_tiny_model_dir, write_arithmetic_jsonl

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                                reason="vLLM with sleep mode on a CUDA device")
ROLLOUTS = 10
MAX_NEW = 1024


def test_vllm_real_length_loop_at_default_train_settings(tmp_path):
    tokenizer_dir = save_tiny_model_dir(tmp_path / "tokenizer")  # any tokenizer: the weights are random
    data = write_arithmetic_jsonl(tmp_path / "train.jsonl", rows=512)
    out = tmp_path / "run"
    stop_ids = list(range(1000, 1300))
    torchrun(1, "-m", "rl.main", "--config", str(ROOT / "configs/tiny.toml"),
             f"--model.path={ROOT / 'configs/models/qwen2.5-0.5b'}", "--model.random_init=true",
             f"--model.tokenizer={tokenizer_dir}", f"--data.source={data}", f"--log.output_dir={out}",
             "--rollout.engine=vllm", "--rollout.rollout_batch_size=64", "--rollout.n_samples_per_prompt=8",
             f"--rollout.max_new_tokens={MAX_NEW}", "--rollout.max_context_len=1280", "--rollout.max_batch_size=512",
             f"--rollout.stop_token_ids={json.dumps(stop_ids)}", "--train.micro_batch_tokens=32768",
             "--reward.user_fn=tests.reward_fns:digit_fraction", "--reward.num_workers=4", "--train.lr=1e-6",
             f"--train.num_rollout={ROLLOUTS}", "--log.progress=false")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "perf/step_s" in r]
    assert [r["rollout_id"] for r in steps] == list(range(ROLLOUTS))
    lengths = [r["rollout/response_length_mean"] for r in steps]
    assert all(0.2 * MAX_NEW < n < 0.8 * MAX_NEW for n in lengths), lengths  # a long tail, not all at the limit
    for r in steps:
        assert r["perf/onload_kv_s"] >= 0 and r["memory/train_peak_gb"] > 0
        assert r["rollout/logprob_abs_diff_max"] < 1.0  # bf16 engine against the bf16 trainer, random weights
    print(json.dumps([{k: round(r[k], 3) for k in ("perf/step_s", "perf/rollout_s", "perf/train_s", "perf/onload_kv_s",
                                                   "perf/rollout_tokens_per_s", "memory/train_peak_gb",
                                                   "rollout/response_length_mean")} for r in steps]))
