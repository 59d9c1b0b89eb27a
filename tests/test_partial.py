"""Partial rollouts and the staleness bound (rl/rollout/buffer.py, Collector.rollout_buffered): the admission rule,
every trained token scored by the weights of its recorded version, whole groups trained once, and an exact resume."""

import json
import shutil

import pytest
import torch

from rl.config import Config, DataConfig, ModelConfig, RewardConfig, RolloutConfig, resolve
from rl.data import Prompt, PromptDataset, Sample, Status
from rl.env.reward import RewardPool
from rl.parallel import Dist
from rl.rollout import Completion, SamplingParams, scheduler
from rl.rollout.buffer import (
    FINISHED,
    RolloutBuffer,
    due_in,
    on_schedule,
    resume_problem,
    sample_from_dict,
    sample_to_dict,
)
from rl.rollout.collect import Collector, sequences_per_engine
from rl.rollout.native import NativeEngine
from tests.stand_in import StandInEngine
from tests.test_checkpoint import checkpoints, final_weights, launch, rows
from tests.test_engine import full_weights, reference_logprobs
from tests.test_faults import one_line, rank_exit_code
from tests.tiny import save_tiny_model_dir, tiny_model, tiny_tokenizer, write_arithmetic_jsonl

ONE_RANK = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None)
STOPS = list(range(100, 115))  # 15 of 256 ids (16 with the EOS): a random tiny model stops after a few to a few dozen tokens
BATCH, N = 4, 2


def sample(group: int, versions: list[int], status: Status = Status.ABORTED) -> Sample:
    return Sample(prompt="p", tokens=[1] * (3 + len(versions)), response_length=len(versions),
                  token_versions=versions, group_index=group, status=status)


def test_admission_keeps_at_most_the_bound_in_flight():
    buffer = RolloutBuffer(rollout_batch_size=4, max_staleness=2)
    assert buffer.room() == 12  # (max_staleness + 1) rollouts' worth
    buffer.admit([[sample(g, [])] for g in range(12)])
    assert buffer.room() == 0
    buffer.consume(buffer.groups[:5])  # a batch trained and a group filtered out free five places
    assert buffer.room() == 5 and buffer.admitted == 12 and buffer.consumed == 5


def test_a_group_is_due_when_the_next_push_would_take_it_past_the_bound():
    assert due_in([sample(0, [])], weight_version=5, max_staleness=1) is None  # nothing sampled yet: no age
    assert due_in([sample(0, [5, 5])], weight_version=5, max_staleness=1) == 1
    assert due_in([sample(0, [4, 5]), sample(0, [5])], weight_version=5, max_staleness=1) == 0  # due
    assert due_in([sample(0, [4, 5])], weight_version=5, max_staleness=2) == 1


def test_groups_are_on_schedule_while_the_batches_to_come_can_take_them_in_time():
    # max_staleness 2, batches of 2: none due, and at most 2 falling due by the next rollout.
    assert on_schedule([None, 2, 2, 2, 1, 1], max_staleness=2, per_rollout=2)
    assert not on_schedule([1, 1, 1], max_staleness=2, per_rollout=2)  # three can't all train next rollout
    assert not on_schedule([0, 2], max_staleness=2, per_rollout=2)  # one is due now
    assert not on_schedule([-1], max_staleness=2, per_rollout=2)  # past due counts as due
    assert on_schedule([1, 1, 1], max_staleness=1, per_rollout=2)  # with a bound of 1 only the due rule applies
    assert not on_schedule([1], max_staleness=2, per_rollout=0)  # a share of no batch waits for all of them


def test_sequences_an_engine_is_handed_count_the_groups_in_flight():
    seed = RolloutConfig(rollout_batch_size=64, n_samples_per_prompt=8)
    assert sequences_per_engine(seed, num_engines=1) == 512 and sequences_per_engine(seed, num_engines=3) == 176
    partial = resolve(Config(model=ModelConfig(path="m"), data=DataConfig(source="d.jsonl"), rollout=RolloutConfig(
        rollout_batch_size=64, n_samples_per_prompt=8, partial_rollout=True, max_staleness=2)), 2).rollout
    assert sequences_per_engine(partial, num_engines=2) == 2 * 64 * 8 // 2  # the groups in flight, by default


