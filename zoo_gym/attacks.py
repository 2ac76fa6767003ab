"""Byzantine attacks, pure: update attacks on deltas and data attacks on records, played by
`gym-sim` (every attack) and by `gym-client join --byzantine` (those a lone process can play).

Update attacks share one signature,

    fn(honest: Tensor (h, d), *, num_byzantine, f, generator, **params) -> Tensor (num_byzantine, d),

where `honest` are the honest updates the attackers can see (the omniscient threat model
of the papers), `num_byzantine` the rows to produce, and `f` the number of Byzantine
updates the aggregator is configured to tolerate. With mu and sigma the coordinate-wise
mean and standard deviation of the honest updates:

- sign flip:    -scale * mu
- gaussian:     N(0, sigma_noise^2) per coordinate
- scaling:      boost * target (model replacement [Bagdasaryan et al., 2020]; target
                defaults to -mu, boost to n so that the mean lands on the target)
- ALIE:         mu - z * sigma with s = floor(n/2 + 1) - f and z = Phi^{-1}((n - s)/n)
                [Baruch et al., 2019, "A Little Is Enough"], n = h + num_byzantine
- IPM:          -epsilon * mu [Xie et al., 2020, "Fall of Empires"]
- mimic:        a copy of one honest update [Karimireddy et al., 2022]
- min-max / min-sum [Shejwalkar and Houmansadr, 2021, NDSS]: mu + gamma * p with p the
                unit vector -mu/||mu||, -sigma or -sign(mu); gamma is the largest value
                (binary search) such that the attack's max distance to the honest updates
                stays within the largest honest pairwise distance (min-max), or its sum of
                squared distances within the largest honest one (min-sum).

Data attacks (`poison_records`) corrupt Alpaca-style records {"instruction", "input",
"output"} before a real client trains on them.
"""

from __future__ import annotations

import math
import string
from collections.abc import Callable
from statistics import NormalDist

import torch
from torch import Tensor

__all__ = [
    "ATTACKS",
    "alie",
    "alie_z",
    "gaussian",
    "ipm",
    "mimic",
    "min_max",
    "min_sum",
    "no_attack",
    "poison_records",
    "scaling",
    "sign_flip",
]


def _check(honest: Tensor, num_byzantine: int) -> None:
    if honest.dim() != 2 or honest.shape[0] < 1:
        raise ValueError(
            f"honest updates must be a non-empty (h, d) tensor, got {tuple(honest.shape)}"
        )
    if num_byzantine < 0:
        raise ValueError(f"num_byzantine must be >= 0, got {num_byzantine}")


def _repeat(row: Tensor, num_byzantine: int) -> Tensor:
    """`row` (d,) as `(num_byzantine, d)` float32."""
    return row.to(torch.float32).expand(num_byzantine, -1).clone()


def _mean(honest: Tensor) -> Tensor:
    return honest.to(torch.float64).mean(dim=0)  # (d,)


def _std(honest: Tensor) -> Tensor:
    correction = 1 if honest.shape[0] > 1 else 0
    return honest.to(torch.float64).std(dim=0, correction=correction)  # (d,)


def sign_flip(
    honest: Tensor, *, num_byzantine: int, f: int, generator: torch.Generator, scale: float = 1.0
) -> Tensor:
    """-scale times the honest mean."""
    _check(honest, num_byzantine)
    return _repeat(-scale * _mean(honest), num_byzantine)


def gaussian(
    honest: Tensor, *, num_byzantine: int, f: int, generator: torch.Generator, sigma: float = 1.0
) -> Tensor:
    """Independent N(0, sigma^2) noise per coordinate and attacker."""
    _check(honest, num_byzantine)
    noise = torch.randn(
        (num_byzantine, honest.shape[1]),
        generator=generator,
        dtype=torch.float32,
        device=honest.device,
    )
    return sigma * noise


