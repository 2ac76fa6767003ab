"""Property tests: permutation invariance, zero weights, outliers, minimum n, decisions."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zoo_gym.aggregation import RULES, aggregate, fedavg, geometric_median, krum, min_clients

PARAMS: dict[str, dict[str, Any]] = {"centered_clipping": {"tau": 1.0}}
FAST = settings(max_examples=15, deadline=None)


def draw(seed: int, n: int, d: int) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


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
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1))
    a = aggregate(rule, x, f=f, **PARAMS.get(rule, {}))
    b = aggregate(rule, x[perm], f=f, **PARAMS.get(rule, {}))
    assert torch.allclose(a.vector, b.vector, atol=1e-5)
    assert len(a.decisions) == n
    for j, i in enumerate(perm.tolist()):
        assert a.decisions[i].selected == b.decisions[j].selected


@FAST
@given(seed=st.integers(0, 2**31), n=st.integers(2, 8), d=st.integers(1, 20))
def test_zero_weight_update_changes_nothing(seed: int, n: int, d: int) -> None:
    x = draw(seed, n, d)
    w = torch.rand(n, generator=torch.Generator().manual_seed(seed)) + 0.1
    junk = torch.full((1, d), 1e6)
    x2, w2 = torch.cat([x, junk]), torch.cat([w, torch.zeros(1)])
    assert torch.allclose(fedavg(x, weights=w).vector, fedavg(x2, weights=w2).vector)
    gm, gm2 = geometric_median(x, weights=w), geometric_median(x2, weights=w2)
    assert torch.allclose(gm.vector, gm2.vector, atol=1e-4)
    assert not fedavg(x2, weights=w2).decisions[-1].selected


@FAST
@given(seed=st.integers(0, 2**31), f=st.integers(1, 4), extra=st.integers(0, 5))
def test_krum_ignores_f_identical_far_outliers(seed: int, f: int, extra: int) -> None:
    honest = draw(seed, f + 3 + extra, 16)
    x = torch.cat([honest, torch.full((f, 16), 1e3)])
    for m in (1, honest.shape[0]):
        result = krum(x, f=f, m=m)
        assert not any(d.selected for d in result.decisions[-f:])
    assert torch.allclose(krum(x, f=f, m=honest.shape[0]).vector, honest.mean(dim=0), atol=1e-5)


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("f", [0, 1, 3])
def test_every_rule_runs_at_its_minimum_n_and_not_below(rule: str, f: int) -> None:
    n = min_clients(rule, f)
    result = aggregate(rule, draw(f, n, 7), f=f, **PARAMS.get(rule, {}))
    assert result.vector.shape == (7,) and result.vector.dtype == torch.float32
    assert len(result.decisions) == n
    assert sum(d.weight for d in result.decisions) == pytest.approx(
        1.0 if rule != "centered_clipping" else sum(d.weight for d in result.decisions)
    )
    if n > 1:
        with pytest.raises(ValueError):
            aggregate(rule, draw(f, n - 1, 7), f=f, **PARAMS.get(rule, {}))


@pytest.mark.parametrize("rule", sorted(RULES))
def test_nnm_composes_with_every_rule(rule: str) -> None:
    x = draw(3, min_clients(rule, 1) + 2, 9)
    result = aggregate(rule, x, f=1, pre="nnm", **PARAMS.get(rule, {}))
    assert len(result.decisions) == x.shape[0]
    assert torch.isfinite(result.vector).all()
