"""Property tests for every rule: permutation invariance, zero weights, identical outliers,
the minimum number of updates and the error one below it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zoo_gym.aggregation import (
    RULES,
    WEIGHTED_RULES,
    aggregate,
    krum,
    median,
    min_clients,
    trimmed_mean,
)

PARAMS: dict[str, dict[str, Any]] = {"centered_clipping": {"tau": 1.0}}
FAST = settings(max_examples=15, deadline=None)
#: rules whose choice among exactly tied updates does not depend on their order
TIE_SAFE = sorted(set(RULES) - {"krum", "multikrum", "bulyan"})


def draw(seed: int, n: int, d: int) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


def draw_ties(seed: int, n: int, d: int) -> torch.Tensor:
    """Small integers: many exactly equal values in every coordinate."""
    return torch.randint(-2, 3, (n, d), generator=torch.Generator().manual_seed(seed)).float()


def assert_permuted(a: Any, b: Any, perm: list[int]) -> None:
    """Decision j of `b` (run on the permuted updates) is decision perm[j] of `a`: the same
    choice, and weights equal to float32 precision (the iterative rules weigh rows by
    distances formed from float32 products, whose rounding follows the rows' blocking)."""
    assert torch.allclose(a.vector, b.vector, atol=1e-5)
    assert len(a.decisions) == len(perm)
    for j, i in enumerate(perm):
        assert a.decisions[i].selected == b.decisions[j].selected
        assert a.decisions[i].weight == pytest.approx(b.decisions[j].weight, rel=1e-6, abs=1e-9)
        assert a.decisions[i].trimmed_share == pytest.approx(
            b.decisions[j].trimmed_share, rel=1e-6, abs=1e-9
        )


@FAST
@given(
    rule=st.sampled_from(sorted(RULES)),
    seed=st.integers(0, 2**31),
    f=st.integers(0, 2),
    extra=st.integers(0, 4),
    d=st.integers(2, 20),
)
def test_permutation_invariance(rule: str, seed: int, f: int, extra: int, d: int) -> None:
    n = min_clients(rule, f) + extra
    x = draw(seed, n, d)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1)).tolist()
    a = aggregate(rule, x, f=f, **PARAMS.get(rule, {}))
    b = aggregate(rule, x[perm], f=f, **PARAMS.get(rule, {}))
    assert_permuted(a, b, perm)


@FAST
@given(
    rule=st.sampled_from(TIE_SAFE),
    seed=st.integers(0, 2**31),
    f=st.integers(0, 2),
    extra=st.integers(0, 4),
)
def test_permutation_invariance_with_tied_values(rule: str, seed: int, f: int, extra: int) -> None:
    # ties split the positions they cover equally, so decisions too are order-free
    n = min_clients(rule, f) + extra
    x = draw_ties(seed, n, 12)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1)).tolist()
    a = aggregate(rule, x, f=f, **PARAMS.get(rule, {}))
    b = aggregate(rule, x[perm], f=f, **PARAMS.get(rule, {}))
    assert_permuted(a, b, perm)


@FAST
@given(seed=st.integers(0, 2**31), f=st.integers(0, 3), extra=st.integers(0, 4))
def test_coordinate_rules_with_ties_match_a_sort(seed: int, f: int, extra: int) -> None:
    n = 2 * f + 1 + extra
    x = draw_ties(seed, n, 30)
    ordered = x.double().sort(dim=0).values
    expected = ordered[(n - 1) // 2 : n // 2 + 1].mean(dim=0).float()
    assert torch.equal(median(x).vector, expected)
    assert torch.allclose(trimmed_mean(x, f=f).vector, ordered[f : n - f].mean(dim=0).float())
    # every coordinate keeps n - 2f values and has 1 or 2 middle positions
    kept = sum(1.0 - d.trimmed_share for d in trimmed_mean(x, f=f).decisions)
    assert kept == pytest.approx(n - 2 * f)
    assert sum(d.weight for d in median(x).decisions) == pytest.approx(1.0)


@FAST
@given(
    rule=st.sampled_from(sorted(WEIGHTED_RULES)),
    seed=st.integers(0, 2**31),
    n=st.integers(2, 8),
    d=st.integers(1, 20),
)
def test_zero_weight_update_changes_nothing(rule: str, seed: int, n: int, d: int) -> None:
    x = draw(seed, n, d)
    w = torch.rand(n, generator=torch.Generator().manual_seed(seed)) + 0.1
    junk = torch.full((1, d), 1e6)
    a = aggregate(rule, x, weights=w)
    b = aggregate(rule, torch.cat([x, junk]), weights=torch.cat([w, torch.zeros(1)]))
    assert torch.allclose(a.vector, b.vector, atol=1e-4)
    assert not b.decisions[-1].selected and b.decisions[-1].weight == 0.0
    # the geometric median's distances come from float32 products of the shifted rows, whose
    # rounding moves with the rows present: weights agree to that precision, not to float64's
    for da, db in zip(a.decisions, b.decisions[:-1], strict=True):
        assert da.weight == pytest.approx(db.weight, abs=1e-4)


@FAST
@given(seed=st.integers(0, 2**31), f=st.integers(1, 4), extra=st.integers(0, 5))
def test_krum_ignores_f_identical_far_outliers(seed: int, f: int, extra: int) -> None:
    honest = draw(seed, f + 3 + extra, 16)
    x = torch.cat([honest, torch.full((f, 16), 1e3)])
    for m in (1, honest.shape[0]):
        result = krum(x, f=f, m=m)
        assert not any(d.selected for d in result.decisions[-f:])
    assert torch.allclose(krum(x, f=f, m=honest.shape[0]).vector, honest.mean(dim=0), atol=1e-5)
    multi = aggregate("multikrum", x, f=f)
    assert not any(d.selected for d in multi.decisions[-f:])


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("f", [0, 1, 3])
def test_every_rule_runs_at_its_minimum_n_and_not_below(rule: str, f: int) -> None:
    n = min_clients(rule, f)
    result = aggregate(rule, draw(f, n, 7), f=f, **PARAMS.get(rule, {}))
    assert result.vector.shape == (7,) and result.vector.dtype == torch.float32
    assert torch.isfinite(result.vector).all()
    assert len(result.decisions) == n
    if rule != "centered_clipping":  # clipping leaves the rest of the weight on the centre
        assert sum(d.weight for d in result.decisions) == pytest.approx(1.0)
    if n > 1:
        with pytest.raises(ValueError, match=r"needs .* got \d+; collect more updates or lower f"):
            aggregate(rule, draw(f, n - 1, 7), f=f, **PARAMS.get(rule, {}))


@pytest.mark.parametrize("f", [0, 1, 2, 5])
def test_trimmed_mean_at_its_minimum_is_the_median(f: int) -> None:
    x = draw(f, 2 * f + 1, 33)
    assert torch.equal(trimmed_mean(x, f=f).vector, median(x).vector)


@pytest.mark.parametrize("rule", sorted(RULES))
def test_nnm_composes_with_every_rule(rule: str) -> None:
    x = draw(3, min_clients(rule, 1) + 2, 9)
    result = aggregate(rule, x, f=1, pre="nnm", **PARAMS.get(rule, {}))
    assert len(result.decisions) == x.shape[0]
    assert torch.isfinite(result.vector).all()