def scaling(
    honest: Tensor,
    *,
    num_byzantine: int,
    f: int,
    generator: torch.Generator,
    boost: float | None = None,
    target: Tensor | None = None,
) -> Tensor:
    """Model replacement: boost * target, boost = n = h + num_byzantine, target = -mean by default."""
    _check(honest, num_byzantine)
    goal = -_mean(honest) if target is None else target.to(honest.device, torch.float64)
    factor = float(honest.shape[0] + num_byzantine) if boost is None else boost
    return _repeat(factor * goal, num_byzantine)


def alie_z(n: int, f: int) -> float:
    """z_max of ALIE: s = floor(n/2 + 1) - f, z = Phi^{-1}((n - s) / n).

    >>> round(alie_z(50, 12), 4)
    0.5828
    """
    s = math.floor(n / 2 + 1) - f
    p = (n - s) / n
    if not 0.0 < p < 1.0:
        raise ValueError(f"ALIE needs 0 < (n - s)/n < 1, got n={n}, f={f}; lower f or add clients")
    return NormalDist().inv_cdf(p)


def alie(
    honest: Tensor,
    *,
    num_byzantine: int,
    f: int,
    generator: torch.Generator,
    z: float | None = None,
) -> Tensor:
    """A Little Is Enough: mean - z * std per coordinate, z from n = h + num_byzantine and f."""
    _check(honest, num_byzantine)
    zz = alie_z(honest.shape[0] + num_byzantine, f) if z is None else z
    return _repeat(_mean(honest) - zz * _std(honest), num_byzantine)


def ipm(
    honest: Tensor,
    *,
    num_byzantine: int,
    f: int,
    generator: torch.Generator,
    epsilon: float = 0.1,
) -> Tensor:
    """Inner-product manipulation: -epsilon times the honest mean."""
    _check(honest, num_byzantine)
    return _repeat(-epsilon * _mean(honest), num_byzantine)


def mimic(
    honest: Tensor,
    *,
    num_byzantine: int,
    f: int,
    generator: torch.Generator,
    index: int | None = None,
) -> Tensor:
    """Every attacker copies one honest update (`index`, or one drawn with `generator`)."""
    _check(honest, num_byzantine)
    i = int(torch.randint(honest.shape[0], (1,), generator=generator)) if index is None else index
    return _repeat(honest[i], num_byzantine)


def no_attack(honest: Tensor, *, num_byzantine: int, f: int, generator: torch.Generator) -> Tensor:
    """No attack: the Byzantine clients resend honest updates, cycling through them."""
    _check(honest, num_byzantine)
    rows = torch.arange(num_byzantine, device=honest.device) % honest.shape[0]
    out: Tensor = honest[rows].to(torch.float32)
    return out


def _perturbation(honest: Tensor, kind: str) -> Tensor:
    mu = _mean(honest)
    if kind == "unit":
        unit: Tensor = -mu / mu.norm().clamp_min(1e-300)
        return unit
    if kind == "std":
        return -_std(honest)
    if kind == "sign":
        return -torch.sign(mu)
    raise ValueError(f"unknown perturbation {kind!r}; choose unit, std or sign")


def _gamma_search(ok: Callable[[float], bool], gamma_init: float, tolerance: float) -> float:
    """The largest gamma found with ok(gamma) by the paper's halving search from gamma_init."""
    gamma, step, best = gamma_init, gamma_init, 0.0
    while abs(best - gamma) > tolerance:
        if ok(gamma):
            best = gamma
            gamma += step / 2
        else:
            gamma -= step / 2
        step /= 2
    return best


