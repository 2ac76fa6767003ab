"""Hand-computed cases and preconditions for every aggregation rule."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zoo_gym.aggregation import (
    RULES,
    aggregate,
    bulyan,
    centered_clipping,
    clip_updates,
    fedavg,
    geometric_median,
    krum,
    median,
    min_clients,
    nnm,
    trimmed_mean,
)
from zoo_gym.aggregation._select import closest_to_median


def col(*values: float) -> torch.Tensor:
    """Updates with one coordinate each, shape (n, 1)."""
    return torch.tensor(values, dtype=torch.float32)[:, None]


def test_fedavg_weighted() -> None:
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    result = fedavg(x, weights=torch.tensor([1.0, 3.0]))
    assert result.vector.tolist() == [2.5, 3.5]
    assert [d.weight for d in result.decisions] == [0.25, 0.75]
    assert result.vector.dtype == torch.float32


def test_krum_scores_and_choice() -> None:
    # n=5, f=1 -> 2 nearest: scores 5, 2, 5, 65, 82
    x = col(0, 1, 2, 10, 11)
    result = krum(x, f=1)
    assert result.vector.tolist() == [1.0]
    assert [d.score for d in result.decisions] == [5.0, 2.0, 5.0, 65.0, 82.0]
    assert [d.selected for d in result.decisions] == [False, True, False, False, False]
    assert result.decisions[3].reason == "not the lowest Krum score (score 65)"


def test_multikrum_averages_lowest_scores_ties_to_the_more_central() -> None:
    # scores 5, 2, 5, 65, 82; the tie 0 vs 2 goes to 2 (total distance 150 < 226)
    result = krum(col(0, 1, 2, 10, 11), f=1, m=2)
    assert result.vector.tolist() == [1.5]
    assert [d.weight for d in result.decisions] == [0.0, 0.5, 0.5, 0.0, 0.0]
    assert result.decisions[4].reason == "not among the 2 lowest Krum scores (score 82)"


def test_trimmed_mean_drops_f_each_side() -> None:
    x = torch.tensor([[1.0, 7.0], [2.0, 5.0], [3.0, 5.0], [100.0, 5.0], [-50.0, 0.0]])
    result = trimmed_mean(x, f=1)
    assert result.vector.tolist() == [2.0, 5.0]
    shares = [d.trimmed_share for d in result.decisions]
    assert shares == [0.5, 0.0, 0.0, 0.5, 1.0]
    assert result.decisions[4].reason == "trimmed in 100% of coordinates"


def test_median_even_count_is_mean_of_middles() -> None:
    assert median(col(4, 1, 3, 2)).vector.tolist() == [2.5]
    assert median(col(5, 1, 3)).vector.tolist() == [3.0]
    decisions = median(col(4, 1, 3, 2)).decisions
    assert [d.weight for d in decisions] == [0.0, 0.0, 0.5, 0.5]


def test_median_ties_share_the_middle_positions() -> None:
    # sorted 1, 1, 1, 2: the middles (positions 1 and 2) are both 1; the run of three 1s
    # covers positions 0-2, two of them middle, so each 1 holds 2/3 of a middle position
    result = median(col(1, 2, 1, 1))
    assert result.vector.tolist() == [1.0]
    assert [d.weight for d in result.decisions] == pytest.approx([1 / 3, 0.0, 1 / 3, 1 / 3])
    assert [d.selected for d in result.decisions] == [True, False, True, True]


def test_trimmed_mean_ties_share_the_cut() -> None:
    # f = 1, sorted 0, 0, 5, 5, 5, kept positions 1-3: one of the two 0s and two of the
    # three 5s are kept, shared equally; the mean is (0 + 5 + 5) / 3
    result = trimmed_mean(col(5, 0, 5, 0, 5), f=1)
    assert result.vector.tolist() == pytest.approx([10 / 3])
    shares = [d.trimmed_share for d in result.decisions]
    assert shares == pytest.approx([1 / 3, 1 / 2, 1 / 3, 1 / 2, 1 / 3])
    assert sum(1 - s for s in shares) == pytest.approx(3.0)


def test_bulyan_closest_to_median_ties_share_the_last_place() -> None:
    # values 0, 2, 3, 4, 5: median 3, distances 3, 1, 0, 1, 2; beta = 2 takes 3 and one
    # of the tied 2 and 4, shared: (3 + (2 + 4) / 2) / 2 = 3
    mean, share = closest_to_median(col(0, 2, 3, 4, 5), beta=2)
    assert mean.tolist() == [3.0]
    assert share.tolist() == [0.0, 0.5, 1.0, 0.5, 0.0]
    mean, share = closest_to_median(col(0, 2, 3, 4, 5), beta=4)  # 3, 2, 4, 5
    assert mean.tolist() == [3.5]
    assert share.tolist() == [0.0, 1.0, 1.0, 1.0, 1.0]


def test_bulyan_recursive_krum_then_closest_to_median() -> None:
    # n = 7, f = 1: theta = 5, beta = 3. Recursive Krum (k = 4, 3, 2, 1, 1 neighbours,
    # ties to the smaller total distance) picks 2, then 3 (tie with 1), 1, 4 (tie with 0),
    # 100 (three-way tie at 100^2); median of 1, 2, 3, 4, 100 is 3; closest 3: 2, 3, 4 -> 3
    x = torch.cat([col(0, 1, 2, 3, 4, 100, 200), -col(0, 1, 2, 3, 4, 100, 200)], dim=1)
    result = bulyan(x, f=1)
    assert result.vector.tolist() == [3.0, -3.0]
    assert [d.selected for d in result.decisions] == [False, False, True, True, True, False, False]
    assert [d.trimmed_share for d in result.decisions] == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    assert result.decisions[0].reason == "not among the 5 updates chosen by Krum"
    assert result.decisions[5].reason == "chosen by Krum, trimmed in 100% of coordinates"


def test_geometric_median_of_collinear_points_is_the_middle_one() -> None:
    result = geometric_median(col(0, 1, 10), iters=500, tol=0.0)
    assert result.vector.item() == pytest.approx(1.0, abs=1e-4)
    weighted = geometric_median(col(0, 1), weights=torch.tensor([3.0, 1.0]), iters=500, tol=0.0)
    assert weighted.vector.item() == pytest.approx(0.0, abs=1e-4)


def test_centered_clipping_one_step() -> None:
    # distances 5 and 0.5 from 0; scales 0.2 and 1: v = (0.2 [3, 4] + [0.5, 0]) / 2
    x = torch.tensor([[3.0, 4.0], [0.5, 0.0]])
    result = centered_clipping(x, tau=1.0, iters=1)
    assert result.vector.tolist() == pytest.approx([0.55, 0.4])
    assert [d.trimmed_share for d in result.decisions] == pytest.approx([0.8, 0.0])


def test_centered_clipping_default_radius_is_the_median_distance() -> None:
    # from 0: distances 0, 1, 2, median 1; the update at 2 is scaled by 1/2:
    # v = (0 + 1 + 0.5 * 2) / 3 = 2/3
    result = centered_clipping(col(0, 1, 2), iters=1)
    assert result.vector.tolist() == pytest.approx([2 / 3])
    assert [d.trimmed_share for d in result.decisions] == pytest.approx([0.0, 0.0, 0.5])
    assert "the median distance 1" in result.decisions[2].reason


def test_centered_clipping_default_resists_far_outliers() -> None:
    g = torch.Generator().manual_seed(0)
    honest = 1.0 + 0.1 * torch.randn(9, 50, generator=g)
    x = torch.cat([honest, torch.full((4, 50), 1e4)])
    result = centered_clipping(x)  # tau=None, iters=5
    assert (result.vector - honest.mean(dim=0)).norm() < 0.2 * honest.mean(dim=0).norm()
    assert all(d.trimmed_share > 0.99 for d in result.decisions[-4:])
    # a fixed radius from a zero start moves the centre by at most tau per step
    explicit = centered_clipping(x, tau=0.5, iters=5)
    assert explicit.vector.norm() <= 5 * 0.5 + 1e-4
    assert "> tau 0.5" in explicit.decisions[-1].reason


def test_centered_clipping_from_a_given_center() -> None:
    x = torch.tensor([[3.0, 4.0], [3.0, 4.0]])
    result = centered_clipping(x, tau=10.0, center=torch.tensor([1.0, 1.0]))
    assert result.vector.tolist() == pytest.approx([3.0, 4.0])


def test_nnm_mixes_with_nearest_neighbours() -> None:
    assert nnm(col(0, 1, 10), f=1).flatten().tolist() == [0.5, 0.5, 5.5]


def test_clip_updates_scales_long_rows_only() -> None:
    x = torch.tensor([[3.0, 4.0], [0.3, 0.4]])
    assert clip_updates(x, max_norm=1.0).flatten().tolist() == pytest.approx([0.6, 0.8, 0.3, 0.4])


def test_aggregate_dispatches_and_applies_nnm() -> None:
    x = col(0, 1, 2, 10, 11)
    assert aggregate("krum", x, f=1).vector.tolist() == [1.0]
    assert aggregate("multikrum", x, f=1).vector.tolist() == [3.25]  # m = n - f: 0, 1, 2, 10
    mixed = aggregate("median", x, f=1, pre="nnm")
    assert mixed.vector.item() == pytest.approx(median(nnm(x, f=1)).vector.item())
    assert mixed.decisions[0].reason.endswith("(after nearest-neighbour mixing)")
    assert set(RULES) == {
        "fedavg",
        "krum",
        "multikrum",
        "bulyan",
        "trimmed_mean",
        "median",
        "geometric_median",
        "centered_clipping",
    }


@pytest.mark.parametrize(
    ("rule", "f", "needed"),
    [
        ("krum", 2, 7),
        ("multikrum", 1, 5),
        ("bulyan", 1, 7),
        ("trimmed_mean", 2, 5),
        ("fedavg", 3, 1),
    ],
)
def test_min_clients(rule: str, f: int, needed: int) -> None:
    assert min_clients(rule, f) == needed


@pytest.mark.parametrize(
    ("call", "n"),
    [
        (lambda x: krum(x, f=1), 4),
        (lambda x: bulyan(x, f=1), 6),
        (lambda x: trimmed_mean(x, f=1), 2),
        (lambda x: nnm(x, f=1), 2),
        (lambda x: aggregate("median", x, f=2), 4),
    ],
)
def test_preconditions_raise_one_clear_line(call, n) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=r"needs .* got \d+; collect more updates or lower f"):
        call(torch.zeros(n, 3))


def test_bad_inputs_raise_value_error() -> None:
    with pytest.raises(ValueError, match="unknown aggregation rule"):
        aggregate("mean", torch.zeros(3, 2))
    with pytest.raises(ValueError, match="does not take weights"):
        aggregate("krum", torch.zeros(5, 2), weights=torch.ones(5))
    with pytest.raises(ValueError, match=r"\(n, d\)"):
        median(torch.zeros(3))
    with pytest.raises(ValueError, match="weights sum to zero"):
        fedavg(torch.zeros(2, 2), weights=torch.zeros(2))
    with pytest.raises(ValueError, match="m must be"):
        krum(torch.zeros(5, 2), f=1, m=6)
    with pytest.raises(ValueError, match=r"m must be an int >= 1, got 2\.5"):
        krum(torch.zeros(5, 2), f=1, m=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tau must be > 0 or None"):
        centered_clipping(torch.zeros(3, 2), tau=0.0)
    with pytest.raises(ValueError, match="iters must be an int >= 1"):
        geometric_median(torch.zeros(3, 2), iters=0)


def test_chunked_coordinate_rules_match_a_direct_computation() -> None:
    # large enough that the byte budget splits d into many chunks
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 100_003, generator=g)
    ordered = x.double().sort(dim=0).values
    assert torch.equal(median(x).vector, ordered[2:4].mean(dim=0).float())
    assert torch.equal(trimmed_mean(x, f=2).vector, ordered[2:4].mean(dim=0).float())
    assert torch.allclose(fedavg(x).vector, x.double().mean(dim=0).float())
    result = trimmed_mean(x, f=1)
    assert sum(d.trimmed_share for d in result.decisions) == pytest.approx(2.0)


def test_accepts_half_precision_and_returns_float32() -> None:
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=torch.bfloat16)
    assert median(x).vector.dtype == torch.float32
    assert median(x).vector.tolist() == [3.0, 4.0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rules_run_on_cuda_and_match_cpu() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(11, 5000, generator=g)
    for rule in RULES:
        params: dict[str, Any] = {"tau": 1.0} if rule == "centered_clipping" else {}
        cpu = aggregate(rule, x, f=2, **params)
        gpu = aggregate(rule, x.cuda(), f=2, **params)
        assert gpu.vector.device.type == "cuda"
        assert torch.allclose(cpu.vector, gpu.vector.cpu(), atol=1e-5)
