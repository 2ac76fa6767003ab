"""Non-IID splits of labelled records across clients, the recipes of the federated literature.

A partition is first a `(clients, classes)` matrix of counts: how many records of each class
each client holds. Every client holds the same number of records, `size`:

- Dirichlet [Hsu et al., 2019, "Measuring the Effects of Non-Identical Data Distribution"]:
  client i's class proportions q_i ~ Dir(alpha * p), p the classes' prior; its counts are
  size * q_i rounded by largest remainder. alpha -> infinity gives q_i = p (IID), alpha -> 0
  one class per client.
- By label [McMahan et al., 2017, the pathological split]: the records sorted by class are
  cut into clients * K equal shards, and each client gets K shards drawn without
  replacement, so it holds at most K classes and every class is spread over as many shards
  as its prior share.

`split` then deals out the indices of a labelled pool by such a matrix: disjoint shards,
each class's records drawn in a seeded random order.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np


def largest_remainder(weights: Sequence[float], total: int) -> list[int]:
    """Non-negative integers proportional to `weights` that add up to `total` (Hamilton's method).

    >>> largest_remainder([0.5, 0.3, 0.2], 7)
    [4, 2, 1]
    """
    mass = float(sum(weights))
    if total < 0 or mass <= 0 or any(w < 0 for w in weights):
        raise ValueError(f"need total >= 0 and non-negative weights of positive sum, got {weights}")
    exact = [total * w / mass for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda k: counts[k] - exact[k])
    for k in by_remainder[: total - sum(counts)]:
        counts[k] += 1
    return counts


def dirichlet_counts(
    prior: Sequence[float], clients: int, size: int, *, alpha: float, seed: int
) -> list[list[int]]:
    """`(clients, classes)` counts, row i = size * q_i with q_i ~ Dir(alpha * prior) [Hsu et al.]."""
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    p = np.asarray(prior, dtype=np.float64) / float(sum(prior))
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(clients):
        # small alpha * p underflows to all zeros: the limit is one class, drawn by the prior
        q = rng.dirichlet(np.maximum(alpha * p, 1e-300))
        if not np.isfinite(q).all() or q.sum() <= 0:
            q = np.eye(len(p))[rng.choice(len(p), p=p)]
        rows.append(largest_remainder(q.tolist(), size))
    return rows


def label_counts(
    prior: Sequence[float], clients: int, size: int, *, classes_per_client: int, seed: int
) -> list[list[int]]:
    """`(clients, classes)` counts of the pathological split [McMahan et al., 2017]: K shards of
    size / K records per client, shards of one class each, as many per class as its prior share."""
    k = classes_per_client
    if not 1 <= k <= len(prior):
        raise ValueError(f"classes per client must lie in 1..{len(prior)}, got {k}")
    if size < k:
        raise ValueError(f"{k} classes per client need at least {k} records each, got {size}")
    shards = [c for c, n in enumerate(largest_remainder(prior, clients * k)) for _ in range(n)]
    random.Random(seed).shuffle(shards)
    widths = largest_remainder([1.0] * k, size)
    rows = []
    for i in range(clients):
        row = [0] * len(prior)
        for c, width in zip(shards[i * k : (i + 1) * k], widths, strict=True):
            row[c] += width
        rows.append(row)
    return rows


def split(labels: Sequence[int], counts: Sequence[Sequence[int]], *, seed: int) -> list[list[int]]:
    """Indices of `labels` dealt to clients by `counts` (clients, classes): disjoint shards,
    each client's indices in ascending order. The pool must hold enough records of each class."""
    by_class: dict[int, list[int]] = {}
    for i, label in enumerate(labels):
        by_class.setdefault(label, []).append(i)
    rng = random.Random(seed)
    for members in by_class.values():
        rng.shuffle(members)
    taken = dict.fromkeys(by_class, 0)
    shards = []
    for row in counts:
        shard: list[int] = []
        for c, n in enumerate(row):
            if n and taken.get(c, 0) + n > len(by_class.get(c, [])):
                raise ValueError(
                    f"the pool holds {len(by_class.get(c, []))} records of class {c}, "
                    f"the partition asks for more; draw a larger pool"
                )
            if n:
                shard.extend(by_class[c][taken[c] : taken[c] + n])
                taken[c] += n
        shards.append(sorted(shard))
    return shards
