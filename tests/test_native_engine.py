"""The native engine's scheduling on CPU: continuous batching, shared prompts, page pressure, other architectures."""

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from rl.rollout import SamplingParams, native, scheduler
from rl.rollout.native import NativeEngine, decode_splits, prefill_chunks
from rl.rollout.scheduler import PagePool, Scheduler
from tests.test_engine import full_weights, reference_logprobs
from tests.tiny import tiny_config, tiny_model

GREEDY = dict(temperature=1.0, top_k=1)
GROUPED = [[1, 5, 9, 13, 2, 2, 7, 7, 3], [4, 4], [1, 5, 9, 13, 2, 2, 7, 7, 3], [6, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
           [4, 4], [1, 5, 9, 13, 2, 2, 7, 7, 3], [2]]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=2).eval()


def make_engine(model, **kwargs) -> NativeEngine:
    engine = NativeEngine(model.config, torch.device("cpu"), torch.float32, **kwargs)
    engine.load_weights(full_weights(model))
    return engine


def one_at_a_time(engine, prompts, params):
    return [engine.generate([p], params)[0] for p in prompts]


def test_continuous_batching_equals_one_at_a_time(model):
    engine = make_engine(model, max_batch_size=3, page_size=4, steps_per_poll=3)
    free = one_at_a_time(engine, GROUPED, SamplingParams(max_new_tokens=12, **GREEDY))
    # Stop ids taken from the free-running outputs make sequences end at different steps, so rows
    # free up mid-batch and are refilled from the queue.
    stops = (free[0].token_ids[4], free[3].token_ids[1])
    params = SamplingParams(max_new_tokens=12, stop_token_ids=stops, **GREEDY)
    batched = engine.generate(GROUPED, params)
    single = one_at_a_time(engine, GROUPED, params)
    assert [o.token_ids for o in batched] == [o.token_ids for o in single]
    assert [o.finish_reason for o in batched] == [o.finish_reason for o in single]
    assert {o.finish_reason for o in batched} == {"stop", "length"}
    assert len({len(o.token_ids) for o in batched}) > 1


def test_prefill_chunks_pad_little_and_keep_their_budget():
    # A partial rollout's prefill: continued samples of up to ~4,000 tokens among fresh 150-token prompts.
    lengths = [150 + (i * 337) % 3900 if i % 3 else 150 for i in range(300)]
    chunks = prefill_chunks(lengths, 16384)
    assert sorted(i for c in chunks for i in c) == list(range(len(lengths)))
    widths = [max(lengths[i] for i in c) for c in chunks]
    assert all(w * len(c) <= 16384 for w, c in zip(widths, chunks))
    assert sum(w * len(c) for w, c in zip(widths, chunks)) < 1.2 * sum(lengths)
    assert prefill_chunks([20000, 5], 16384) == [[1], [0]]  # one past the budget goes alone


def test_prompts_of_mixed_lengths_over_several_prefill_chunks_generate_as_one_at_a_time(model, monkeypatch):
    monkeypatch.setattr(native, "PREFILL_TOKENS", 24)  # GROUPED's distinct prompts: 9, 2, 12 and 1 tokens
    engine = make_engine(model, max_batch_size=8, page_size=4)
    params = SamplingParams(max_new_tokens=6, **GREEDY)
    batched = engine.generate(GROUPED, params)
    single = one_at_a_time(engine, GROUPED, params)
    assert [o.token_ids for o in batched] == [o.token_ids for o in single]


def test_polls_behind_the_next_chunk_when_nothing_waits(model, monkeypatch):
    """With every request in a row, the host stops the device for a full poll only once a row has
    finished, and never runs a chunk past the step where a row must have finished."""
    engine = make_engine(model, max_batch_size=8, page_size=4, steps_per_poll=3)
    polls = []
    poll = engine._poll
    monkeypatch.setattr(engine, "_poll", lambda *a: polls.append(1) or poll(*a))
    free = engine.generate(GROUPED, SamplingParams(max_new_tokens=14, **GREEDY))
    assert len(polls) == 1  # no stop ids: the one poll collects every row at max_new_tokens
    assert all(len(o.token_ids) == 14 for o in free)
    stops = (free[0].token_ids[4], free[3].token_ids[1])
    params = SamplingParams(max_new_tokens=14, stop_token_ids=stops, **GREEDY)
    polls.clear()
    batched = engine.generate(GROUPED, params)
    assert 1 < len(polls) < 14 // 3 + 1
    single = one_at_a_time(engine, GROUPED, params)
    assert [(o.token_ids, o.finish_reason) for o in batched] == [(o.token_ids, o.finish_reason) for o in single]
    for got, want in zip(batched, single):
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)


