"""Update attacks and data attacks."""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest
import torch

from zoo_gym.attacks import ATTACKS, alie, alie_z, ipm, min_max, min_sum, poison_records


def honest(seed: int = 0, h: int = 10, d: int = 32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return 0.5 + torch.randn(h, d, generator=g)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_shapes_dtype_and_determinism(name: str) -> None:
    x = honest()
    a = ATTACKS[name](x, num_byzantine=3, f=3, generator=gen(7))
    b = ATTACKS[name](x, num_byzantine=3, f=3, generator=gen(7))
    assert a.shape == (3, 32) and a.dtype == torch.float32
    assert torch.equal(a, b)
    assert torch.isfinite(a).all()


def test_attack_names() -> None:
    assert set(ATTACKS) == {
        "sign_flip", "gaussian", "scaling", "alie", "ipm", "mimic", "min_max", "min_sum", "none",
    }  # fmt: skip


def test_alie_z_by_hand() -> None:
    # n = 50, f = 12: s = floor(26) - 12 = 14, z = Phi^-1(36/50) = Phi^-1(0.72) = 0.5828
    assert alie_z(50, 12) == pytest.approx(0.582842, abs=1e-6)
    # n = 20, f = 4: s = 11 - 4 = 7, z = Phi^-1(13/20)
    assert alie_z(20, 4) == pytest.approx(NormalDist().inv_cdf(0.65))
    with pytest.raises(ValueError, match="lower f"):
        alie_z(4, 0)  # s = 3, p = 0.25: fine
        alie_z(3, 5)


def test_alie_is_mean_minus_z_std() -> None:
    x = honest()
    out = alie(x, num_byzantine=2, f=2, generator=gen())
    z = alie_z(12, 2)
    expected = x.double().mean(0) - z * x.double().std(0)
    assert torch.allclose(out[0].double(), expected, atol=1e-6)
    assert torch.equal(out[0], out[1])


def test_ipm_points_against_the_honest_mean() -> None:
    x = honest()
    out = ipm(x, num_byzantine=1, f=1, generator=gen(), epsilon=0.5)
    mean = x.mean(0)
    cos = torch.nn.functional.cosine_similarity(out[0], mean, dim=0)
    assert cos.item() == pytest.approx(-1.0, abs=1e-6)
    assert out[0].norm().item() == pytest.approx(0.5 * mean.norm().item(), rel=1e-5)


@pytest.mark.parametrize("perturbation", ["unit", "std", "sign"])
def test_min_max_stays_within_the_honest_max_distance(perturbation: str) -> None:
    x = honest(h=12)
    out = min_max(x, num_byzantine=2, f=2, generator=gen(), perturbation=perturbation)
    attack_max = torch.cdist(out[:1].double(), x.double()).max().item()
    honest_max = torch.cdist(x.double(), x.double()).max().item()
    assert attack_max <= honest_max * (1 + 1e-6)
    assert attack_max >= 0.95 * honest_max  # the search pushes to the boundary
    assert not torch.allclose(out[0], x.mean(0))


def test_min_sum_stays_within_the_honest_max_sum() -> None:
    x = honest(h=12)
    out = min_sum(x, num_byzantine=1, f=1, generator=gen())
    attack_sum = torch.cdist(out.double(), x.double()).square().sum().item()
    honest_sum = torch.cdist(x.double(), x.double()).square().sum(1).max().item()
    assert attack_sum <= honest_sum * (1 + 1e-6)


RECORDS = [
    {"instruction": f"What is {i} + {i}?", "input": "", "output": str(2 * i)} for i in range(20)
]


@pytest.mark.parametrize("kind", ["label_flip", "random_completion"])
@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5, 1.0])
def test_data_attack_changes_the_requested_fraction(kind: str, fraction: float) -> None:
    out = poison_records(RECORDS, kind=kind, fraction=fraction, generator=gen(3))
    changed = sum(a["output"] != b["output"] for a, b in zip(RECORDS, out, strict=True))
    assert changed == round(fraction * len(RECORDS))
    assert [r["instruction"] for r in out] == [r["instruction"] for r in RECORDS]
    assert RECORDS[0]["output"] == "0"  # input untouched
    if kind == "label_flip":
        assert {r["output"] for r in out} <= {r["output"] for r in RECORDS}


def test_data_attack_is_deterministic_and_validates() -> None:
    assert poison_records(RECORDS, fraction=0.3, generator=gen(1)) == poison_records(
        RECORDS, fraction=0.3, generator=gen(1)
    )
    with pytest.raises(ValueError, match="unknown data attack"):
        poison_records(RECORDS, kind="swap", generator=gen())
    assert math.isfinite(alie_z(10, 1))