def in_flight(rollout_batch_size: int, max_staleness: int, partial_rollout: bool) -> int:
    return resolve(Config(model=ModelConfig(path="m"), data=DataConfig(source="d.jsonl"), rollout=RolloutConfig(
        rollout_batch_size=rollout_batch_size, partial_rollout=partial_rollout, max_staleness=max_staleness)),
        1).rollout.over_sampling_batch_size


def test_partial_rollouts_keep_half_the_bounds_room_in_flight_by_default():
    # A group waits about in_flight / rollout_batch_size - 1 pushes (oldest first): half the bound, so only the
    # slowest samples reach it (all of them would with the bound's whole room, and the health check would warn).
    assert in_flight(64, 1, True) == 96 and in_flight(64, 2, True) == 128 and in_flight(64, 4, True) == 192
    assert in_flight(1, 1, True) == 2 and in_flight(5, 1, True) == 8  # rounded up: room for an early end
    assert in_flight(64, 1, False) == 128 and in_flight(64, 0, False) == 64  # without: the rollouts' worth


def test_samples_round_trip_through_the_checkpoint_form_exactly():
    s = sample(3, [1, 1, 2])
    s.rollout_log_probs, s.metadata, s.label = [-0.1 / 3, -1e-300, -7.25], {"k": (1, 2)}, {"answer": [1]}
    assert sample_from_dict(sample_to_dict(s)) == s


def test_a_resume_refuses_groups_in_flight_its_settings_cannot_continue():
    """Saved groups whose size is not the resumed run's n_samples_per_prompt, or an unfinished sample the engine
    would refuse (no new tokens left under a lower max_new_tokens, a prompt too long for the context), are named
    before the run starts, not met as an engine error at every retry."""
    groups = [[sample(0, [1] * 5), sample(0, [1, 1], Status.COMPLETED)], [sample(1, []), sample(1, [1])]]
    assert resume_problem(groups, 2, 6, 64) is None
    assert "rollout.n_samples_per_prompt=4" in resume_problem(groups, 4, 6, 64)
    assert "5 response tokens" in resume_problem(groups, 2, 5, 64)
    finished_long = [[sample(2, [1] * 9, Status.TRUNCATED), sample(2, [1])]]
    assert resume_problem(finished_long, 2, 6, 64) is None  # a finished response needs no new tokens
    assert "prompt of 3 tokens" in resume_problem(groups, 2, 6, 8)


@pytest.fixture(scope="module")
def pool():
    with RewardPool(RewardConfig(user_fn="tests.reward_fns:digit_fraction", num_workers=1)) as p:
        yield p


def prompts(count: int = 40) -> list[Prompt]:
    return [Prompt(text=f"q{i}", token_ids=[1 + i % 7, 2 + i % 11, 3 + i % 13], label=str(i % 10), metadata={})
            for i in range(count)]


def run_rollouts(pool, ro: RolloutConfig, buffer: RolloutBuffer | None, rollouts: int, **engine_kwargs):
    """Rollouts with a weight push (new random weights, version + 1) after each; yields (version, samples, stats)
    and keeps every version's model for the checks."""
    models = {1: tiny_model(seed=1).eval()}
    engine = NativeEngine(models[1].config, torch.device("cpu"), torch.float32, max_batch_size=64, seed=0,
                          max_context_len=128, steps_per_poll=4, **engine_kwargs)
    engine.load_weights(full_weights(models[1]))
    collector = Collector(engine, pool, tiny_tokenizer(), ro, ONE_RANK, buffer=buffer)
    dataset = PromptDataset(prompts(), shuffle=True, seed=0)
    sampling = SamplingParams.from_config(ro, [])
    for rollout_id in range(rollouts):
        version = rollout_id + 1
        samples, stats = collector.rollout(dataset, sampling, version, rollout_id, 60.0)
        yield version, samples, stats, models
        models[version + 1] = tiny_model(seed=version + 1).eval()
        engine.load_weights(full_weights(models[version + 1]))