def test_shared_prompts_sample_independently_with_exact_logprobs(model):
    engine = make_engine(model, max_batch_size=8, page_size=4)
    prompt = GROUPED[0]
    outs = engine.generate([prompt] * 6, SamplingParams(max_new_tokens=10, temperature=1.3, top_p=0.9, top_k=40))
    assert len({tuple(o.token_ids) for o in outs}) > 1
    for out in outs:  # full tempered distribution, not the truncated one
        assert out.logprobs == pytest.approx(reference_logprobs(model, prompt, out.token_ids, 1.3), abs=1e-4)


def test_page_pressure_waits_instead_of_failing(model):
    params = SamplingParams(max_new_tokens=9, **GREEDY)
    roomy = make_engine(model, max_batch_size=4, page_size=4)
    want = [o.token_ids for o in roomy.generate(GROUPED, params)]
    # Pages for about two sequences at a time: admission waits for finished sequences' pages.
    tight = make_engine(model, max_batch_size=4, page_size=4, kv_cache_tokens=48)
    assert [o.token_ids for o in tight.generate(GROUPED, params)] == want
    tiny = make_engine(model, max_batch_size=4, page_size=4, kv_cache_tokens=8)
    with pytest.raises(RuntimeError, match="KV cache too small"):
        tiny.generate(GROUPED, params)


def test_scheduler_prefills_each_distinct_prompt_once():
    pool = PagePool(64)
    sched = Scheduler(GROUPED, max_new_tokens=5, page_size=4, pool=pool, max_rows=16)
    to_prefill, new = sched.admit()
    assert len(new) == len(GROUPED) and len(to_prefill) == 4
    first = [r for r in new if r.prompt.tokens == GROUPED[0]]
    assert len({id(r.prompt) for r in first}) == 1
    tables = [sched.block_table(r) for r in first]
    assert all(t[:2] == first[0].prompt.pages[:2] for t in tables)  # 9 tokens: two full shared pages
    assert len({t[2] for t in tables}) == 3  # the partial page is private to each sample
    src, dst = sched.tail_copy(first[1])
    assert src == [first[1].prompt.pages[2] * 4] and dst == [first[1].pages[0] * 4]
    sched.finish(list(range(len(new))), [[0]] * len(new))
    assert len(pool.free) == 63  # everything back but the scratch page


def test_continued_samples_of_one_prompt_share_its_full_pages(monkeypatch):
    """Continued samples of one prompt (a partial rollout's) prefill its full pages once, as a base they all point
    their tables at, and prefill only the rest; a fresh sample of that prompt in the call is the base itself. Every
    page comes back once they finish. Prompts shorter than the threshold are not shared."""
    prompt, other = GROUPED[0], GROUPED[3]  # 9 tokens: two full pages of 4; 12 tokens
    short = Scheduler([prompt + [20], prompt + [21, 22]], 8, page_size=4, pool=PagePool(64), max_rows=4, prior=[1, 2])
    assert scheduler.SHARED_PROMPT_MIN_TOKENS > 8 and all(r.prompt.base is None for r in short.waiting)
    monkeypatch.setattr(scheduler, "SHARED_PROMPT_MIN_TOKENS", 8)
    for fresh in (False, True):
        pool = PagePool(64)
        prompts = [prompt + [20, 21, 22], prompt + [23, 24, 25, 26, 27], other + [30]] + ([prompt] if fresh else [])
        prior = [3, 5, 1] + ([0] if fresh else [])
        sched = Scheduler(prompts, max_new_tokens=8, page_size=4, pool=pool, max_rows=16, prior=prior)
        to_prefill, new = sched.admit()
        base = new[0].prompt.base
        assert base is new[1].prompt.base and new[2].prompt.base is None  # a lone continued sample keeps its own
        assert base.tokens == (prompt if fresh else prompt[:8]) and to_prefill[0] is base
        assert len(to_prefill) == 4 and (len(new) == 4 and base is new[3].prompt) == fresh
        for r in new[:2]:
            assert r.prompt.cached == 8 and r.prompt.pages[:2] == base.pages[:2]
            assert sched.block_table(r)[:2] == base.pages[:2] and r.prompt.pages[2] not in base.pages
        assert all(pool.holders[page] == 3 for page in base.pages[:2])
        sched.finish([0], [[0]])
        assert base.pages and all(pool.holders[page] == 2 for page in base.pages[:2])
        sched.finish([0], [[0]])  # the other continued sample; a fresh sample of the prompt still holds the base
        assert bool(base.pages) == fresh and base.unfinished == int(fresh)
        sched.finish(list(range(len(sched.running))), [[0]] * len(sched.running))
        assert not base.pages and len(pool.free) == 63  # everything back but the scratch page


