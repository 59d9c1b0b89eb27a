"""Gemma 3's sliding-window layers in the native engine's window cache (rl/rollout/scheduler.py): each sequence holds
only its last window of those layers' KV, in a ring of pages its decode steps recycle, and still scores and
generates as `transformers` does over responses several windows long, through kept KV, shared prompt bases, an
early end and sleep; the cache's pages in use stay bounded by the window, and the memory plan counts the window cache
instead of every token's KV in those layers. A tiny random config in float32, an 8-token window over 4-token pages.
"""

import pytest
import torch

from rl.rollout import SamplingParams, scheduler
from rl.rollout.native import NativeEngine, window_cache_pages, window_layers
from tests.test_engine import assert_greedy_as_transformers, full_weights, reference_logprobs
from tests.test_families import gemma3_config, random_model

PAGE = 4
WINDOW = 8  # a ring of 2 pages
PROMPTS = [list(range(1, 42)), [3, 4, 5], [7] * 20 + [9, 11, 13]]


@pytest.fixture(scope="module")
def model():
    config = gemma3_config()
    config.sliding_window = WINDOW
    return random_model(config, seed=2)


def make_engine(model, **kwargs) -> NativeEngine:
    kwargs = {"max_batch_size": 3, "page_size": PAGE, "max_context_len": 160, "seed": 0} | kwargs
    engine = NativeEngine(model.config, torch.device("cpu"), torch.float32, **kwargs)
    engine.load_weights(full_weights(model))
    return engine


def check_scores(model, prompts, outs, temperature=1.0):
    for prompt, out in zip(prompts, outs):
        assert out.logprobs == pytest.approx(reference_logprobs(model, prompt, out.token_ids, temperature), abs=1e-4)


def test_the_sliding_layers_live_in_the_window_cache(model):
    engine = make_engine(model)
    assert engine.window_layers == (0, 2) and engine.window == WINDOW
    assert engine.kv.shape[1] == 1 and engine.kv_window.shape[1] == 2  # one global layer, two sliding ones


def test_responses_several_windows_long_score_and_decode_as_transformers(model):
    engine = make_engine(model)
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=32, temperature=0.7))
    assert all(len(out.token_ids) == 32 for out in outs)
    check_scores(model, PROMPTS, outs, 0.7)
    assert_greedy_as_transformers(model, engine, PROMPTS, 24)


def test_prompts_over_several_prefill_chunks_score_as_transformers(model, monkeypatch):
    """Prompts in prefill forwards of their own (a 24-token budget): each holds its pages while its chunk runs, and
    its last window's after, as the next chunk takes its own."""
    from rl.rollout import native

    monkeypatch.setattr(native, "PREFILL_TOKENS", 24)
    prompts = PROMPTS + [list(range(50, 80))]
    engine = make_engine(model, max_batch_size=4)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=20, temperature=1.0, seed=6))
    assert engine.stats.prefill_tokens == sum(map(len, prompts))
    check_scores(model, prompts, outs)


