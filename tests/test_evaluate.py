"""Held-out evaluation: pass@k by hand, eval prompts never among the training ones, and eval in the loop."""

import dataclasses
import json

import pytest
import torch

from rl.config import ConfigError, DataConfig, EvalConfig, RewardConfig, RolloutConfig
from rl.data import Prompt, PromptDataset
from rl.env.reward import RewardPool
from rl.parallel import Dist, engine_share
from rl.rollout import Completion, SamplingParams
from rl.rollout.collect import Collector
from rl.rollout.evaluate import evaluate, load_eval_prompts, pass_at_k
from tests.stand_in import StandInEngine
from tests.test_faults import run, strict_rows
from tests.tiny import save_tiny_model_dir, tiny_tokenizer, write_arithmetic_jsonl


def test_pass_at_k_against_a_hand_count():
    correct = [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 1.0], [0.5, 0.5, 0.0]]
    assert pass_at_k(correct) == 3 / 5  # prompts 0, 2 and 3 have a correct sample; 0.5 is not correct
    assert pass_at_k([[1.0], [0.0]]) == 0.5  # k = 1: the plain accuracy


def test_shares_cover_every_prompt_once():
    items = list(range(10))
    assert [engine_share(items, i, 4) for i in range(4)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


def test_eval_prompts_never_appear_in_training(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                             for i in range(10)))
    held = tmp_path / "eval.jsonl"  # 5 of these 10 are training questions too
    held.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(5, 15)))
    tokenizer = tiny_tokenizer()
    data = DataConfig(source=str(train), prompt_key="question", answer_key="answer")
    training = PromptDataset.from_config(data, tokenizer).prompts
    prompts, dropped = load_eval_prompts(EvalConfig(source=str(held)), data, tokenizer, training)
    assert dropped == 5 and len(prompts) == 5
    assert not {p.text for p in prompts} & {p.text for p in training}
    assert sorted(p.label for p in prompts) == sorted(str(i + 1) for i in range(10, 15))


def test_eval_set_errors_name_the_eval_keys(tmp_path):
    tokenizer = tiny_tokenizer()
    data = DataConfig(source=str(write_arithmetic_jsonl(tmp_path / "train.jsonl")), prompt_key="question")
    training = PromptDataset.from_config(data, tokenizer).prompts

    def error(ev: EvalConfig, cfg: DataConfig = data) -> str:
        with pytest.raises(ConfigError) as info:
            load_eval_prompts(ev, cfg, tokenizer, training)
        return str(info.value)

    held = tmp_path / "eval.jsonl"
    assert error(EvalConfig(source=str(held))) == f"eval.source: file not found: {held}"
    held.write_text('{"question": "What is 1 + 1?", "answer": "2"}\n{"question": "What is 2 + 2?"}\n')
    assert error(EvalConfig(source=str(held))).startswith(
        f"eval.source: {held}:2: missing key 'answer' (data.answer_key, read for eval.source)")
    held.write_bytes(b'{"question": "\xff", "answer": "2"}\n')
    assert error(EvalConfig(source=str(held))) == f"eval.source: {held}:1: invalid UTF-8 (byte 0xff at column 15)"
    held.write_text('{"question": "What is 1 + 1?", "answer": "2"}\n')
    assert error(EvalConfig(source=str(held)), dataclasses.replace(data, max_prompt_len=1)) == \
        "eval.source yields no prompts: all 1 are longer than data.max_prompt_len=1 tokens with the template (their " \
        "lengths, shortest first: 33; the longest 33)"
    assert error(EvalConfig(source="reasoning_gym:no_such_task", task_config={})).startswith(
        "eval.source=reasoning_gym:no_such_task with eval.task_config={}: ")


class EchoEngine(StandInEngine):
    """Answers every prompt with the same two tokens: the eval's bookkeeping, without a model."""

    def _generate(self, prompts, params, on_finish, prior, keep):
        return [Completion(token_ids=[40, 41], logprobs=[-0.1, -0.2], finish_reason="stop") for _ in prompts]