def test_continued_samples_that_share_a_base_run_under_the_weights_of_now(model, monkeypatch):
    """Samples of one prompt ended early, then continued together after new weights are loaded: each one's tokens
    are scored by the new weights over its whole sequence, the shared prompt pages prefilled under them."""
    monkeypatch.setattr(scheduler, "SHARED_PROMPT_MIN_TOKENS", 4)
    engine = make_engine(model, max_batch_size=8, page_size=4, steps_per_poll=2)
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=3)
    prompt = GROUPED[3]  # 12 tokens: three full pages
    firsts = engine.generate([prompt] * 4, params)
    cuts = [2, 3, 5, 7]
    other = tiny_model(seed=7).eval()
    engine.load_weights(full_weights(other))
    sequences = [prompt + first.token_ids[:cut] for first, cut in zip(firsts, cuts)]
    before = engine.stats.prefill_tokens
    rest = engine.generate(sequences + [prompt], params, prior=cuts + [0])
    assert engine.stats.prefill_tokens - before == len(prompt) + sum(cuts)  # the prompt once, then each one's own tokens
    for sequence, out, cut in zip(sequences, rest, cuts):
        assert len(out.token_ids) == 10 - cut
        assert out.logprobs == pytest.approx(reference_logprobs(other, sequence, out.token_ids), abs=1e-4)
    assert rest[4].logprobs == pytest.approx(reference_logprobs(other, prompt, rest[4].token_ids), abs=1e-4)


def test_one_token_and_immediate_stop(model):
    engine = make_engine(model, max_batch_size=4, page_size=4)
    outs = engine.generate(GROUPED[:3], SamplingParams(max_new_tokens=1, **GREEDY))
    assert all(len(o.token_ids) == 1 and o.finish_reason == "length" for o in outs)
    first = outs[0].token_ids[0]
    out = engine.generate(GROUPED[:1], SamplingParams(max_new_tokens=5, stop_token_ids=(first,), **GREEDY))[0]
    assert out.token_ids == [first] and out.finish_reason == "stop"


def test_llama_with_rope_scaling_matches_hf_forward():
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=200, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                         rope_theta=50000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    engine = make_engine(model, max_batch_size=4, page_size=8, max_context_len=256)
    prompts = [list(range(1, 90)), [3, 4, 5]]
    for prompt, out in zip(prompts, engine.generate(prompts, SamplingParams(max_new_tokens=30, temperature=0.7))):
        assert out.logprobs == pytest.approx(reference_logprobs(model, prompt, out.token_ids, 0.7), abs=1e-4)


def test_unsupported_architecture_is_named():
    config = tiny_config()
    config.model_type = "gemma2"
    with pytest.raises(ValueError, match="gemma2"):
        NativeEngine(config, torch.device("cpu"), torch.float32)