def test_a_rollout_counts_its_decode_steps_and_the_rows_they_ran(pool):
    """3 samples (a graph bucket of 4 rows) of exactly 6 tokens: the first comes with the prefill, 5 decode steps
    over 3 rows; and the tokens prefilled."""
    ro = RolloutConfig(rollout_batch_size=3, n_samples_per_prompt=1, max_new_tokens=6, max_context_len=32,
                       over_sampling_batch_size=3)
    model = tiny_model(seed=1).eval()
    engine = NativeEngine(model.config, torch.device("cpu"), torch.float32, max_batch_size=8, seed=0,
                          max_context_len=32, steps_per_poll=4)
    engine.load_weights(full_weights(model))
    collector = Collector(engine, pool, tiny_tokenizer(), ro, ONE_RANK)
    dataset = PromptDataset(prompts(), shuffle=False, seed=0)
    for rollout_id in range(2):
        _, stats = collector.rollout(dataset, SamplingParams.from_config(ro, []), 1, rollout_id, 60.0)
        assert stats["rollout/decode_steps"] == 5 and stats["rollout/decode_rows_mean"] == 3
        assert stats["rollout/prefill_tokens"] == 3 * 3  # three prompts of 3 tokens
    assert (engine.stats.decode_steps, engine.stats.decode_row_steps) == (10, 30)  # over the engine's life


def check_tokens_against_their_versions(sample: Sample, models: dict) -> None:
    """Each response token's engine logprob is its recorded version's, given everything before it: no token
    was sampled by other weights than it says, nor continued on a prefix (KV) computed by other weights."""
    prompt, response = sample.tokens[: sample.prompt_length], sample.tokens[sample.prompt_length :]
    for version in set(sample.token_versions):
        want = reference_logprobs(models[version], prompt, response)
        for j, v in enumerate(sample.token_versions):
            if v == version:
                assert sample.rollout_log_probs[j] == pytest.approx(want[j], abs=1e-4), (sample.index, j, v)


@pytest.mark.parametrize("max_staleness,shared", [(1, False), (2, False), (2, True)])
def test_partial_rollouts_train_whole_groups_once_within_the_bound(pool, max_staleness, shared, monkeypatch):
    """`shared`: the continued samples of a prompt share its pages (pages of 2 tokens, the floor lowered to 2), so
    the check of every token against its version also covers the shared prompt's KV computed under new weights."""
    ro = RolloutConfig(rollout_batch_size=BATCH, n_samples_per_prompt=N, max_new_tokens=48, stop_token_ids=STOPS,
                       max_context_len=128, partial_rollout=True, max_staleness=max_staleness,
                       over_sampling_batch_size=(max_staleness + 1) * BATCH)
    buffer = RolloutBuffer(BATCH, max_staleness)
    trained, lags, partial, carried = set(), [], [], 0
    links = []
    if shared:
        monkeypatch.setattr(scheduler, "SHARED_PROMPT_MIN_TOKENS", 2)
        share = scheduler.share_bases
        monkeypatch.setattr(scheduler, "share_bases", lambda prompts, page_size: (
            share(prompts, page_size), links.extend(p for p in prompts.values() if p.base is not None)))
    for version, samples, stats, models in run_rollouts(pool, ro, buffer, rollouts=6,
                                                        **({"page_size": 2} if shared else {})):
        # The responses continued in this rollout, whose KV the engine computed again (one round a rollout here).
        assert stats["rollout/sampling_rounds"] == 1 and stats["rollout/resumed_tokens"] == carried
        carried = sum(s.response_length for g in buffer.unfinished() for s in g if s.status not in FINISHED)
        groups = {s.group_index for s in samples}
        assert len(samples) == BATCH * N and len(groups) == BATCH and not groups & trained  # whole, and once
        trained |= groups
        for s in samples:
            assert s.status in FINISHED and len(s.token_versions) == s.response_length == len(s.rollout_log_probs)
            assert all(0 <= version - v <= max_staleness for v in s.token_versions)  # per token, not per queue
            check_tokens_against_their_versions(s, models)
        assert stats["rollout/dropped_stale"] == 0 and stats["rollout/staleness_max"] <= max_staleness
        assert stats["rollout/carried_over"] == len(buffer.groups)
        lags.append(stats["rollout/staleness_max"])
        partial.append(stats["rollout/partial_frac"])
        # Nothing is lost: every group drawn was trained or is still in flight.
        assert buffer.admitted == buffer.consumed + len(buffer.groups) == len(trained) + len(buffer.groups)
    assert max(partial) > 0 and max(lags) >= 1 and carried > 0  # samples did cross weight pushes
    assert bool(links) == shared


