"""The coordinate-wise kernels of `_select` against direct per-column references.

The references sort each column with `torch.sort` and read positions off it, so they share
nothing with the kernels but the definitions: the median of the two middles, the mean of
the values left after dropping f from each side, and per row the number of middle
positions it holds (or of values it lost), ties sharing the positions of their run.
"""

from __future__ import annotations

import pytest
import torch

from zoo_gym.aggregation._select import coordinatewise


def reference(x: torch.Tensor, kind: str, f: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Result `(d,)` and per-row counts `(n,)` float64 by sorting each column of `x`."""
    n, d = x.shape
    s = torch.sort(x.double(), dim=0).values  # (n, d)
    p, q = ((n - 1) // 2, n // 2 + 1) if kind == "median" else (f, n - f)
    if kind == "median":
        out = (0.5 * (s[p] + s[q - 1])).float()
    else:
        out = (s[p:q].sum(0) / (q - p)).float()
    rows = torch.zeros(n, dtype=torch.float64)
    for k in range(d):
        for value in torch.unique(x[:, k]):
            members = x[:, k] == value
            below, upto = int((s[:, k] < value).sum()), int((s[:, k] <= value).sum())
            inside = max(0, min(upto, q) - max(below, p)) / (upto - below)
            rows[members] += inside if kind == "median" else 1.0 - inside
    return out, rows


@pytest.mark.parametrize("kind", ["median", "trimmed"])
@pytest.mark.parametrize("n", [7, 8])
@pytest.mark.parametrize("threads", [1, 2])
def test_counts_survive_many_chunks(
    kind: str, n: int, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 3 columns per chunk and 2,000 columns: each thread tallies more than the 255 chunks
    # a byte-wide count holds between flushes, and row 0 (zero, with (n - 1) // 2 rows
    # below it and the rest above) is a middle value in every column, row 1 (-100) is
    # dropped in every column
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    x = torch.randn(n, 2_000, generator=torch.Generator().manual_seed(5)).abs() + 1.0
    x[1 : (n - 1) // 2 + 1] *= -1.0
    x[0], x[1] = 0.0, -100.0
    out, rows = coordinatewise(x, kind, 2, 3, engine="numpy")
    ref_out, ref_rows = reference(x, kind, 2)
    assert torch.equal(out, ref_out)
    assert torch.allclose(rows, ref_rows, rtol=0, atol=1e-9)
    assert float(rows[0 if kind == "median" else 1]) == 2_000  # past one byte


@pytest.mark.parametrize("kind", ["median", "trimmed"])
@pytest.mark.parametrize("n", [5, 6, 9])
def test_ties_at_the_cuts_share_their_positions(kind: str, n: int) -> None:
    # few distinct values: most columns tie at a cut, some do not; both kinds in one chunk
    g = torch.Generator().manual_seed(6)
    x = torch.randint(-2, 3, (n, 400), generator=g).float()
    x[:, ::5] = torch.randn(n, 80, generator=g)  # no ties in every fifth column
    out, rows = coordinatewise(x, kind, 1, 64, engine="numpy")
    ref_out, ref_rows = reference(x, kind, 1)
    assert torch.equal(out, ref_out)
    assert torch.allclose(rows, ref_rows, rtol=0, atol=1e-9)
    # every column hands out its middle positions (1 or 2), or drops 2f = 2 values, whole
    per_column = (1 if n % 2 else 2) if kind == "median" else 2
    assert float(rows.sum()) == pytest.approx(400 * per_column)


def test_hand_computed_column() -> None:
    # column 0: 4, 1, 3, 2 -> median 2.5 held by rows 2 (3) and 3 (2); column 1: 0, 0, 5, 0
    # -> median 0, the three zeros share positions 1 and 2 (2/3 each)
    x = torch.tensor([[4.0, 0.0], [1.0, 0.0], [3.0, 5.0], [2.0, 0.0]])
    out, rows = coordinatewise(x, "median", 0, 2, engine="numpy")
    assert out.tolist() == [2.5, 0.0]
    assert rows.tolist() == pytest.approx([2 / 3, 2 / 3, 1.0, 1.0 + 2 / 3])


def test_trimmed_mean_does_not_depend_on_the_chunk_width() -> None:
    # values over 80 binades, so that float64 sums round and their order would show
    g = torch.Generator().manual_seed(7)
    x = torch.randn(23, 500, generator=g) * 2.0 ** torch.randint(-40, 40, (23, 500), generator=g)
    results = [coordinatewise(x, "trimmed", 2, w, engine="numpy")[0] for w in (1, 7, 64, 500)]
    results.append(coordinatewise(x, "trimmed", 2, 64, engine="torch")[0])
    for other in results[1:]:
        assert torch.equal(results[0], other)
    ref_out, _ = reference(x, "trimmed", 2)
    assert torch.allclose(results[0], ref_out, rtol=1e-6, atol=0.0)