def test_buffers_are_accepted_and_every_parameter_is_required(model):
    engine = NativeEngine(model.config, torch.device("cpu"), torch.float32, max_batch_size=2)
    # A push streams no computed buffer (rl/train/weights.py), but one that does (an older stream, a hand-made
    # list) gets its rotary tables ignored rather than refused.
    weights = list(full_weights(model)) + [(n, b) for n, b in model.named_buffers() if "rotary" in n]
    assert any("rotary" in name for name, _ in weights)
    engine.load_weights([(n, t) for n, t in weights if n != "model.layers.1.mlp.up_proj.weight"])
    with pytest.raises(RuntimeError, match="up_proj"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    engine.load_weights([(n, t) for n, t in weights if n == "model.layers.1.mlp.up_proj.weight"])
    assert len(engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))[0].token_ids) == 2


def test_zero_temperature_is_refused_with_the_greedy_spelling(model):
    engine = make_engine(model, max_batch_size=2)
    with pytest.raises(ValueError, match="top_k=1"):
        engine.generate(GROUPED[:1], SamplingParams(max_new_tokens=2, temperature=0.0))


def test_prompt_longer_than_context_is_refused(model):
    engine = make_engine(model, max_batch_size=2, max_context_len=32)
    with pytest.raises(ValueError, match="max_context_len"):
        engine.generate([list(range(1, 30))], SamplingParams(max_new_tokens=8))


def test_decode_splits_on_an_h200():
    """132 SMs: the split counts behind the measured tables in benchmarks/ARCHIVE.md ("Splits by batch
    rows"): fewer for 128-wide heads than for 64-wide ones, 16 at most."""
    for rows, head_dim, want in [(256, 64, 2), (128, 64, 4), (64, 64, 8), (32, 64, 16), (1, 64, 16),
                                 (256, 128, 1), (128, 128, 2), (64, 128, 4), (32, 128, 8), (8, 128, 16)]:
        assert decode_splits(rows, 2, head_dim, 132) == want, (rows, head_dim)
    assert decode_splits(4096, 8, 128, 132) == 1


def test_default_cache_holds_a_full_batch_of_the_longest_sequences(model):
    """Rows shorter than a page each still need a page of their own beside the shared prompt page."""
    engine = make_engine(model, max_batch_size=4, max_context_len=12, page_size=64)
    outs = engine.generate([[1, 2, 3, 4]] * 2 + [[5, 6, 7, 8, 9, 10, 11, 12]] * 2,
                           SamplingParams(max_new_tokens=4, **GREEDY))
    assert [len(o.token_ids) for o in outs] == [4] * 4
    assert engine.num_pages == 4 * (1 + 1) + 1  # per row a page of context and a partial-page copy; scratch


def test_interleaved_samples_of_prompts_do_not_starve_a_small_cache(model):
    """The default cache for one row holds one prompt and one sample; samples of two prompts given
    interleaved run prompt by prompt instead of waiting on pages held for a queued sample."""
    engine = make_engine(model, max_batch_size=1, max_context_len=17, page_size=8)
    a, b = list(range(3, 15)), list(range(20, 31))
    params = SamplingParams(max_new_tokens=3, **GREEDY)
    outs = engine.generate([a, b, a, b], params)
    want = [engine.generate([p], params)[0].token_ids for p in (a, b)]
    assert [o.token_ids for o in outs] == [want[0], want[1], want[0], want[1]]


def test_an_early_end_hands_back_unfinished_requests_and_they_continue_exactly(model):
    """A call ended by on_finish returns running requests with what they generated ("abort") and waiting ones
    with nothing; continuing them with `prior` (same weights, greedy) gives what one uninterrupted call gives."""
    engine = make_engine(model, max_batch_size=4, page_size=4, steps_per_poll=2)
    free = engine.generate(GROUPED, SamplingParams(max_new_tokens=12, **GREEDY))
    stops = (free[0].token_ids[3], free[3].token_ids[1])
    params = SamplingParams(max_new_tokens=12, stop_token_ids=stops, **GREEDY)
    whole = engine.generate(GROUPED, params)
    heard = {}
    part = engine.generate(GROUPED, params, on_finish=lambda done: heard.update(done) or True)  # end at first poll
    assert heard and all(part[i].finish_reason in ("stop", "length") for i in heard)
    assert all(heard[i] is part[i] for i in heard)  # told with the completions it returns
    unfinished = [i for i, o in enumerate(part) if o.finish_reason == "abort"]
    assert unfinished and any(part[i].token_ids for i in unfinished) and any(not part[i].token_ids for i in unfinished)
    for i in heard:
        assert part[i].token_ids == whole[i].token_ids
    prompts = [GROUPED[i] + part[i].token_ids for i in unfinished]
    rest = engine.generate(prompts, params, prior=[len(part[i].token_ids) for i in unfinished])
    for i, out in zip(unfinished, rest):
        assert part[i].token_ids + out.token_ids == whole[i].token_ids
        assert part[i].logprobs + out.logprobs == pytest.approx(whole[i].logprobs, abs=1e-5)
        assert out.finish_reason == whole[i].finish_reason  # the prior tokens count against max_new_tokens