def test_the_dynamic_filter_drops_flat_groups_from_the_buffer_and_frees_their_place():
    """Partial rollouts with rollout.dynamic_filter: a finished group whose rewards are all equal (every answer
    that is a multiple of 4 scores 0) leaves the buffer untrained, counted as consumed, and new groups take its
    place; the batch is whole groups with a reward signal, within the bound, each trained once."""
    ro = RolloutConfig(rollout_batch_size=BATCH, n_samples_per_prompt=N, max_new_tokens=48, stop_token_ids=STOPS,
                       max_context_len=128, partial_rollout=True, max_staleness=1, dynamic_filter="nonzero_std",
                       over_sampling_batch_size=6, max_sampling_rounds=16)
    buffer = RolloutBuffer(BATCH, 1)
    trained, filtered = set(), []
    with RewardPool(RewardConfig(user_fn="tests.reward_fns:flat_on_multiples_of_4", num_workers=1)) as flat:
        for version, samples, stats, _ in run_rollouts(flat, ro, buffer, rollouts=5):
            groups = {}
            for s in samples:
                groups.setdefault(s.group_index, []).append(s)
            assert len(groups) == BATCH and not groups.keys() & trained and stats["rollout/topped_up_groups"] == 0
            trained |= groups.keys()
            for group in groups.values():
                assert len(group) == N and len({s.reward for s in group}) > 1  # a signal in every trained group
                assert all(0 <= version - v <= 1 for s in group for v in s.token_versions)
            # No flat group waits in the buffer, and every group drawn is trained, filtered out (consumed untrained)
            # or still in flight.
            assert all(len({s.reward for s in g}) > 1 for g in buffer.finished())
            assert buffer.admitted == buffer.consumed + len(buffer.groups)
            filtered.append(stats["rollout/filtered_group_frac"])
    assert buffer.consumed > len(trained) and max(filtered) > 0  # the filter did drop groups


def test_a_group_past_the_bound_is_dropped_untrained_and_counted(pool):
    """A group older than the bound (here: put in flight by hand, as a resume with a lower bound would leave it)
    never trains; the rollout counts it and the health band reads the fraction."""
    ro = RolloutConfig(rollout_batch_size=BATCH, n_samples_per_prompt=N, max_new_tokens=48, stop_token_ids=STOPS,
                       max_context_len=128, partial_rollout=True, max_staleness=1, over_sampling_batch_size=2 * BATCH)
    buffer = RolloutBuffer(BATCH, 1)
    buffer.admit([[sample(10_000, [-1, 0]), sample(10_000, [-1], Status.COMPLETED)]])  # oldest token: 2 behind
    _, samples, stats, _ = next(run_rollouts(pool, ro, buffer, rollouts=1))
    assert 10_000 not in {s.group_index for s in samples} and len(samples) == BATCH * N
    assert stats["rollout/dropped_stale"] == 1 and stats["rollout/dropped_stale_frac"] == 1 / (1 + BATCH)
    assert buffer.admitted == buffer.consumed + len(buffer.groups)


class LengthEngine(StandInEngine):
    """A stand-in engine whose requests end after `lengths[first prompt token]` response tokens: every request gains
    a token a step, and `on_finish` hears of those that just finished; an early end aborts the rest."""

    def __init__(self, lengths: dict[int, int]):
        super().__init__()
        self.lengths = lengths

    def _generate(self, prompts, params, on_finish, prior, keep):
        have, out = list(prior), [None] * len(prompts)

        def completion(i: int, reason: str) -> Completion:
            return Completion([7] * (have[i] - prior[i]), [-1.0] * (have[i] - prior[i]), reason)

        while None in out:
            running = [i for i, o in enumerate(out) if o is None]
            for i in running:
                have[i] += 1
            done = {i: completion(i, "stop") for i in running if have[i] >= self.lengths[prompts[i][0]]}
            for i, c in done.items():
                out[i] = c
            if done and on_finish is not None and on_finish(done):
                return [o or completion(i, "abort") for i, o in enumerate(out)]
        return out


