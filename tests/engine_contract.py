"""The engine contract (rl/rollout/engine.py), checked on one engine of each kind over the same tiny model.

Started by tests/test_engine_contract.py as `torchrun --nproc-per-node 1 tests/engine_contract.py ENGINE MODEL_DIR
OUT` (vLLM joins the process group torchrun makes); writes OUT/contract_ENGINE.json: each check's name and "ok" or
what failed. Each check starts from an awake engine holding the model's weights and leaves it so."""

import dataclasses
import json
import sys
import traceback
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl import parallel  # noqa: E402
from rl.config import RolloutConfig, VllmEngineConfig  # noqa: E402
from rl.rollout import SamplingParams, build_engine  # noqa: E402
from rl.rollout.stop_text import StopText  # noqa: E402
from tests.tiny import tiny_tokenizer  # noqa: E402

PROMPTS = [[1, 5, 9, 13], [1, 7, 7], [1, 3, 3, 3, 8], [2, 40]]
GREEDY = SamplingParams(max_new_tokens=12, top_k=1)
SAMPLED = SamplingParams(max_new_tokens=12)
LOGPROB_TOL = 1e-4  # fp32 on CPU


def weights(model):
    return [(n, t.detach().clone()) for n, t in model.state_dict().items()]


def tokens(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


def check_early_end(engine, model):
    """A call whose on_finish answers true ends there: finished requests as they ended, the others "abort" with the
    tokens they had (a prefix of what they would have generated) and a logprob for each."""
    long = dataclasses.replace(GREEDY, max_new_tokens=96)  # longer than an engine's steps between looks at the rows
    free = engine.generate(PROMPTS, long)
    # one of prompt 0's first tokens stops it early; the other prompts are still going then
    stop = next(t for t in free[0].token_ids[1:] if all(t not in f.token_ids[:48] for f in free[1:]))
    heard = []
    out = engine.generate(PROMPTS, dataclasses.replace(long, stop_token_ids=(stop,)),
                          on_finish=lambda done: heard.append(sorted(done)) or True)
    assert heard and 0 in heard[0], f"on_finish heard {heard}"
    reasons = [o.finish_reason for o in out]
    assert reasons[0] == "stop" and out[0].token_ids[-1] == stop, reasons
    assert "abort" in reasons, reasons
    for o, f in zip(out, free):
        assert o.token_ids == f.token_ids[: len(o.token_ids)], (o.token_ids, f.token_ids)
        assert len(o.logprobs) == len(o.token_ids)
        assert all(abs(a - b) < LOGPROB_TOL for a, b in zip(o.logprobs, f.logprobs))
    assert all(len(o.token_ids) < long.max_new_tokens for o, r in zip(out, reasons) if r == "abort")


def check_continued_sample(engine, model):
    """A sample continued from an earlier call (`prior` response tokens at its prompt's end) goes on where it left off
    and counts its prior tokens against max_new_tokens."""
    free = engine.generate(PROMPTS, GREEDY)
    prior = [3, 1, 5, 2]
    out = engine.generate([p + f.token_ids[:k] for p, f, k in zip(PROMPTS, free, prior)], GREEDY, prior=prior)
    for o, f, k in zip(out, free, prior):
        assert o.token_ids == f.token_ids[k:], (k, o.token_ids, f.token_ids)
        assert all(abs(a - b) < LOGPROB_TOL for a, b in zip(o.logprobs, f.logprobs[k:]))
        assert o.finish_reason == f.finish_reason


def check_kept_kv(engine, model):
    """A call that goes on from a sequence kept under a key (an episode's next turn) generates what a call from
    scratch does; a released key leaves the engine as it was."""
    first = engine.generate(PROMPTS, GREEDY, keep=["a", "b", "c", "d"])
    appended = [p + f.token_ids + [9, 10] for p, f in zip(PROMPTS, first)]
    prior = [len(f.token_ids) for f in first]
    params = dataclasses.replace(GREEDY, max_new_tokens=20)
    kept = engine.generate(appended, params, prior=prior, keep=["a", "b", "c", "d"])
    engine.release(["a", "b", "c", "d"])
    engine.reset_prefix_cache()
    fresh = engine.generate(appended, params, prior=prior)
    assert tokens(kept) == tokens(fresh), (tokens(kept), tokens(fresh))
    for k, f in zip(kept, fresh):
        assert all(abs(a - b) < LOGPROB_TOL for a, b in zip(k.logprobs, f.logprobs))


def check_seeded_replay(engine, model):
    """A call seed fixes the call's draws whatever the engine ran before; another seed draws others."""
    def draw(seed):
        return tokens(engine.generate(PROMPTS * 3, dataclasses.replace(SAMPLED, seed=seed)))

    first = draw(7)
    engine.generate(PROMPTS, SAMPLED)  # an unseeded call between
    assert draw(7) == first
    assert draw(8) != first


def check_sleep_levels(engine, model):
    """Level 1 keeps the weights (in host memory), level 2 drops them: a sleeping engine neither generates nor loads,
    and after level 2 it generates only once weights are loaded again. Every transition is recorded."""
    before = tokens(engine.generate(PROMPTS, GREEDY))
    engine.calls.clear()
    engine.sleep(1)
    expect_error(lambda: engine.generate(PROMPTS, GREEDY), "sleeping")
    expect_error(lambda: engine.load_weights(weights(model)), "sleeping")
    engine.wake_up()
    assert tokens(engine.generate(PROMPTS, GREEDY)) == before
    engine.sleep(2)
    engine.wake_up(["weights"])
    expect_error(lambda: engine.generate(PROMPTS, GREEDY), "sleeping")  # the KV cache sleeps still
    engine.wake_up(["kv_cache"])
    expect_error(lambda: engine.generate(PROMPTS, GREEDY), "before weights were loaded")
    engine.load_weights(weights(model))
    engine.reset_prefix_cache()
    assert tokens(engine.generate(PROMPTS, GREEDY)) == before
    assert engine.calls == ["sleep(1)", "wake_up(weights,kv_cache)", "sleep(2)", "wake_up(weights)",
                            "wake_up(kv_cache)", "load_weights", "reset_prefix_cache"], engine.calls


def check_no_transition_while_generating(engine, model):
    """The engine's memory and weights change only between calls: a sleep, wake-up, load or release from on_finish
    (mid-call) is refused, and the call completes as if nothing had been asked."""
    refused = []

    def meddle(done):
        for name, act in (("sleep", lambda: engine.sleep(1)), ("wake_up", lambda: engine.wake_up()),
                          ("load_weights", lambda: engine.load_weights(weights(model))),
                          ("release", lambda: engine.release(["x"])),
                          ("generate", lambda: engine.generate(PROMPTS, GREEDY))):
            try:
                act()
            except RuntimeError as e:
                if "while a generate() call runs" in str(e):
                    refused.append(name)

    free = engine.generate(PROMPTS, GREEDY)
    out = engine.generate(PROMPTS, GREEDY, on_finish=meddle)
    assert sorted(set(refused)) == ["generate", "load_weights", "release", "sleep", "wake_up"], refused
    assert tokens(out) == tokens(free)


def check_stop_text(engine, model):
    """Stop text ends a sequence at the token that completes a string, across tokens; on_finish and the call's
    result see the same cut completion."""
    free = engine.generate(PROMPTS, GREEDY)[0]
    texts = tiny_tokenizer().batch_decode([[t] for t in range(engine_vocab(model))], skip_special_tokens=True)
    for i in range(1, len(free.token_ids) - 2):  # a string spelled by tokens i and i + 1, first met there
        string = texts[free.token_ids[i]] + texts[free.token_ids[i + 1]]
        if not string.isascii() or len(texts[free.token_ids[i]]) == 0 or len(texts[free.token_ids[i + 1]]) == 0:
            continue
        stop = StopText.build([string], texts)
        if stop.cut(free.token_ids) == i + 2 and not set(free.token_ids[: i + 2]) & set(stop.stopping_tokens()):
            break
    else:
        raise AssertionError(f"no stop string across two tokens in {free.token_ids}")
    heard = {}
    out = engine.generate(PROMPTS[:1], dataclasses.replace(GREEDY, stop_text=stop),
                          on_finish=lambda done: heard.update(done))[0]
    assert out.token_ids == free.token_ids[: i + 2] and out.finish_reason == "stop", (out.token_ids, free.token_ids)
    assert len(out.logprobs) == len(out.token_ids)
    assert heard[0].token_ids == out.token_ids


def check_requests_refused_before_work(engine, model):
    """Requests the engine cannot serve as asked fail at once, with the same errors from every engine."""
    steps = engine.stats.decode_steps
    for prompts, params, kwargs, words in (
            ([[1, 2], []], GREEDY, {}, "empty prompt"),
            ([[1, 2, 3]], GREEDY, {"prior": [3]}, "prior response tokens"),
            ([[1] * engine.max_context_len], GREEDY, {}, "exceeds the engine's max_context_len"),
            ([[1, 2]], dataclasses.replace(GREEDY, temperature=0.0), {}, "temperature must be > 0"),
            ([[1, 2], [3]], GREEDY, {"keep": ["a"]}, "keep names 1 keys for 2 prompts")):
        expect_error(lambda: engine.generate(prompts, params, **kwargs), words, ValueError)
    expect_error(lambda: engine.sleep(3), "sleep level", ValueError)
    expect_error(lambda: engine.wake_up(["weights", "gpu"]), "unknown wake-up tags", ValueError)
    assert engine.stats.decode_steps == steps


def check_stats_count_decode_steps(engine, model):
    """Every engine counts its decode steps and the sequences they ran."""
    before = dataclasses.replace(engine.stats)
    engine.generate(PROMPTS, GREEDY)
    did = engine.stats - before
    assert 1 <= did.decode_steps <= GREEDY.max_new_tokens + 1, did
    assert did.decode_steps <= did.decode_row_steps <= len(PROMPTS) * did.decode_steps, did


CHECKS = {name.removeprefix("check_"): fn for name, fn in list(globals().items()) if name.startswith("check_")}


def expect_error(act, words: str, kind: type = RuntimeError) -> None:
    try:
        act()
    except kind as e:
        assert words in str(e), f"expected an error saying {words!r}, got {e!r}"
        return
    raise AssertionError(f"expected {kind.__name__} saying {words!r}; the call went through")


def engine_vocab(model) -> int:
    return model.config.vocab_size


def main(kind: str, model_dir: str, out_dir: str) -> None:
    d = parallel.init_distributed()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    cfg = RolloutConfig(engine=kind, max_context_len=128, max_batch_size=16, dtype="float32",
                        vllm=VllmEngineConfig(kv_cache_memory_bytes=32 * 2**20))
    engine = build_engine(cfg, model_dir, model.config, d.device, d.rank)
    engine.load_weights(weights(model))
    results = {}
    for name, check in CHECKS.items():
        try:
            check(engine, model)
            results[name] = "ok"
        except Exception:  # the check's failure is the result; the next check starts from a working engine
            results[name] = traceback.format_exc(limit=3)
            if any(engine.asleep.values()):
                engine.wake_up()
            engine.load_weights(weights(model))
    Path(out_dir, f"contract_{kind}.json").write_text(json.dumps(results, indent=1))
    engine.close()
    parallel.teardown()


if __name__ == "__main__":
    main(*sys.argv[1:4])
