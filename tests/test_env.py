"""Multi-turn episodes (rl/env/__init__.py, rl/rollout/episodes.py): the trained sequence is exactly the engine's
tokens and the environment's (and the sample dump shows which is which), environment tokens train nothing, a failing
environment costs its episode and a count, the calculator tool, episodes that continue from the KV the native
engine kept, and a 2-rank loop with the native engine."""

import collections
import dataclasses
import json
import time

import pytest
import torch

from rl.config import (
    AlgoConfig,
    Config,
    ConfigError,
    DataConfig,
    EnvConfig,
    EvalConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    load_config,
    resolve,
)
from rl.data import Prompt, Sample, Status
from rl.env import guess_number, python_tool
from rl.env.calculator import evaluate, make_env
from rl.env.reward import RewardPool
from rl.parallel import Dist
from rl.rollout import Completion, SamplingParams
from rl.rollout.collect import Collector, dump_rollout
from rl.rollout.evaluate import evaluate as run_eval
from rl.rollout.native import NativeEngine
from rl.train.step import collate, micro_batch_loss, token_logprobs
from tests.stand_in import StandInEngine
from tests.test_distributed import ROOT, run_loop
from tests.test_engine import full_weights
from tests.test_vllm import GAP, RANKS, needs_vllm
from tests.tiny import tiny_model, tiny_tokenizer

ONE_RANK = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None)
TOKENIZER = tiny_tokenizer()
LOGPROB = -0.5


class ScriptedEngine(StandInEngine):
    """Answers call k with turns[k] for every prompt, and keeps what it was handed."""

    def __init__(self, turns: list[list[int]]):
        super().__init__()
        self.turns, self.handed = turns, []

    def _generate(self, prompts, params, on_finish, prior, keep):
        self.handed.append((prompts, prior))
        out = self.turns[min(len(self.handed) - 1, len(self.turns) - 1)]
        return [Completion(list(out), [LOGPROB] * len(out), "stop") for _ in prompts]


def episodes(env_fn: str, turns: list[list[int]], labels: list[str], max_turns: int = 4, timeout_s: float = 10.0,
             max_new_tokens: int = 32):
    engine = ScriptedEngine(turns)
    samples = [Sample(prompt="q", tokens=[40, 41, 42], label=label, raw_prompt="q", group_index=i)
               for i, label in enumerate(labels)]
    env = EnvConfig(fn=env_fn, max_turns=max_turns, timeout_s=timeout_s)
    with RewardPool(RewardConfig(num_workers=2), env_fn) as pool:
        collector = Collector(engine, pool, TOKENIZER, RolloutConfig(max_new_tokens=max_new_tokens), ONE_RANK, env=env)
        scored = collector.generate_and_score([[s] for s in samples], SamplingParams(max_new_tokens=max_new_tokens,
                                                                                     seed=0), 3, (0,), 60.0)
    return scored, engine


# The first turn ends in a lone UTF-8 lead byte (0xC3 of "é"): decoding and re-encoding it does not give it back,
# as re-rendering a conversation does not give back the tokens a model sampled.
TURN_1 = TOKENIZER.encode("ab") + TOKENIZER.encode("é")[:1]
TURN_2 = TOKENIZER.encode("cd") + [TOKENIZER.eos_token_id]


@pytest.mark.parametrize("env_fn, appended", [("tests.env_fns:counting", TOKENIZER.encode(" result 1")),
                                              ("tests.env_fns:counting_ids", [1, 30])])
def test_trained_sequence_is_the_engine_and_environment_tokens(env_fn, appended, tmp_path):
    scored, engine = episodes(env_fn, [TURN_1, TURN_2], ["x"])
    (s,) = scored.samples
    assert s.tokens == [40, 41, 42] + TURN_1 + appended + TURN_2
    assert s.loss_mask == [1] * len(TURN_1) + [0] * len(appended) + [1] * len(TURN_2)
    assert s.rollout_log_probs == [LOGPROB] * len(TURN_1) + [0.0] * len(appended) + [LOGPROB] * len(TURN_2)
    assert s.token_versions == [3] * len(s.loss_mask)
    # the engine continued the very tokens it sampled, its prior counting only the model's own
    assert engine.handed[1] == ([[40, 41, 42] + TURN_1 + appended], [len(TURN_1)])
    assert (s.reward, s.turns, s.tool_calls, s.status) == (2.0, 2, 1, Status.COMPLETED)
    assert scored.stats.env_failures == 0 and scored.stats.reward_stats[0]["reward/correct_mean"] == 2.0
    dump_rollout(scored.samples, {}, tmp_path / "rollout_0.jsonl")
    line = json.loads((tmp_path / "rollout_0.jsonl").read_text())
    assert line["loss_mask"] == [[1, len(TURN_1)], [0, len(appended)], [1, len(TURN_2)]]
    assert (line["turns"], line["tool_calls"], line["response"]) == (2, 1, TOKENIZER.decode(s.tokens[3:],
                                                                                             skip_special_tokens=True))


