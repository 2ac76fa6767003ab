"""Shared pieces of the aggregation rules: result types, checks and chunked float64 kernels.

Every rule takes the updates as one `(n, d)` tensor of deltas (any floating dtype, any
device) and returns an `Aggregate`: the `(d,)` float32 aggregate plus one `Decision` per
update, in input order. Sums run in float64. Work over `d` is done in column chunks whose
size is chosen from a byte budget, so the extra memory of a rule stays a small fraction of
the input (the `(d,)` output aside).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Aggregate", "Decision"]

_MIN_CHUNK_BYTES = 256 * 1024
_MAX_CHUNK_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class Decision:
    """What a rule did with one update.

    `selected`: the update contributed to the aggregate at all. `weight`: its mean weight in
    the aggregate over coordinates (weights of all updates sum to 1 for averaging rules).
    `trimmed_share`: share of coordinates in which it was left out (for clipping rules, the
    share of its length removed by clipping). `score`: the rule's score where it has one
    (Krum score, distance to the centre). `reason`: one short sentence for the ledger.
    """

    selected: bool
    weight: float
    trimmed_share: float
    score: float | None
    reason: str


@dataclass(frozen=True)
class Aggregate:
    """The aggregate `(d,)` float32 and one decision per update, in input order."""

    vector: Tensor  # (d,) float32
    decisions: tuple[Decision, ...]


def check_updates(updates: Tensor, rule: str) -> tuple[int, int]:
    """Return `(n, d)` of a floating `(n, d)` tensor with n >= 1, or raise ValueError."""
    if updates.dim() != 2:
        raise ValueError(
            f"{rule}: updates must be one (n, d) tensor, got shape {tuple(updates.shape)}; "
            "flatten each update and stack them"
        )
    if not updates.is_floating_point():
        raise ValueError(f"{rule}: updates must be floating point, got {updates.dtype}")
    n, d = updates.shape
    if n < 1 or d < 1:
        raise ValueError(f"{rule}: need at least one update of at least one coordinate")
    return int(n), int(d)


def check_f(f: int, rule: str) -> None:
    """Raise ValueError unless `f` is a non-negative int."""
    if isinstance(f, bool) or not isinstance(f, int) or f < 0:
        raise ValueError(f"{rule}: f (number of Byzantine updates) must be an int >= 0, got {f!r}")


def require(n: int, minimum: int, rule: str, condition: str) -> None:
    """Raise ValueError unless `n >= minimum`, naming the precondition."""
    if n < minimum:
        raise ValueError(
            f"{rule} needs {condition} (at least {minimum} updates), got {n}; "
            "collect more updates or lower f"
        )


def check_weights(weights: Tensor | None, n: int, rule: str) -> Tensor:
    """Return weights as a `(n,)` float64 CPU tensor normalised to sum 1 (uniform if None)."""
    if weights is None:
        return torch.full((n,), 1.0 / n, dtype=torch.float64)
    w = torch.as_tensor(weights).detach().to("cpu", torch.float64).reshape(-1)
    if w.numel() != n:
        raise ValueError(f"{rule}: got {w.numel()} weights for {n} updates; pass one per update")
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError(f"{rule}: weights must be finite and >= 0")
    total = float(w.sum())
    if total <= 0.0:
        raise ValueError(f"{rule}: weights sum to zero; give at least one update a positive weight")
    return w / total


def column_chunks(updates: Tensor, bytes_per_value: int) -> Iterator[tuple[int, int]]:
    """Yield `(start, stop)` column ranges so that a chunk of `n * width` values costs about
    `bytes_per_value` bytes each and the whole chunk stays within the working budget.

    The budget is 1% of the input, clamped to [256 KiB, 32 MiB].
    """
    n, d = updates.shape
    input_bytes = updates.numel() * updates.element_size()
    budget = min(max(input_bytes // 100, _MIN_CHUNK_BYTES), _MAX_CHUNK_BYTES)
    width = max(1, min(d, budget // max(1, n * bytes_per_value)))
    for start in range(0, d, width):
        yield start, min(d, start + width)


def gram(updates: Tensor) -> Tensor:
    """Gram matrix `(n, n)` float64 of the updates after removing their coordinate-wise mean.

    Distances do not change under a common shift; centring first keeps
    ||x_i||^2 + ||x_j||^2 - 2 x_i.x_j well conditioned even when all updates share a large
    common component (for example full weights instead of deltas).
    """
    n, _ = updates.shape
    g = torch.zeros((n, n), dtype=torch.float64, device=updates.device)
    for start, stop in column_chunks(updates, 16):
        x = updates[:, start:stop].to(torch.float64)  # (n, c)
        x -= x.mean(dim=0, keepdim=True)
        g.addmm_(x, x.T)
    return g


def squared_distances(updates: Tensor) -> Tensor:
    """Pairwise squared Euclidean distances `(n, n)` float64 from one Gram matrix."""
    g = gram(updates)
    sq = g.diagonal()
    dist = sq[:, None] + sq[None, :] - 2.0 * g
    dist = (0.5 * (dist + dist.T)).clamp_min_(0.0)  # exactly symmetric
    dist.fill_diagonal_(0.0)
    return dist


def weighted_sum(updates: Tensor, weights: Tensor) -> Tensor:
    """`sum_i weights[i] * updates[i]` as `(d,)` float32, accumulated in float64 per chunk."""
    _, d = updates.shape
    w = weights.to(updates.device, torch.float64)  # (n,)
    rows = torch.nonzero(w).flatten()  # skip zero weights without copying the updates
    w = w[rows]
    out = torch.empty(d, dtype=torch.float32, device=updates.device)
    for start, stop in column_chunks(updates, 8):
        out[start:stop] = w @ updates[rows, start:stop].to(torch.float64)
    return out


def distances_to(updates: Tensor, center: Tensor) -> Tensor:
    """Euclidean distances `(n,)` float64 from each update to `center` `(d,)`."""
    n, _ = updates.shape
    acc = torch.zeros(n, dtype=torch.float64, device=updates.device)
    for start, stop in column_chunks(updates, 8):
        diff = updates[:, start:stop].to(torch.float64) - center[start:stop].to(torch.float64)
        acc += diff.square().sum(dim=1)
    return acc.sqrt()


def row_norms(updates: Tensor) -> Tensor:
    """L2 norm `(n,)` float64 of each update."""
    n, _ = updates.shape
    acc = torch.zeros(n, dtype=torch.float64, device=updates.device)
    for start, stop in column_chunks(updates, 8):
        acc += updates[:, start:stop].to(torch.float64).square().sum(dim=1)
    return acc.sqrt()


def pct(share: float) -> str:
    """Format a share in [0, 1] as a whole percentage."""
    return f"{round(100 * share)}%"