def rollouts_over_lengths(pool, kinds: list[int], max_staleness: int, rollouts: int = 6) -> list[list[int]]:
    """Partial rollouts (batches of 2 groups of 1 sample) over prompts whose responses end after a length set by
    their kind (1: 5 tokens, 2: 50, 3: 200): the groups trained by each rollout, checked to be within the bound."""
    ro = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=1, max_new_tokens=250, max_context_len=256,
                       partial_rollout=True, max_staleness=max_staleness,
                       over_sampling_batch_size=2 * (max_staleness + 1))
    dataset = PromptDataset([Prompt(text=f"q{i}", token_ids=[k, 3, 4], label="1", metadata={})
                             for i, k in enumerate(kinds)], shuffle=False, seed=0)
    buffer = RolloutBuffer(2, max_staleness)
    engine = LengthEngine({1: 5, 2: 50, 3: 200})
    collector = Collector(engine, pool, tiny_tokenizer(), ro, ONE_RANK, buffer=buffer)
    trained = []
    for rollout_id in range(rollouts):
        version = rollout_id + 1
        samples, stats = collector.rollout(dataset, SamplingParams.from_config(ro, []), version, rollout_id, 60.0)
        assert stats["rollout/dropped_stale"] == 0, (version, trained)
        assert all(0 <= version - v <= max_staleness for s in samples for v in s.token_versions)
        trained.append([s.group_index for s in samples])
    return trained


def test_old_groups_finishing_last_still_train_within_the_bound(pool):
    """Groups finish out of order: the first rollout's groups 2-5 are long, the groups after them short. Were the
    second rollout to end once its short groups finished, they would take its batch, and the third rollout would
    find four groups due for a batch of two: two dropped. The schedule rule keeps that rollout going until no
    more groups fall due at the next push than its batch takes."""
    trained = rollouts_over_lengths(pool, [1, 1, 3, 3, 3, 3] + [1] * 20, max_staleness=2)
    assert trained[:4] == [[0, 1], [2, 3], [4, 5], [6, 7]]  # the long groups trained in time, oldest first


def test_a_rollout_behind_schedule_generates_even_with_a_batch_ready(pool):
    """max_staleness 3: after rollout 2 four long groups of rollout 1 are unfinished (two batches' worth, on
    schedule for two pushes ahead) and two short groups are ready. At rollout 3 those four fall due within one
    push: the rollout must generate until two of them finish, though a batch is ready; were it to train the
    ready groups without generating, rollout 4 would find all four due and two would pass the bound."""
    trained = rollouts_over_lengths(pool, [1, 1, 3, 3, 3, 3, 2, 2] + [1] * 20, max_staleness=3)
    assert trained[:5] == [[0, 1], [6, 7], [2, 3], [4, 5], [8, 9]]