class Staggered(StandInEngine):
    """Episode 0's turn finishes first (its completion handed to on_finish), and the call returns `gap_s` later."""

    def __init__(self, gap_s: float):
        super().__init__()
        self.gap_s, self.returned = gap_s, []

    def _generate(self, prompts, params, on_finish, prior, keep):
        outs = [Completion([7, 8], [LOGPROB] * 2, "stop") for _ in prompts]
        on_finish({0: outs[0]})
        time.sleep(self.gap_s)  # the other episodes still generating
        self.returned.append(time.time())
        return outs


def test_a_turn_goes_to_its_environment_while_the_others_generate():
    """An episode whose turn the engine finished early is stepped in a worker before the engine call returns (the
    environment's reward is the time its step ran); the rest after it."""
    engine = Staggered(gap_s=1.0)
    env = EnvConfig(fn="tests.env_fns:clock")
    with RewardPool(RewardConfig(num_workers=2), env.fn) as pool:
        collector = Collector(engine, pool, TOKENIZER, RolloutConfig(max_new_tokens=8), ONE_RANK, env=env)
        for _ in range(2):  # the first call also waits for the workers to start
            samples = [Sample(prompt="q", tokens=[40, 41, 42], label="x", raw_prompt="q", group_index=i)
                       for i in range(3)]
            scored = collector.generate_and_score([samples], SamplingParams(max_new_tokens=8, seed=0), 1, (0,), 60.0)
    first, *rest = [s.reward for s in scored.samples]
    assert first < engine.returned[-1] < min(rest)
    assert scored.stats.env_failures == 0


class FullPrefill(StandInEngine):
    """An engine that keeps nothing between calls: every turn prefills the whole sequence."""

    matches_stop_text = True  # the engine it calls does

    def __init__(self, engine):
        super().__init__(engine.max_context_len)
        self.engine = engine

    def _generate(self, prompts, params, on_finish, prior, keep):
        return self.engine.generate(prompts, params, on_finish, prior)


