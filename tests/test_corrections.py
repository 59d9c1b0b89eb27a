"""The rollout-correction menu against hand-computed values: masked importance sampling over a band of ratios (token
and sequence level), the geometric sequence ratio, and the engine-vs-trainer KL metrics."""

import math

import pytest
import torch

from rl.config import ConfigError, config_from_dict
from rl.train.algo import approx_kl_k3, tis_weights
from rl.train.step import SUM_KEYS, add_mismatch

E = torch.zeros(2, 3)  # the engine's logprobs: the ratios are exp(old)
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


def test_masked_is_leaves_out_tokens_outside_the_band_on_either_side():
    """Band [0.5, 1.5]: e^0.5 = 1.65 is above it, e^-1 = 0.37 below it, e^-0.1 = 0.90 and e^0.05 = 1.05 inside."""
    old = torch.tensor([[0.5, -1.0, 9.0], [-0.1, 0.05, -0.69]])
    w, outside = tis_weights(old, E, MASK, 1.5, "token", "mask", low=0.5)
    want = [0.0, 0.0, 1.0, math.exp(-0.1), math.exp(0.05), math.exp(-0.69)]
    assert w.flatten().tolist() == pytest.approx(want, abs=1e-6)
    assert outside.tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]  # e^-0.69 = 0.5016: just inside


def test_masked_is_at_sequence_level_keeps_or_drops_whole_sequences():
    """Row 0: e^(0.5 - 1) = 0.61, inside [0.5, 1.5]; row 1: e^(0.3 * 3) = 2.46, above: every token of it goes."""
    old = torch.tensor([[0.5, -1.0, 9.0], [0.3, 0.3, 0.3]])
    w, outside = tis_weights(old, E, MASK, 1.5, "sequence", "mask", low=0.5)
    assert w.flatten().tolist() == pytest.approx([math.exp(-0.5)] * 3 + [0.0] * 3, abs=1e-6)
    assert outside.tolist() == [[0.0] * 3, [1.0] * 3]


def test_the_geometric_ratio_is_the_mean_log_ratio_over_the_trained_tokens():
    """Row 0: mean(0.5, -1.0) = -0.25 (the padding's 9.0 is no token of it); row 1: e^0.3 = 1.35, inside the band
    where the product (2.46, above) would drop the sequence."""
    old = torch.tensor([[0.5, -1.0, 9.0], [0.3, 0.3, 0.3]])
    w, outside = tis_weights(old, E, MASK, 1.5, "geometric", "mask", low=0.5)
    assert w.flatten().tolist() == pytest.approx([math.exp(-0.25)] * 3 + [math.exp(0.3)] * 3, abs=1e-6)
    assert outside.sum() == 0
    w, _ = tis_weights(old, E, MASK, 1.2, "geometric", "truncate")
    assert w[1].tolist() == pytest.approx([1.2] * 3)


def test_the_mismatch_metrics_take_the_largest_token_kl_over_trained_tokens_only():
    sums = {key: torch.zeros(()) for key in SUM_KEYS}
    trainer = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -3.0]])
    engine = torch.tensor([[-1.2, -1.0, -0.1], [-0.5, -0.4, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    add_mismatch(sums, trainer, engine, mask, [0, 1], [])
    k3 = approx_kl_k3(engine, trainer)
    assert sums["mismatch_k3_max"] == pytest.approx(float(k3[mask.bool()].max()))
    assert sums["mismatch_k3_max"] < float(k3[0, 2])  # the padding's difference is the largest and does not count
    assert sums["mismatch_k3_sum"] == pytest.approx(float((k3 * mask).sum()))


@pytest.mark.parametrize("algo, error", [
    ({"tis_cap": 2.0, "tis_cap_low": 0.5}, "needs algo.tis_mode = 'mask'"),
    ({"tis_cap": 2.0, "tis_mode": "mask", "tis_cap_low": 1.5}, "0 < tis_cap_low < 1 < tis_cap"),
])
def test_a_band_that_cannot_work_is_one_line(algo, error):
    with pytest.raises(ConfigError, match=error) as err:
        config_from_dict({"model": {"path": "m"}, "data": {"source": "d.jsonl"}, "algo": algo})
    assert "\n" not in str(err.value)