def test_a_long_sequence_holds_a_bounded_number_of_window_pages(model):
    """A 41-token prompt and 60 new tokens (26 pages of context) run in a window cache of 13 pages: its ring (2
    pages) and the prompt's pages while it is prefilled (11), of which it keeps its last window's after."""
    ring = WINDOW // PAGE
    engine = make_engine(model, max_batch_size=1, window_cache_tokens=(11 + ring) * PAGE)
    prompt = PROMPTS[0]
    out = engine.generate([prompt], SamplingParams(max_new_tokens=60, temperature=1.0, seed=3))[0]
    assert len(out.token_ids) == 60
    assert engine.window_peak == -(-len(prompt) // PAGE) + ring
    check_scores(model, [prompt], [out])
    # Three rows at once (48 pages of context): a ring each and their prompts' pages, 24 pages.
    engine = make_engine(model, window_cache_tokens=(3 * ring + 18) * PAGE)
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=32, temperature=1.0, seed=4))
    assert engine.window_peak == 3 * ring + sum(-(-len(p) // PAGE) for p in PROMPTS) == 24
    check_scores(model, PROMPTS, outs)


def test_turns_continued_from_kept_kv_past_the_window_score_as_the_whole(model):
    """Turns of 16 tokens (past the window) kept and continued: the next turn copies the window before its cached
    tokens out of the kept ring; the kept rings are the engine's until released."""
    engine = make_engine(model)
    keys = list(range(len(PROMPTS)))
    sequences = [list(p) for p in PROMPTS]
    for turn in range(3):
        outs = engine.generate(sequences, SamplingParams(max_new_tokens=16, temperature=1.0, seed=turn), keep=keys)
        if turn:
            assert all(out.reused_tokens == len(s) - 3 for s, out in zip(sequences, outs))
        check_scores(model, sequences, outs)
        sequences = [s + out.token_ids + [5, 6] for s, out in zip(sequences, outs)]
    assert all(len(kept.ring) == WINDOW // PAGE for kept in engine.kept.values())
    engine.release(keys)
    assert not engine.kept


def test_continued_samples_over_a_shared_base_score_as_transformers(model, monkeypatch):
    """Samples of one 40-token prompt continued together (a partial rollout's): the base is prefilled once, each
    sample copies the window before its own tokens from the base's pages; one row, so each sample is admitted after
    the one before has finished, and the base's pages must still hold its window."""
    monkeypatch.setattr(scheduler, "SHARED_PROMPT_MIN_TOKENS", 8)
    engine = make_engine(model, max_batch_size=1)
    prompt = list(range(3, 43))
    cuts = [1, 6, 13]
    params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=5)
    firsts = engine.generate([prompt] * len(cuts), params)
    sequences = [prompt + first.token_ids[:cut] for first, cut in zip(firsts, cuts)]
    rest = engine.generate(sequences, params, prior=cuts)
    assert all(out.reused_tokens == 40 for out in rest)
    assert [len(out.token_ids) for out in rest] == [24 - cut for cut in cuts]
    check_scores(model, sequences, rest)


def test_an_early_end_and_sleep_leave_the_window_cache_whole(model):
    engine = make_engine(model)
    params = SamplingParams(max_new_tokens=24, temperature=1.0, top_k=1)
    want = engine.generate(PROMPTS, params)
    engine.generate(PROMPTS + PROMPTS, SamplingParams(max_new_tokens=24, temperature=1.0, seed=1),
                    on_finish=lambda done: True)
    for level in (1, 2):
        engine.sleep(level)
        if level == 2:
            engine.wake_up(["weights"])
            engine.load_weights(full_weights(model))
            engine.wake_up(["kv_cache"])
        else:
            engine.wake_up()
        assert [o.token_ids for o in engine.generate(PROMPTS, params)] == [o.token_ids for o in want]


def test_the_memory_plan_counts_the_sliding_layers_by_their_window(model):
    from rl.run.memory import kv_cache_bytes

    shape = make_engine(model).model.shape
    assert window_layers(shape, 160, PAGE) == (0, 2)
    assert window_layers(shape, WINDOW, PAGE) == ()  # a window as long as the context saves nothing
    pages = window_cache_pages(WINDOW, 256, 4096)  # 64-token pages, 256 rows of 4096 tokens
    full = kv_cache_bytes(shape, 256 * 4096, 2)
    split = kv_cache_bytes(shape, 256 * 4096, 2, pages * 64, 2)
    assert split == 256 * 4096 * shape.kv_bytes_per_token(2, 1) + pages * 64 * shape.kv_bytes_per_token(2, 2)
    assert split < 0.4 * full


def test_a_short_window_cache_waits_for_prefills_instead_of_evicting_kept_turns():
    """64 rows continue kept 3000-token turns with 200 new tokens each (window 1024, pages of 64): the window cache,
    sized by rows, holds the kept rings and not every continued prompt's prefill at once. Those requests wait for the
    prefills before them to give window pages back; none of their kept sequences is evicted (each would cost a
    whole 3000-token prefill)."""
    from rl.rollout.native import kv_cache_pages, window_cache_pages
    from rl.rollout.scheduler import Kept, PagePool, Scheduler

    rows, window, context, page = 64, 1024, 4096, 64
    ring = -(-window // page)
    window_pages, pages = window_cache_pages(window, rows, context, page), kv_cache_pages(0, rows, context, page)
    pool, window_pool = PagePool(pages), PagePool(window_pages)
    kept = {i: Kept([i + 7] * 3000, pool.take(-(-3000 // page)), ring=window_pool.take(ring)) for i in range(rows)}
    prompts = [kept[i].tokens + [1] * 200 for i in range(rows)]
    sched = Scheduler(prompts, 512, page, PagePool(pages, [k.pages for k in kept.values()]), rows, None,
                      list(range(rows)), kept, window, PagePool(window_pages, [k.ring for k in kept.values()]))
    continued = whole = admits = 0
    while sched.waiting and admits < 10:
        to_prefill, _ = sched.admit()
        admits += 1
        continued += sum(p.cached > 0 for p in to_prefill)
        whole += sum(p.cached == 0 for p in to_prefill)
        for prompt in to_prefill:
            sched.prefilled(prompt)
    assert admits > 1 and not sched.waiting  # the window cache was short, and every request got in
    assert (continued, whole) == (rows, 0)


def test_rollout_native_window_cache_tokens_sizes_the_window_cache(model):
    """The [rollout.native] key reaches the engine as build_engine hands it over (every key of the table, by name)."""
    import dataclasses

    from rl.config import ConfigError, NativeEngineConfig
    from tests.test_config import make

    engine = make_engine(model, **dataclasses.asdict(NativeEngineConfig(window_cache_tokens=40)))
    assert engine.window_pages == 40 // PAGE + 1 and engine.kv_window.shape[2] == engine.window_pages * PAGE
    with pytest.raises(ConfigError, match="rollout.native.window_cache_tokens must be >= 0"):
        make(rollout={"native": {"window_cache_tokens": -1}})