def test_a_continued_request_runs_under_the_weights_the_engine_holds_now(model):
    """After new weights are loaded, a continued request's tokens are scored by the new weights over the whole
    sequence (its prompt and earlier tokens recomputed), never by KV left from the old ones."""
    engine = make_engine(model, max_batch_size=4, page_size=4, steps_per_poll=2)
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=3)
    prompt = GROUPED[3]
    first = engine.generate([prompt], params, on_finish=lambda done: True)[0]  # one request: runs to the end
    cut = 4
    other = tiny_model(seed=7).eval()
    engine.load_weights(full_weights(other))
    rest = engine.generate([prompt + first.token_ids[:cut]], params, prior=[cut])[0]
    assert len(rest.token_ids) == 10 - cut
    want = reference_logprobs(other, prompt + first.token_ids[:cut], rest.token_ids)
    assert rest.logprobs == pytest.approx(want, abs=1e-4)
    stale = reference_logprobs(model, prompt + first.token_ids[:cut], rest.token_ids)
    assert max(abs(a - b) for a, b in zip(stale, want)) > 1e-2  # the two weights do differ on these tokens


# What an environment appends after each turn: within a page, across pages, a lone token.
APPENDED = [[30, 31, 32, 33, 34], [35], [36, 37, 38, 39, 40, 41, 42, 43, 44]]


def episode_turns(engine, params, keep: bool, prompts=GROUPED):
    """Each prompt's turns: generate, append the environment's tokens, generate again, ... with each sequence's KV
    kept between calls under its index (`keep`) or prefilled whole every call."""
    sequences, turns = [list(p) for p in prompts], []
    for turn, appended in enumerate(APPENDED):
        seeded = params if params.seed is None else dataclasses.replace(params, seed=params.seed + turn)
        outs = engine.generate(sequences, seeded, keep=list(range(len(sequences))) if keep else None)
        turns.append(outs)
        sequences = [s + o.token_ids + appended for s, o in zip(sequences, outs)]
    return turns


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=7, **GREEDY),
                                    SamplingParams(max_new_tokens=7, temperature=1.3, top_p=0.9, seed=5)],
                         ids=["greedy", "sampled"])
def test_kept_sequences_continue_exactly_as_a_full_prefill(model, params):
    """Turn by turn, a sequence continued from its kept KV (prefilling only the model's last token and the appended
    ones) samples the same tokens with the same logprobs as one prefilled whole; shared prompts (GROUPED repeats
    some) keep one sequence per sample."""
    full = episode_turns(make_engine(model, max_batch_size=8, page_size=4), params, keep=False)
    engine = make_engine(model, max_batch_size=8, page_size=4)
    kept = episode_turns(engine, params, keep=True)
    for turn, (want, got) in enumerate(zip(full, kept)):
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        for a, b in zip(got, want):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        prompts = [len(p) + sum(len(t[i].token_ids) + len(APPENDED[k]) for k, t in enumerate(kept[:turn]))
                   for i, p in enumerate(GROUPED)]
        # After the first turn, all but the model's last token and the appended ones came from the kept KV.
        assert [o.reused_tokens for o in got] == [0 if turn == 0 else n - 1 - len(APPENDED[turn - 1]) for n in prompts]
        assert all(o.reused_tokens == 0 for o in want)
    third = kept[2][3]  # the engine's logprobs are the model's over the whole sequence
    sequence = GROUPED[3] + kept[0][3].token_ids + APPENDED[0] + kept[1][3].token_ids + APPENDED[1]
    temperature = params.temperature
    assert third.logprobs == pytest.approx(reference_logprobs(model, sequence, third.token_ids, temperature), abs=1e-4)
    assert engine.kept_pages() > 0
    engine.release(range(len(GROUPED)))
    assert engine.kept_pages() == 0 and not engine.kept