@pytest.mark.parametrize("top_k", [1, -1], ids=["greedy", "sampled"])
def test_episodes_continue_from_kept_kv_exactly(top_k):
    """On the native engine each turn after the first prefills only the model's last token and what the
    environment appended; the episodes (tokens, engine logprobs) are those of full prefills, and once they end
    the engine holds no pages."""
    model = tiny_model(seed=3, vocab_size=len(TOKENIZER)).eval()
    stops = (188, 193, 246, *range(100, 113))  # a turn of this random model ends after a few tokens
    params = SamplingParams(max_new_tokens=24, temperature=1.0, top_k=top_k, stop_token_ids=stops)
    env = EnvConfig(fn="tests.env_fns:appending", max_turns=3)
    runs = []
    for keep in (False, True):
        engine = NativeEngine(model.config, torch.device("cpu"), torch.float32, max_batch_size=8, page_size=4)
        engine.load_weights(full_weights(model))
        samples = [Sample(prompt="q", tokens=[40, 41, 42 + i // 2], raw_prompt="q", group_index=i // 2)
                   for i in range(6)]  # pairs share a prompt
        with RewardPool(RewardConfig(num_workers=2), env.fn) as pool:
            collector = Collector(engine if keep else FullPrefill(engine), pool, TOKENIZER,
                                  RolloutConfig(max_new_tokens=24), ONE_RANK, env=env)
            scored = collector.generate_and_score([samples[i : i + 2] for i in range(0, 6, 2)], params, 1, (0,), 60.0)
        runs.append(scored)
        assert engine.kept_pages() == 0 and not engine.kept
    full, kept = runs
    assert [s.tokens for s in kept.samples] == [s.tokens for s in full.samples]
    assert [s.loss_mask for s in kept.samples] == [s.loss_mask for s in full.samples]
    for a, b in zip(kept.samples, full.samples):
        assert a.rollout_log_probs == pytest.approx(b.rollout_log_probs, abs=1e-5)
    assert max(s.turns for s in kept.samples) == 3
    # Every turn's prompt counted: all of it reused after the first turn but the model's last token and " 1 + 1 =".
    prefilled = 3 * len(kept.samples)  # the first turns'
    appended = len(TOKENIZER.encode(" 1 + 1 =", add_special_tokens=False))
    prefilled += (sum(s.turns for s in kept.samples) - len(kept.samples)) * (1 + appended)
    assert kept.stats.reused_tokens == kept.stats.prompt_tokens - prefilled
    assert full.stats.reused_tokens == 0 and full.stats.prompt_tokens == kept.stats.prompt_tokens


def test_environment_tokens_carry_no_loss_and_no_gradient():
    scored, _ = episodes("tests.env_fns:counting", [TURN_1, TURN_2], ["x"])
    (s,) = scored.samples
    s.advantage = 1.0
    mb = collate([s], torch.device("cpu"))
    model = tiny_model(vocab_size=len(TOKENIZER))
    logprobs, entropy = token_logprobs(model, mb, 1.0)
    logprobs.retain_grad()
    sums = collections.defaultdict(lambda: torch.zeros(()))
    tokens = float(sum(s.loss_mask))
    algo = AlgoConfig(entropy_coef=0.1, eps_clip_high=0.2)
    loss = micro_batch_loss(sums, mb, logprobs, entropy, logprobs.detach(), None, algo, tokens, 1.0)
    loss.backward()
    grad = logprobs.grad[0, s.prompt_length - 1 : s.prompt_length - 1 + s.response_length]
    mask = torch.tensor(s.loss_mask, dtype=torch.bool)
    assert torch.all(grad[~mask] == 0) and torch.all(grad[mask] != 0)
    assert sums["tokens"].item() == tokens == len(TURN_1) + len(TURN_2)


def test_a_failing_environment_costs_its_episode_and_a_count():
    labels = ["raise", "hang", "garbage", "bad_ids", "surrogate", "fine"]
    scored, _ = episodes("tests.env_fns:faulty", [TOKENIZER.encode("ab")], labels, max_turns=2, timeout_s=2.0)
    by_label = {s.label: s for s in scored.samples}
    for label in labels[:5]:
        s = by_label[label]
        assert (s.reward, s.turns, s.tool_calls, sum(s.loss_mask) == s.response_length) == (0.0, 1, 0, True), label
    fine = by_label["fine"]
    assert (fine.reward, fine.turns, fine.tool_calls, fine.status) == (1.0, 2, 1, Status.TRUNCATED)
    assert scored.stats.env_failures == 5
    stats = scored.stats.reward_stats[0]
    assert (stats["reward/num_errors"], stats["reward/num_timeouts"]) == (4.0, 1.0)


def test_calculator_answers_calls_and_scores_the_answer():
    env = make_env(prompt="q", label="84", columns={})
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}</tool_call>'
    assert env.step(f"Let me compute. {call}", []) == ("\n<tool_response>84</tool_response>\n", False, 0.0)
    assert "error: the call is not JSON" in env.step("<tool_call>{12 * 7}</tool_call>", [])[0]
    assert "error: the only tool" in env.step('<tool_call>{"name": "python"}</tool_call>', [])[0]
    assert env.step(r"So the answer is \boxed{84}.", []) == ("", True, 1.0)
    assert env.step(r"So the answer is \boxed{85}.", [])[1:] == (True, 0.0)
    assert evaluate("7 / 2 - -1") == 4.5 and evaluate("2 ^ 10") == 1024
    for bad in ("__import__('os').system('true')", "9 ** 9 ** 9", "x + 1", "[1] * 10"):
        with pytest.raises(ValueError):
            evaluate(bad)


def python_call(code: str) -> str:
    return f'<tool_call>{json.dumps({"name": "python", "arguments": {"code": code}})}</tool_call>'


def test_python_tool_runs_calls_in_the_sandbox():
    env = python_tool.PythonTool("42", timeout_s=1.0)
    response = python_tool.chat_tool_response
    assert env.step(f"Let me compute. {python_call('print(6 * 7)')}", []) == (response("42"), False, 0.0)
    as_string = '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
    assert env.step(as_string, [])[0] == response("1")
    fenced = '<tool_call>\n```json\n{"name": "python", "arguments": {"code": "print(2)"}}\n```\n</tool_call>'
    assert env.step(fenced, [])[0] == response("2")
    assert env.step('<tool_call>{"name": "python", "arguments": {"code": "print(3)"}} and then</tool_call>',
                    [])[0] == response("3")
    # a call without the tags (in a fence, as the whole turn, a list of one) ends the model's turn itself
    untagged = ['```json\n{"name": "python", "arguments": {"code": "print(4)"}}\n```',
                '{"name": "python", "arguments": {"code": "print(4)"}}',
                'I will compute.\n```\n[{"name": "python", "arguments": {"code": "print(4)"}}]\n```']
    for text in untagged:
        assert env.step(text, []) == (response("4", turn_open=False), False, 0.0), text
    assert response("4", turn_open=False) == response("4")[len("<|im_end|>"):]
    assert env.step('```json\n{"name": "add", "arguments": {"a": 40, "b": 2}}\n```\n\\boxed{42}', []) == ("", True, 1.0)
    assert "error: the call is not JSON" in env.step("<tool_call>{print(1)}</tool_call>", [])[0]
    assert 'error: the only tool is "python"' in env.step(
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>', [])[0]
    assert 'error: arguments must hold "code"' in env.step('<tool_call>{"name": "python"}</tool_call>', [])[0]
    opening, closing = response("@@").split("@@")
    failed = env.step(python_call("print('before')\n1 / 0"), [])[0]
    assert failed.startswith(opening + "before\nTraceback (most recent call last):")
    assert failed.endswith("ZeroDivisionError: division by zero" + closing)
    assert "ran past 1 s and was stopped" in env.step(python_call("while True:\n    pass"), [])[0]
    assert "(no output" in env.step(python_call("x = 1"), [])[0]
    long = env.step(python_call("print('x' * 10000)"), [])[0]
    assert len(long) < len(response("")) + python_tool.MAX_RESPONSE_CHARS + 40 and "characters ..." in long
    assert env.step(r"So the answer is \boxed{42}.", []) == ("", True, 1.0)
    assert env.step(r"So the answer is \boxed{41}.", [])[1:] == (True, 0.0)


def test_python_tool_episode_in_the_reward_workers():
    call = TOKENIZER.encode(python_call("print(6 * 7)"))
    answer = TOKENIZER.encode(r"\boxed{42}") + [TOKENIZER.eos_token_id]
    scored, _ = episodes("rl.env.python_tool:make_env", [call, answer], ["42"], max_new_tokens=256)
    (s,) = scored.samples
    appended = TOKENIZER.encode(python_tool.chat_tool_response("42"), add_special_tokens=False)
    assert s.tokens == [40, 41, 42] + call + appended + answer
    assert (s.reward, s.turns, s.tool_calls, s.status, scored.stats.env_failures) == (1.0, 2, 1, Status.COMPLETED, 0)
    # Qwen2.5's rendering of a tool message: the call's turn closed, the response as a user turn, the next turn open
    assert python_tool.chat_tool_response("42") == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n"
                                                    "</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_python_code_blocks():
    """The Python tool called by a ```python block that ends the turn: its output follows as an ```output block in
    the same turn (stopped at the fence), or as the user's next message (the model's end-of-turn token closed the
    turn); a turn that no Python block ends is the final answer."""
    env = python_tool.make_code_block_env("q", "37", {})
    env.timeout_s = 1.0
    block = "Tom has 3 bags.\n```python\nbags = 3\nprint(bags * 14 - 5)\n```\n"
    assert env.step(block, []) == ("```output\n37\n```\n", False, 0.0)
    assert env.step(block.rstrip(), []) == ("\n<|im_start|>user\n```output\n37\n```\n<|im_end|>\n"
                                            "<|im_start|>assistant\n", False, 0.0)
    assert env.step("```py\nprint(1 / 0)\n```\n\n", [])[0].endswith("ZeroDivisionError: division by zero\n```\n")
    assert env.step("```python\nwhile True:\n    pass\n```\n", [])[0] == (
        "```output\nerror: the code ran past 1 s and was stopped\n```\n")
    assert env.step("The output is 37, so the answer is \\boxed{37}.", []) == ("", True, 1.0)
    # a block that is not Python, or one followed by more text, calls nothing
    assert env.step("```\nprint(37)\n```\n\\boxed{36}", []) == ("", True, 0.0)
    assert env.step("```python\nprint(37)\n```\nso \\boxed{37}", []) == ("", True, 1.0)
    assert env.step("```python\nprint(1)\n```\n```output\n1\n```\n", [])[1] is True
    # the run of it tells the model this format
    config = load_config(["--config", str(ROOT / "configs/python_code.toml")])
    assert config.data.system_prompt == python_tool.CODE_BLOCK_PROMPT and config.env.stop == ["```\n"]


def test_python_code_block_episode_stops_at_the_fence():
    """The engine's turn runs past the block (an engine blind to stop text); env.stop's "```\n" cuts it there,
    the code's output follows in the turn, and the answer after it is scored."""
    turn = TOKENIZER.encode("```python\nprint(6 * 7)\n```\nThe output is 41. \\boxed{41}")
    answer = TOKENIZER.encode("\\boxed{42}") + [TOKENIZER.eos_token_id]
    engine = ScriptedEngine([turn, answer])
    sample = Sample(prompt="q", tokens=[40, 41, 42], label="42", raw_prompt="q", group_index=0)
    env = EnvConfig(fn="rl.env.python_tool:make_code_block_env", stop=["```\n"])
    with RewardPool(RewardConfig(num_workers=1), env.fn) as pool:
        collector = Collector(engine, pool, TOKENIZER, RolloutConfig(max_new_tokens=256), ONE_RANK, env=env)
        scored = collector.generate_and_score([[sample]], SamplingParams(max_new_tokens=256, seed=0), 1, (0,), 60.0)
    (s,) = scored.samples
    model_turn = TOKENIZER.decode(s.tokens[3 : 3 + s.loss_mask.index(0)])
    assert model_turn == "```python\nprint(6 * 7)\n```\n"
    assert s.response == "```python\nprint(6 * 7)\n```\n```output\n42\n```\n\\boxed{42}"
    assert (s.reward, s.turns, s.tool_calls) == (1.0, 2, 1)


def test_eval_reports_accuracy_with_tools_and_the_tool_call_rate():
    call = TOKENIZER.encode(python_call("print(6 * 7)"))
    answer = TOKENIZER.encode(r"\boxed{42}") + [TOKENIZER.eos_token_id]
    prompts = [Prompt(text="q", token_ids=[40, 41, 42], label=label, metadata={}, raw="q") for label in ("42", "41")]
    env = EnvConfig(fn="rl.env.python_tool:make_env")
    with RewardPool(RewardConfig(num_workers=2), env.fn) as pool:
        collector = Collector(ScriptedEngine([call, call, answer]), pool, TOKENIZER, RolloutConfig(max_new_tokens=256),
                              ONE_RANK, env=env)
        stats = run_eval(collector, prompts, EvalConfig(), SamplingParams(max_new_tokens=256), 1, 60.0, None)
    assert stats["eval/accuracy"] == 0.5  # the answer is right for one label of two
    assert (stats["eval/turns_mean"], stats["eval/tool_calls_mean"], stats["eval/tool_call_frac"]) == (3.0, 2.0, 1.0)


def test_guess_number_answers_each_guess(tmp_path):
    game = guess_number.make_env(prompt="q", label="37", columns={"low": 1, "high": 100, "max_guesses": 4})
    assert game.step("50", []) == (guess_number.user_turn("50 is too high. 3 guesses left."), False, 0.0)
    assert game.step("Then 1-25.", [])[0] == guess_number.user_turn("25 is too low. 2 guesses left.")
    assert game.step("no idea", [])[0] == guess_number.user_turn("That is not a number from 1 to 100. 1 guess left.")
    assert game.step("37", []) == ("", True, 1.0)
    lost = guess_number.make_env(prompt="q", label="37", columns={"max_guesses": 2})
    assert lost.step("99", [])[1:] == (False, 0.0) and lost.step("98", []) == ("", True, 0.0)
    guess_number.write_rows(tmp_path, train=200, eval_=50)
    train, held_out = ([json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
                       for name in ("train", "eval"))
    assert len(train) == 200 and train == guess_number.rows(200, 0, range(1, 500))  # seeded
    for row in train + held_out:
        assert row["low"] <= int(row["answer"]) <= row["high"] and 2 ** row["max_guesses"] > row["high"] - row["low"]
        assert f"from {row['low']} to {row['high']}" in row["prompt"][0]["content"]
    assert min(r["low"] for r in held_out) > max(r["low"] for r in train)  # held out by construction


def test_guess_number_episode_in_the_reward_workers():
    first, second = TOKENIZER.encode("50") + [TOKENIZER.eos_token_id], TOKENIZER.encode("37") + [TOKENIZER.eos_token_id]
    scored, _ = episodes("rl.env.guess_number:make_env", [first, second], ["37"])
    (s,) = scored.samples
    feedback = TOKENIZER.encode(guess_number.user_turn("50 is too high. 6 guesses left."), add_special_tokens=False)
    assert s.tokens == [40, 41, 42] + first + feedback + second
    # ChatML's user turn after the model's (which its end-of-turn token closed), then the assistant's
    assert guess_number.user_turn("x") == "\n<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    assert (s.reward, s.turns, s.tool_calls, s.status) == (1.0, 2, 1, Status.COMPLETED)


def test_environments_refuse_the_rollout_buffer():
    base = Config(model=ModelConfig(path="m"), data=DataConfig(source="d.jsonl"), env=EnvConfig(fn="pkg.mod:make"))
    resolve(base, 1)
    for rollout in (RolloutConfig(max_staleness=1), RolloutConfig(partial_rollout=True, max_staleness=1)):
        with pytest.raises(ConfigError, match="env.fn runs the synchronous loop only"):
            resolve(dataclasses.replace(base, rollout=rollout), 1)


def test_multi_turn_loop_two_ranks(tmp_path):
    stops = json.dumps(list(range(100, 115)))  # a random tiny model ends a turn after a few tokens
    rows = run_loop(tmp_path, 2, "--train.num_rollout=2", "--env.fn=tests.env_fns:appending", "--env.max_turns=3",
                    "--rollout.max_new_tokens=24", f"--rollout.stop_token_ids={stops}")
    assert [r["weight_version"] for r in rows] == [2, 3]
    for row in rows:
        assert 1 < row["rollout/turns_mean"] <= 3 and row["rollout/tool_calls_mean"] > 0
        assert row["rollout/tool_errors"] == 0 and row["perf/env_s"] > 0
        assert row["rollout/num_samples"] == 8 * 4 and row["train/grad_norm"] > 0
        assert 0 < row["rollout/prefill_tokens_reused_frac"] < 1  # later turns continued from the kept KV
        assert row["rollout/logprob_abs_diff_max"] < 1e-4  # and their logprobs are the trainer's (float32)


STOPS = json.dumps(list(range(100, 115)))
SYSTEM = "You are a helpful assistant."  # every prompt opens with a full block (32 tokens) of it


@needs_vllm
def test_multi_turn_loop_two_ranks_vllm(tmp_path):
    """The same loop through in-process vLLM: each turn is a new request over the whole sequence so far, its prefix
    served from vLLM's prefix cache (32-token blocks, CPU attention's smallest), and the engine's logprobs of the
    model's tokens, between the environment's, are those the trainer computes. Without sleep (which would drop the
    cache), only the weight push's reset keeps the second rollout from reading KV computed under the first
    weights."""
    rows = run_loop(tmp_path, RANKS, "--train.num_rollout=2", "--rollout.engine=vllm",
                    "--rollout.vllm.kv_cache_memory_bytes=33554432", "--env.fn=tests.env_fns:appending",
                    "--env.max_turns=3", "--rollout.max_new_tokens=24", f"--rollout.stop_token_ids={STOPS}",
                    "--rollout.vllm.kwargs={block_size=32}", f"--data.system_prompt={SYSTEM}",
                    "--data.max_prompt_len=96", "--rollout.max_context_len=192", "--rollout.sleep_level=0")
    assert [r["weight_version"] for r in rows] == [2, 3]
    for row in rows:
        assert 1 < row["rollout/turns_mean"] <= 3 and row["rollout/tool_calls_mean"] > 0
        assert row["rollout/tool_errors"] == 0 and row["perf/env_s"] > 0
        assert row["rollout/num_samples"] == 8 * 4 and row["train/grad_norm"] > 0
        assert row["rollout/logprob_abs_diff_max"] < GAP, row["rollout/logprob_abs_diff_max"]