def test_a_rollout_logs_the_mean_context_its_tokens_were_sampled_over(pool):
    """Batches of one group of one sample over 3-token prompts: group 0 runs 200 tokens, the others 5. Rollout 1
    samples 5 tokens of groups 0 and 1 (over contexts 3..7), rollout 2 five more of group 0 where it left off (over
    8..12) and 5 of group 2, rollout 3 the last 190 of group 0 (over 13..202), which is due, and 5 of group 3."""
    ro = RolloutConfig(rollout_batch_size=1, n_samples_per_prompt=1, max_new_tokens=250, max_context_len=256,
                       partial_rollout=True, max_staleness=2, over_sampling_batch_size=2)  # the default
    dataset = PromptDataset([Prompt(text=f"q{i}", token_ids=[k, 3, 4], label="1", metadata={})
                             for i, k in enumerate([3, 1, 1, 1, 1])], shuffle=False, seed=0)
    collector = Collector(LengthEngine({1: 5, 3: 200}), pool, tiny_tokenizer(), ro, ONE_RANK,
                          buffer=RolloutBuffer(1, 2))
    five = 5 * 3 + 10  # tokens sampled over 3, 4, 5, 6 and 7 tokens
    want = [(five + five) / 10, (5 * 8 + 10 + five) / 10, (190 * 13 + 190 * 189 // 2 + five) / 195]
    for rollout_id, mean in enumerate(want):
        _, stats = collector.rollout(dataset, SamplingParams.from_config(ro, []), rollout_id + 1, rollout_id, 60.0)
        assert stats["rollout/context_mean"] == pytest.approx(mean)


def test_staleness_zero_through_the_buffer_is_the_synchronous_rollout(pool):
    """With max_staleness 0 and no partial rollouts the buffer's path draws, generates and keeps exactly what the
    synchronous path does: the bound's machinery adds nothing of its own."""
    ro = RolloutConfig(rollout_batch_size=BATCH, n_samples_per_prompt=N, max_new_tokens=48, stop_token_ids=STOPS,
                       max_context_len=128, over_sampling_batch_size=BATCH)
    plain = list(run_rollouts(pool, ro, None, rollouts=3))
    buffered = list(run_rollouts(pool, ro, RolloutBuffer(BATCH, 0), rollouts=3))
    for (_, a, stats_a, _), (_, b, stats_b, _) in zip(plain, buffered, strict=True):
        assert [(s.index, s.tokens, s.rollout_log_probs, s.reward) for s in a] == \
               [(s.index, s.tokens, s.rollout_log_probs, s.reward) for s in b]
        assert stats_b["rollout/staleness_max"] == 0 and stats_b["rollout/carried_over"] == 0
        shared = (stats_a.keys() & stats_b.keys()) - {"perf/rollout_s", "perf/reward_s", "perf/rollout_tokens_per_s"}
        assert {k: stats_a[k] for k in shared} == {k: stats_b[k] for k in shared}


PARTIAL = ("--rollout.partial_rollout=true", "--rollout.max_staleness=1", "--rollout.max_new_tokens=48",
           "--rollout.native.steps_per_poll=2", f"--rollout.stop_token_ids={STOPS}", "--log.sample_interval=1")
COMPARED = ["rollout_id", "weight_version", "rollout/reward_mean", "train/loss", "train/grad_norm",
            "rollout/staleness_mean", "rollout/partial_frac", "rollout/carried_over", "rollout/num_scored"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    return save_tiny_model_dir(root / "model"), write_arithmetic_jsonl(root / "train.jsonl")


def dumped(out) -> dict[int, list[dict]]:
    return {int(p.stem.split("_")[1]): [json.loads(line) for line in p.read_text().splitlines()]
            for p in (out / "samples").glob("rollout_*.jsonl")}


def test_the_groups_in_flight_survive_a_resume_exactly(inputs, tmp_path):
    """4 rollouts straight == 2, a stop with groups in flight, and 2 more resumed: the same samples trained
    (none lost, none twice), the same metrics and bitwise-equal weights; on 2 ranks, each token within the bound."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    launch(inputs, straight, 2, "--train.num_rollout=4", "--checkpoint.interval=2", *PARTIAL)
    launch(inputs, resumed, 2, "--train.num_rollout=2", "--checkpoint.interval=2", *PARTIAL)
    assert (resumed / "checkpoints" / "rollout_1" / "rollout_buffer.json").is_file()
    # A resume whose max_new_tokens leaves a carried sample nothing to generate stops at the start, with one line.
    shutil.copytree(resumed, tmp_path / "shorter")
    refused = launch(inputs, tmp_path / "shorter", 2, "--train.num_rollout=4", "--checkpoint.resume=auto", *PARTIAL,
                     "--rollout.max_new_tokens=1", check=False)
    assert rank_exit_code(refused) == 2
    line = one_line(refused, "rl: error:")
    assert "in flight that this run cannot continue" in line and "rollout.max_new_tokens=1" in line, line
    launch(inputs, resumed, 2, "--train.num_rollout=4", "--checkpoint.interval=2", "--checkpoint.resume=auto",
           *PARTIAL)
    a, b = rows(straight), rows(resumed)
    assert [r["rollout_id"] for r in b] == [0, 1, 2, 3]
    assert rows(straight)[1]["rollout/carried_over"] > 0  # the stop did leave groups in flight
    for ra, rb in zip(a, b, strict=True):
        assert {k: ra[k] for k in COMPARED} == {k: rb[k] for k in COMPARED}
    wa, wb = final_weights(straight), final_weights(resumed)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert checkpoints(resumed) == ["rollout_1", "rollout_3"]
    da, db = dumped(straight), dumped(resumed)
    assert da == db
    trained = [s["group_index"] for r in sorted(da) for s in da[r]]
    assert len(trained) == len(set(trained)) * 4  # n_samples_per_prompt = 4: each group trained once, whole
    for r, samples in da.items():
        version = a[r]["weight_version"] - 1  # the row holds the version after this rollout's push
        for s in samples:
            assert all(0 <= version - v <= 1 for v, _ in s["token_versions"])
            assert sum(count for _, count in s["token_versions"]) == s["response_length"]
    assert any(len(s["token_versions"]) > 1 for samples in da.values() for s in samples)
