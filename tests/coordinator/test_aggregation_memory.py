"""`aggregation_memory`: a round whose decoded updates do not fit aggregates from the payloads.

The same round (same clients, data and seeds) runs twice: with the default budget (2 GiB: the
tiny model's updates are decoded into one (n, d) buffer, the sign-bit paths being off there)
and with 64 KiB, less than the three copies of the (n, d) float32 updates the in-memory path
needs, so the rule reads column chunks of the compressed payloads (`PayloadColumns`, their
sign bits), and so does scoring (each row decoded on its own for `individual`, coalitions as
views for `leave_one_out`, chunks for `first_order`). The published weights, every decision
and every reward recorded in the ledger must be the same.

With the sign-bit paths on (the default), a BitDelta round takes the payload path on the CPU
whatever the budget: the rules read the sign bits faster than the updates decode. A round of
another codec is decoded into memory where it fits.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from sqlmodel import Session

from zoo_gym import ledger
from zoo_gym.aggregation import _signs
from zoo_gym.core.synthetic import make_examples
from zoo_gym.core.weights import load_weights
from zoo_gym.simulation.inprocess import InProcessFederation

SMALL = 1 << 16  # bytes: 6 updates of 8,192 float32 values take 192 KiB; three copies 576 KiB


def one_round(
    home: Path, rule: str, f: int, memory: int | None, scoring: str, codec: str = "bitdelta"
) -> tuple[dict, list, list]:
    """Published weights, the ledger's (decision, weight) and (quality, amount) of one round,
    each sorted (contributor ids differ between homes)."""
    overrides: dict[str, object] = {
        "rounds": 1,
        "min_clients": 6,
        "aggregator": rule,
        "byzantine_f": f,
        "quality_gate_tolerance": 100.0,
        "rewards": {"method": scoring},
        "training": {"steps": 3, "codec": codec},
    }
    if memory is not None:
        overrides["aggregation_memory"] = memory
    shards = [make_examples(16, seed=10 + i) for i in range(6)]
    fed = InProcessFederation.build(home, shards, overrides=overrides, byzantine=[5], attack="ipm")
    (summary,) = fed.run()
    assert summary.status == "published", summary
    with Session(fed.coordinator.engine) as session:
        rows = sorted(
            (s.decision, s.weight) for s in ledger.list_submissions(session, round_number=1)
        )
        paid = sorted(
            (round(r.quality or 0.0, 5), r.amount)
            for r in ledger.list_rewards(session, round_number=1)
        )
    weights = load_weights(fed.coordinator.registry.directory(summary.published_version))
    return weights, rows, paid


@pytest.mark.parametrize(
    ("rule", "f", "scoring"),
    [
        ("median", 1, "individual"),
        ("multikrum", 1, "leave_one_out"),
        ("trimmed_mean", 1, "first_order"),
        ("geometric_median", 1, "individual"),
    ],
)
def test_a_round_over_the_budget_publishes_and_pays_what_the_in_memory_round_does(
    tiny_home: Path,
    tmp_path: Path,
    rule: str,
    f: int,
    scoring: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Prepare: two copies of one coordinator home, so both rounds start from the same state
    other = tmp_path / "other"
    shutil.copytree(tiny_home, other)
    caplog.set_level(logging.INFO, logger="zoo_gym.core.phases")

    # Execute: the first round decodes in memory (the sign-bit paths off), the second reads
    # the payloads
    previous = _signs.use_sign_structure(False)
    try:
        in_memory, decided, paid = one_round(tiny_home, rule, f, None, scoring)
    finally:
        _signs.use_sign_structure(previous)
    decoded = [r.getMessage() for r in caplog.records]
    streamed, decided_streamed, paid_streamed = one_round(other, rule, f, SMALL, scoring)

    # Assert: same decisions, same rewards, same published weights
    # the geometric median's weights come from distances of float32 Gram products, which
    # chunks of other widths round differently (1e-7 relative); the other rules' are exact
    rel = 1e-6 if rule == "geometric_median" else 1e-12
    assert [d for d, _ in decided] == [d for d, _ in decided_streamed]
    assert [w for _, w in decided] == pytest.approx([w for _, w in decided_streamed], rel=rel)
    assert paid == paid_streamed and len(paid) == 6
    assert set(in_memory) == set(streamed)
    for name, tensor in in_memory.items():
        torch.testing.assert_close(streamed[name], tensor, rtol=1e-5, atol=1e-7, msg=name)
    assert any("decoded in memory" in m for m in decoded)
    assert not any("payload columns" in m for m in decoded)
    assert any("payload columns" in r.getMessage() for r in caplog.records[len(decoded) :])


@pytest.mark.parametrize(("codec", "path"), [("bitdelta", "payload columns"), ("int8", "decoded")])
def test_within_the_budget_only_a_bitdelta_round_stays_compressed(
    tiny_home: Path, caplog: pytest.LogCaptureFixture, codec: str, path: str
) -> None:
    # Prepare
    caplog.set_level(logging.INFO, logger="zoo_gym.core.phases")

    # Execute: the default budget, which three decoded copies of the round fit
    _, decided, paid = one_round(tiny_home, "multikrum", 1, None, "individual", codec)

    # Assert: BitDelta's sign bits read from the payloads, int8 decoded into memory (no faster
    # path reads its values), and a round decided and paid in full either way
    messages = [r.getMessage() for r in caplog.records]
    other = "decoded in memory" if path == "payload columns" else "payload columns"
    assert any(path in m for m in messages)
    assert not any(other in m for m in messages)
    assert len(decided) == 6 and len(paid) == 6
