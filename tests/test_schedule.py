"""How a rollout is cut into optimizer steps, DP shares and micro-batches (seed step 31)."""

import torch

import rl.train.step
from rl.config import TrainConfig
from rl.data import Sample
from rl.train.step import build_schedule, cut_micro_batches


def sample(index: int, prompt_len: int, response_len: int) -> Sample:
    s = Sample(prompt="", tokens=list(range(1, prompt_len + 1)), index=index, group_index=index // 4)
    s.append_response_tokens(list(range(2, response_len + 2)), [-1.0] * response_len)
    return s


def test_cut_by_rows_and_by_padded_tokens():
    samples = [sample(i, 2, n) for i, n in enumerate([1, 3, 3, 6, 18])]  # 3, 5, 5, 8, 20 tokens
    assert [[s.index for s in mb] for mb in cut_micro_batches(samples, 2, 0)] == [[0, 1], [2, 3], [4]]
    # 16 tokens: 3 rows of 5 fit (15), a 4th row of 8 would pad to 32; 20 exceeds the budget and trains alone
    assert [[s.index for s in mb] for mb in cut_micro_batches(samples, 2, 16)] == [[0, 1, 2], [3], [4]]


def test_every_rank_runs_the_same_number_of_micro_batches():
    lengths = [40, 3, 3, 3, 38, 3, 3, 36]  # balanced shares: [3, 3, 3, 40] and [3, 3, 36, 38]
    samples = [sample(i, 2, n) for i, n in enumerate(lengths)]
    cfg = TrainConfig(global_batch_size=8, micro_batch_tokens=45)
    per_rank = [build_schedule(samples, cfg, rank, 2, torch.device("cpu")) for rank in range(2)]
    counts = [len(schedule.steps[0]) for schedule in per_rank]
    assert counts == [3, 3]  # rank 0 cuts 2 and pads one: [3, 3, 3] [40] | [3, 3] [36] [38]
    assert [float(mb.loss_mask.sum()) == 0 for mb in per_rank[0].steps[0]] == [False, False, True]
    trained = sorted(i for schedule in per_rank for mb in schedule.micro_batches if mb.loss_mask.sum() > 0
                     for i in mb.indices)
    assert trained == list(range(8))  # every sample trains exactly once; the padding adds no loss tokens
    assert sum(float(mb.loss_mask.sum()) for schedule in per_rank for mb in schedule.micro_batches) == sum(lengths)
    assert per_rank[0].step_tokens == per_rank[1].step_tokens == [sum(lengths)]
    assert per_rank[0].step_seqs == per_rank[1].step_seqs == [8]
    assert per_rank[0].padding == per_rank[1].padding == 1


def test_widths_round_up_to_repeat_shapes_within_the_budget_and_the_context(monkeypatch):
    monkeypatch.setattr(rl.train.step, "width_multiple", lambda device: 8)
    samples = [sample(i, 2, n) for i, n in enumerate([1, 3, 3, 6, 10, 17])]  # 3, 5, 5, 8, 12, 19 tokens
    cfg = TrainConfig(global_batch_size=6, micro_batch_tokens=24)
    steps = build_schedule(samples, cfg, 0, 1, torch.device("cpu"), max_width=22).steps
    # rows are cut by the rounded width: 3 rows of 8 fit in 24, a 4th would not; 8 and 12 would fit as 2 x 12
    # but not as 2 x 16; 19 rounds to 24, past the context of 22
    assert [(mb.input_ids.shape[0], mb.input_ids.shape[1]) for mb in steps[0]] == [(3, 8), (1, 8), (1, 16), (1, 22)]
    assert [mb.indices for mb in steps[0]] == [[0, 1, 2], [3], [4], [5]]