def test_eval_counts_reward_errors(tmp_path):
    prompts = [Prompt(text=f"p{i}", token_ids=[1, 2 + i], label=str(i), metadata={}) for i in range(5)]
    one_rank = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None)
    ev, sampling = EvalConfig(source="eval.jsonl", n_samples=3), SamplingParams(max_new_tokens=4, seed=0)
    with RewardPool(RewardConfig(user_fn="tests.reward_fns:raise_on_odd_label", num_workers=2)) as pool:
        collector = Collector(EchoEngine(), pool, tiny_tokenizer(), RolloutConfig(), one_rank)
        stats = evaluate(collector, prompts, ev, sampling, 0, 60.0, None)
    # labels 1 and 3 raise: 2 of 5 greedy samples and 2 * 3 of the 15 drawn ones
    assert stats["eval/reward_errors"] == 2 + 6
    assert stats["eval/accuracy"] == 3 / 5 and stats["eval/pass@3"] == 3 / 5


def test_eval_and_sample_dumps_in_the_loop(tmp_path):
    inputs = save_tiny_model_dir(tmp_path / "model"), write_arithmetic_jsonl(tmp_path / "train.jsonl")
    held = tmp_path / "eval.jsonl"
    held.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(20, 26)))
    out = tmp_path / "run"
    proc = run(inputs, out, f"--eval.source={held}", "--eval.interval=2", "--eval.n_samples=3",
               "--train.num_rollout=3", "--log.sample_interval=2", "--log.profile_rollout=1", nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = strict_rows(out)
    assert [r["rollout_id"] for r in rows] == [0, 1, 2, 3]  # the last row is the eval after the last update
    evaluated = [r["rollout_id"] for r in rows if "eval/accuracy" in r]
    assert evaluated == [0, 2, 3]
    for r in rows:
        if "eval/accuracy" in r:
            assert r["eval/num_prompts"] == 6 and 0 <= r["eval/pass@3"] <= 1 and r["perf/eval_s"] > 0
            assert r["eval/reward_errors"] == 0
    assert rows[3]["weight_version"] == 4
    greedy = [json.loads(line) for line in (out / "samples" / "eval_rollout_0.jsonl").read_text().splitlines()]
    assert sum(g["greedy"] for g in greedy) == 6 and len(greedy) == 6 + 18
    dumped = [json.loads(line) for line in (out / "samples" / "rollout_2.jsonl").read_text().splitlines()]
    assert len(dumped) == 32 and {"prompt", "response", "reward", "advantage", "weight_version"} <= set(dumped[0])
    # every trained sample's trainer-vs-rollout logprob gap, gathered from the rank that trained it; a sample of a
    # group without signal (advantage 0, no KL or entropy term) skips the forward and has none
    gaps = [d["logprob_abs_diff_mean"] for d in dumped if d["advantage"] != 0]
    assert gaps and all(g is not None and 0 <= g < 1e-3 for g in gaps), gaps
    assert all(d["logprob_abs_diff_mean"] is None for d in dumped if d["advantage"] == 0)
    assert max(gaps) <= rows[2]["rollout/logprob_abs_diff_max"]
    assert sorted((out / "samples").iterdir()) == sorted(out / "samples" / name for name in (
        "eval_rollout_0.jsonl", "eval_rollout_2.jsonl", "eval_rollout_3.jsonl", "rollout_0.jsonl", "rollout_2.jsonl"))
    # log.profile_rollout: rollout 1's rollout phase and train phase, one table per rank each
    profiles = sorted(p.name for p in (out / "profile").iterdir())
    assert profiles == ["generate_rollout_1_rank0.txt", "generate_rollout_1_rank1.txt",
                        "train_rollout_1_rank0.txt", "train_rollout_1_rank1.txt"]
    for name in profiles:
        text = (out / "profile" / name).read_text()
        assert text.startswith("wall ") and "largest host time:" in text and "aten::" in text


def test_an_eval_source_that_is_all_training_prompts_is_one_line_naming_it(tmp_path):
    from rl.config import load_config, resolve
    from rl.rollout.evaluate import held_out_prompts

    rows = write_arithmetic_jsonl(tmp_path / "train.jsonl")
    cfg = resolve(load_config([f"--model.path={tmp_path}", f"--data.source={rows}", f"--eval.source={rows}",
                               "--data.prompt_key=question"]))
    dataset = PromptDataset.from_config(cfg.data, tiny_tokenizer())
    with pytest.raises(ConfigError, match=rf"^eval.source='{rows}': every eval prompt also appears among the training"):
        held_out_prompts(cfg, tiny_tokenizer(), dataset)