def _min_max_or_sum(
    honest: Tensor,
    num_byzantine: int,
    *,
    use_sum: bool,
    perturbation: str,
    gamma_init: float,
    tolerance: float,
) -> Tensor:
    x = honest.to(torch.float64)  # (h, d)
    mu, p = x.mean(dim=0), _perturbation(honest, perturbation)  # (d,), (d,)
    pairwise = torch.cdist(x, x).square()  # (h, h)
    bound = float(pairwise.sum(dim=1).max() if use_sum else pairwise.max())

    def ok(gamma: float) -> bool:
        m = (mu + gamma * p)[None, :]
        dist = torch.cdist(m, x).square()  # (1, h)
        return float(dist.sum() if use_sum else dist.max()) <= bound

    gamma = _gamma_search(ok, gamma_init, tolerance)
    return _repeat(mu + gamma * p, num_byzantine)


def min_max(
    honest: Tensor,
    *,
    num_byzantine: int,
    f: int,
    generator: torch.Generator,
    perturbation: str = "std",
    gamma_init: float = 10.0,
    tolerance: float = 1e-5,
) -> Tensor:
    """Min-max: mean + gamma p with max_i ||m - x_i|| <= max_ij ||x_i - x_j||."""
    _check(honest, num_byzantine)
    return _min_max_or_sum(
        honest,
        num_byzantine,
        use_sum=False,
        perturbation=perturbation,
        gamma_init=gamma_init,
        tolerance=tolerance,
    )


def min_sum(
    honest: Tensor,
    *,
    num_byzantine: int,
    f: int,
    generator: torch.Generator,
    perturbation: str = "std",
    gamma_init: float = 10.0,
    tolerance: float = 1e-5,
) -> Tensor:
    """Min-sum: mean + gamma p with sum_i ||m - x_i||^2 <= max_i sum_j ||x_i - x_j||^2."""
    _check(honest, num_byzantine)
    return _min_max_or_sum(
        honest,
        num_byzantine,
        use_sum=True,
        perturbation=perturbation,
        gamma_init=gamma_init,
        tolerance=tolerance,
    )


ATTACKS: dict[str, Callable[..., Tensor]] = {
    "sign_flip": sign_flip,
    "gaussian": gaussian,
    "scaling": scaling,
    "alie": alie,
    "ipm": ipm,
    "mimic": mimic,
    "min_max": min_max,
    "min_sum": min_sum,
    "none": no_attack,
}

_ALPHABET = string.ascii_lowercase + " "


def _random_text(length: int, generator: torch.Generator) -> str:
    codes = torch.randint(len(_ALPHABET), (max(1, length),), generator=generator)
    return "".join(_ALPHABET[int(c)] for c in codes)


def poison_records(
    records: list[dict[str, str]],
    *,
    kind: str = "label_flip",
    fraction: float = 1.0,
    generator: torch.Generator,
) -> list[dict[str, str]]:
    """Corrupt round(fraction * len(records)) outputs; returns new records, input untouched.

    "label_flip" gives a chosen record the output of another record with a different
    output (a wrong answer); "random_completion" a random string of the same length.

    >>> recs = [{"instruction": "2+2", "input": "", "output": "4"},
    ...         {"instruction": "3+3", "input": "", "output": "6"}]
    >>> [r["output"] for r in poison_records(recs, generator=torch.Generator().manual_seed(0))]
    ['6', '4']
    """
    if kind not in ("label_flip", "random_completion"):
        raise ValueError(f"unknown data attack {kind!r}; choose label_flip or random_completion")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    out = [dict(r) for r in records]
    count = round(fraction * len(records))
    chosen = torch.randperm(len(records), generator=generator)[:count].tolist()
    for i in chosen:
        original = records[i]["output"]
        if kind == "random_completion":
            text = _random_text(len(original), generator)
            while text == original:
                text = _random_text(len(original), generator)
            out[i]["output"] = text
            continue
        others = [j for j, r in enumerate(records) if r["output"] != original]
        if not others:
            raise ValueError("label_flip needs records with at least two different outputs")
        pick = others[int(torch.randint(len(others), (1,), generator=generator))]
        out[i]["output"] = records[pick]["output"]
    return out