def test_prefill_attention_never_goes_through_cudnn(model, monkeypatch):
    """cuDNN's attention builds a plan for every new shape and each prefill brings new ones (~1.2 s against
    0.41-0.46 s for 200k tokens of continued samples on an H200): fresh prompts and prompts continued from kept KV
    (the masked path) attend with it switched off, and the switch is back on after the call."""
    seen, prefilling = [], []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",  # the CPU decode calls it too
                        lambda *a, **k: prefilling and seen.append((torch.backends.cuda.cudnn_sdp_enabled(),
                                                                    "attn_mask" in k)) or sdpa(*a, **k))
    engine = make_engine(model, max_batch_size=8, page_size=4)
    prefill = engine.model.prefill

    def traced(*args):
        prefilling.append(1)
        out = prefill(*args)
        prefilling.clear()
        return out

    monkeypatch.setattr(engine.model, "prefill", traced)
    episode_turns(engine, SamplingParams(max_new_tokens=5, **GREEDY), keep=True)
    assert {masked for _, masked in seen} == {False, True}  # both paths ran
    assert not any(cudnn for cudnn, _ in seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_kept_sequences_are_dropped_when_they_could_go_stale(model):
    """reset_prefix_cache, a weight load and sleep drop every kept sequence (their pages go back), and a call after
    new weights recomputes the whole sequence under them; release drops only the keys it names."""
    engine = make_engine(model, max_batch_size=8, page_size=4)
    params = SamplingParams(max_new_tokens=6, **GREEDY)
    keys = list(range(len(GROUPED)))

    def keep_some() -> list[list[int]]:
        outs = engine.generate(GROUPED, params, keep=keys)
        assert engine.kept_pages() > 0
        return [p + o.token_ids + [30, 31] for p, o in zip(GROUPED, outs)]

    keep_some()
    before = engine.kept_pages()
    engine.release([3, "no such key"])
    assert 0 < engine.kept_pages() < before and 3 not in engine.kept
    engine.reset_prefix_cache()
    assert engine.kept_pages() == 0
    keep_some()
    engine.sleep(1)
    engine.wake_up()
    assert engine.kept_pages() == 0
    turn_2 = keep_some()
    other = tiny_model(seed=7).eval()
    engine.load_weights(full_weights(other))
    assert engine.kept_pages() == 0
    outs = engine.generate(turn_2, params, keep=keys)
    assert all(o.reused_tokens == 0 for o in outs)
    assert outs[3].logprobs == pytest.approx(reference_logprobs(other, turn_2[3], outs[3].token_ids), abs=1e-4)


def test_kept_sequences_give_way_when_pages_run_short(model):
    """A cache too small to hold every kept sequence besides the running ones evicts kept sequences (the prompts
    that lose theirs are prefilled whole) and ends with what a roomy cache gives."""
    params = SamplingParams(max_new_tokens=7, **GREEDY)
    want = episode_turns(make_engine(model, max_batch_size=4, page_size=4), params, keep=False)
    roomy = episode_turns(make_engine(model, max_batch_size=4, page_size=4), params, keep=True)
    tight = make_engine(model, max_batch_size=4, page_size=4, kv_cache_tokens=96)
    got = episode_turns(tight, params, keep=True)
    for w, g in zip(want, got):
        assert [o.token_ids for o in g] == [o.token_ids for o in w]
        for a, b in zip(g, w):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    reused = [sum(o.reused_tokens for o in turn) for turn in got]
    assert 0 < sum(reused) < sum(o.reused_tokens for turn in roomy for o in turn)  # some, not all, were kept
