"""zoo_gym.flower's strategies: aggregate_train equals zoo-gym's rule on the same updates."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import strategy as flwr_strategy
from flwr.serverapp.strategy.multikrum import compute_distances, select_multikrum

from zoo_gym import flower
from zoo_gym.aggregation import (
    Aggregate,
    bulyan,
    centered_clipping,
    geometric_median,
    krum,
    median,
    nnm,
    trimmed_mean,
)
from zoo_gym.transport.flower_internals import set_task_identity

Arrays = dict[str, np.ndarray]


@pytest.fixture(autouse=True)
def _task_identity() -> None:
    set_task_identity(run_id=1, node_id=0, task_id=1)  # what Flower's runners set


def reply(node: int, arrays: Arrays, examples: int = 10) -> Message:
    """A train reply from `node`, as a ClientApp returns it."""
    sent = Message(
        RecordDict({"config": ConfigRecord({"server-round": 1})}),
        dst_node_id=node,
        message_type=MessageType.TRAIN,
    )
    content = RecordDict(
        {
            "arrays": ArrayRecord({k: Array(v.copy()) for k, v in arrays.items()}),
            "metrics": MetricRecord({"num-examples": examples, "loss": float(node)}),
        }
    )
    return Message(content, reply_to=sent)


def to_numpy(record: ArrayRecord) -> Arrays:
    return {k: a.numpy() for k, a in record.items()}


def bitwise_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# --- hand-computed -----------------------------------------------------------------------------


def test_median_of_three_replies_by_hand() -> None:
    # Prepare: global [1, 2]; updates [.5, 0], [-.5, .5], [99, -102] (the third an attacker)
    strategy = flower.Median()
    strategy.current_arrays = ArrayRecord({"w": Array(np.array([1.0, 2.0], np.float32))})
    replies = [
        reply(1, {"w": np.array([1.5, 2.0], np.float32)}),
        reply(2, {"w": np.array([0.5, 2.5], np.float32)}),
        reply(3, {"w": np.array([100.0, -100.0], np.float32)}),
    ]

    # Execute
    arrays, metrics = strategy.aggregate_train(1, replies)

    # Assert: the coordinate-wise median update [.5, 0] added to the global arrays
    assert arrays is not None and metrics is not None
    np.testing.assert_array_equal(arrays["w"].numpy(), np.array([1.5, 2.0], np.float32))
    # node 1 holds the median in both coordinates: the only one selected, so its metrics
    assert [(node, d.selected) for node, d in strategy.last_decisions] == [
        (1, True),
        (2, False),
        (3, False),
    ]
    assert metrics["loss"] == 1.0


# --- each strategy against its rule ------------------------------------------------------------

N = 9
Case = tuple[Callable[[], flower.RobustFedAvg], Callable[[torch.Tensor], Aggregate]]
CASES: dict[str, Case] = {
    "krum": (lambda: flower.Krum(num_malicious_nodes=2), lambda x: krum(x, f=2)),
    "multikrum": (
        lambda: flower.MultiKrum(num_malicious_nodes=2),
        lambda x: krum(x, f=2, m=N - 2),
    ),
    "multikrum-m3-nnm": (
        lambda: flower.MultiKrum(num_malicious_nodes=2, num_nodes_to_select=3, nnm=True),
        lambda x: krum(nnm(x, f=2), f=2, m=3),
    ),
    "bulyan": (lambda: flower.Bulyan(num_malicious_nodes=1), lambda x: bulyan(x, f=1)),
    "trimmed-beta": (
        lambda: flower.TrimmedMean(beta=0.25),  # int(0.25 * 9) = 2 from each side
        lambda x: trimmed_mean(x, f=2),
    ),
    "trimmed-f": (
        lambda: flower.TrimmedMean(num_malicious_nodes=3),
        lambda x: trimmed_mean(x, f=3),
    ),
    "median": (lambda: flower.Median(), median),
    "median-nnm": (
        lambda: flower.Median(num_malicious_nodes=2, nnm=True),
        lambda x: median(nnm(x, f=2)),
    ),
    "geometric-median-weighted": (
        lambda: flower.GeometricMedian(weighted=True, iters=50),
        lambda x: geometric_median(
            x, weights=torch.arange(1, N + 1, dtype=torch.float64), iters=50
        ),
    ),
    "centered-clipping": (
        lambda: flower.CenteredClipping(tau=0.5, iters=3),
        lambda x: centered_clipping(x, tau=0.5, iters=3),
    ),
}


def round_of(seed: int) -> tuple[Arrays, list[Arrays]]:
    """Global arrays of two keys and N replies: honest steps of scale 0.1, one of scale 30."""
    rng = np.random.default_rng(seed)
    base = {
        "layer.weight": rng.normal(size=(3, 4)).astype(np.float32),
        "layer.bias": rng.normal(size=5).astype(np.float32),
    }
    replies = []
    for i in range(N):
        scale = 30.0 if i == 4 else 0.1
        replies.append(
            {k: (v + scale * rng.normal(size=v.shape)).astype(np.float32) for k, v in base.items()}
        )
    return base, replies


@pytest.mark.parametrize("case", sorted(CASES))
def test_aggregate_train_equals_the_rule_on_the_same_updates(case: str) -> None:
    # Prepare
    make, rule = CASES[case]
    base, sent = round_of(seed=len(case))
    strategy = make()
    strategy.current_arrays = ArrayRecord({k: Array(v) for k, v in base.items()})
    replies = [reply(100 + i, arrays, examples=i + 1) for i, arrays in enumerate(sent)]
    x = torch.stack(
        [torch.cat([torch.from_numpy(r[k] - base[k]).reshape(-1) for k in base]) for r in sent]
    )  # (N, 17) float32 updates

    # Execute
    arrays, metrics = strategy.aggregate_train(1, replies)
    expected = rule(x)

    # Assert: global + the rule's aggregate, bit for bit, with keys, shapes and dtypes as sent
    assert arrays is not None and metrics is not None
    new = to_numpy(arrays)
    assert list(new) == list(base)
    flat = torch.cat([torch.from_numpy(base[k]).reshape(-1) for k in base]) + expected.vector
    assert bitwise_equal(new["layer.weight"], flat[:12].numpy().reshape(3, 4))
    assert bitwise_equal(new["layer.bias"], flat[12:].numpy())
    # one decision per reply, by node, the rule's own
    assert [node for node, _ in strategy.last_decisions] == [100 + i for i in range(N)]
    got = [(d.selected, d.weight, d.trimmed_share) for _, d in strategy.last_decisions]
    assert got == [(d.selected, d.weight, d.trimmed_share) for d in expected.decisions]
    # metrics: FedAvg's weighted mean over the selected replies
    chosen = [i for i, d in enumerate(expected.decisions) if d.selected]
    weights = np.array([i + 1 for i in chosen], dtype=np.float64)
    loss = np.sum(weights / weights.sum() * np.array([100.0 + i for i in chosen]))
    assert metrics["loss"] == pytest.approx(loss, rel=1e-12)


def test_krum_leaves_out_the_scaled_attacker() -> None:
    base, sent = round_of(seed=3)
    strategy = flower.MultiKrum(num_malicious_nodes=2)
    strategy.current_arrays = ArrayRecord({k: Array(v) for k, v in base.items()})

    strategy.aggregate_train(1, [reply(i, arrays) for i, arrays in enumerate(sent)])

    selected = [node for node, d in strategy.last_decisions if d.selected]
    assert 4 not in selected and len(selected) == N - 2


# --- arrays of other dtypes --------------------------------------------------------------------


def test_dtypes_are_kept_and_integer_arrays_take_the_rounded_sum() -> None:
    # Prepare: a float64 weight, a float16 one and an int64 counter; the median of the replies
    base = {
        "w64": np.array([1.0, -2.0], np.float64),
        "w16": np.array([0.5], np.float16),
        "steps": np.array([10], np.int64),
    }
    ups = [(0.25, 0.125, 3), (0.5, 0.25, 4), (-1.0, 1.0, 5)]
    replies = [
        reply(
            i,
            {
                "w64": base["w64"] + a,
                "w16": (base["w16"] + np.float16(b)).astype(np.float16),
                "steps": base["steps"] + c,
            },
        )
        for i, (a, b, c) in enumerate(ups)
    ]
    strategy = flower.Median()
    strategy.current_arrays = ArrayRecord({k: Array(v) for k, v in base.items()})

    # Execute
    arrays, _ = strategy.aggregate_train(1, replies)

    # Assert: medians 0.25, 0.25, 4 added in each array's own dtype
    assert arrays is not None
    new = to_numpy(arrays)
    assert bitwise_equal(new["w64"], np.array([1.25, -1.75], np.float64))
    assert bitwise_equal(new["w16"], np.array([0.75], np.float16))
    assert bitwise_equal(new["steps"], np.array([14], np.int64))


# --- replies that cannot take part -------------------------------------------------------------


def test_malformed_replies_are_left_out_with_a_reason() -> None:
    # Prepare: five good replies and five that cannot take part
    base = {"w": np.zeros(4, np.float32)}
    good = [reply(i, {"w": np.full(4, 0.1 * i, np.float32)}) for i in range(5)]
    nan = np.zeros(4, np.float32)
    nan[2] = np.nan
    sent = Message(RecordDict(), dst_node_id=9, message_type=MessageType.TRAIN)
    no_metric = reply(8, {"w": np.zeros(4, np.float32)})
    del no_metric.content.metric_records["metrics"]["num-examples"]
    bad = [
        reply(5, {"w": np.zeros(3, np.float32)}),
        reply(6, {"v": np.zeros(4, np.float32)}),
        reply(7, {"w": nan}),
        no_metric,
        Message(Error(code=1, reason="out of memory"), reply_to=sent),
    ]
    strategy = flower.Median(num_malicious_nodes=2)
    strategy.current_arrays = ArrayRecord({k: Array(v) for k, v in base.items()})

    # Execute
    arrays, _ = strategy.aggregate_train(1, good + bad)

    # Assert: the median of the good ones (0.2), and why each of the others was left out
    assert arrays is not None
    np.testing.assert_array_equal(arrays["w"].numpy(), np.full(4, 0.2, np.float32))
    assert [node for node, d in strategy.last_decisions if d.selected] == [2]
    reasons = {node: d.reason for node, d in strategy.last_decisions if node >= 5}
    assert reasons == {
        5: "array 'w' has shape (3,) where (4,) was sent",
        6: "its keys differ from the arrays sent (missing ['w'], unexpected ['v'])",
        7: "a value of its arrays, or of its update, is not finite",
        8: "no finite number 'num-examples' in its MetricRecord",
        9: "error reply: out of memory",
    }


def test_too_few_replies_for_f_is_one_line() -> None:
    base = {"w": np.zeros(2, np.float32)}
    strategy = flower.Bulyan(num_malicious_nodes=2)  # needs 4f + 3 = 11
    strategy.current_arrays = ArrayRecord({k: Array(v) for k, v in base.items()})
    replies = [reply(i, {"w": np.full(2, float(i), np.float32)}) for i in range(10)]

    with pytest.raises(ValueError) as info:
        strategy.aggregate_train(1, replies)

    assert str(info.value) == (
        "Bulyan with num_malicious_nodes=2 needs at least 11 usable replies, got 10; "
        "sample more nodes (min_train_nodes, fraction_train) or lower num_malicious_nodes"
    )


def test_aggregate_train_before_configure_train_is_one_line() -> None:
    with pytest.raises(ValueError, match="call configure_train first"):
        flower.Krum().aggregate_train(1, [])


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: flower.Krum(num_malicious_nodes=-1), "num_malicious_nodes must be an int >= 0"),
        (lambda: flower.TrimmedMean(beta=0.5), r"beta must be in \[0, 0.5\)"),
        (
            lambda: flower.TrimmedMean(beta=0.1, num_malicious_nodes=1),
            "beta .* or num_malicious_nodes .*, not both",
        ),
    ],
)
def test_bad_settings_are_one_line(make: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


# --- small updates: Flower's float32 distances select the attacker -----------------------------


def small_update_round() -> tuple[Arrays, list[Arrays]]:
    """LayerNorm-like gains of 1.0 (16 of them); six honest replies step down by 1 to 3 float32
    units in the last place of 1.0 below it (2^-19: 1.9e-6 to 5.7e-6), reply 0 steps up by 100
    (1.9e-4), 33 to 100 times farther than any honest step and against all of them. In float32,
    ||x||^2 + ||y||^2 - 2 x.y of these weights is exactly 0 for every pair (the squares of the
    steps are below half a unit of the sums, whatever the order of summation), so Flower's
    scores all tie at 0 and ties go to the first reply."""
    rng = np.random.default_rng(0)
    base = np.ones(16, np.float32)
    steps = -rng.integers(1, 4, size=(7, 16)).astype(np.float32)
    steps[0] = 100.0
    weights = base + steps * np.float32(2.0**-19)
    assert np.array_equal(weights - base, steps * np.float32(2.0**-19))  # exact in float32
    return {"ln.weight": base}, [{"ln.weight": w} for w in weights]


def test_flower_selects_the_attacker_on_small_updates_and_zoo_gym_does_not() -> None:
    # Prepare: n = 7, f = 1
    base, sent = small_update_round()
    records = [ArrayRecord({"ln.weight": Array(r["ln.weight"])}) for r in sent]
    assert not compute_distances(records).any()  # Flower's distances: all 0

    # Execute: Flower's Krum, Multi-Krum (m = n - f) and Bulyan's selection (theta = n - 2f),
    # zoo-gym's strategies on the same replies
    theirs_krum, _ = flwr_strategy.Krum(num_malicious_nodes=1).aggregate_train(
        1, [reply(i, r) for i, r in enumerate(sent)]
    )
    theirs_multi, _ = flwr_strategy.MultiKrum(
        num_malicious_nodes=1, num_nodes_to_select=6
    ).aggregate_train(1, [reply(i, r) for i, r in enumerate(sent)])
    contents = [reply(i, r).content for i, r in enumerate(sent)]
    theirs_bulyan = select_multikrum(contents, num_malicious_nodes=1, num_nodes_to_select=5)
    ours = {}
    for make in (flower.Krum, flower.MultiKrum, flower.Bulyan):
        strategy = make(num_malicious_nodes=1)
        strategy.current_arrays = ArrayRecord({"ln.weight": Array(base["ln.weight"])})
        arrays, _ = strategy.aggregate_train(1, [reply(i, r) for i, r in enumerate(sent)])
        assert arrays is not None
        ours[make.__name__] = (arrays["ln.weight"].numpy(), strategy.last_decisions)

    # Assert: Flower's Krum takes the attacker's weights, its Multi-Krum moves every gain up
    # (every honest step is down), its Bulyan selection includes the attacker
    assert theirs_krum is not None and theirs_multi is not None
    np.testing.assert_array_equal(theirs_krum["ln.weight"].numpy(), sent[0]["ln.weight"])
    assert (theirs_multi["ln.weight"].numpy() > 1.0).all()
    assert any(c is contents[0] for c in theirs_bulyan)
    # zoo-gym's select no attacker, and their gains move down, as every honest step does
    for name, (weights, decisions) in ours.items():
        assert not decisions[0][1].selected, name
        assert (weights < 1.0).all(), name


def test_summary_logs_the_rule_and_its_settings(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="zoo_gym.flower")

    flower.MultiKrum(num_malicious_nodes=2, num_nodes_to_select=5, nnm=True).summary()
    flower.TrimmedMean(beta=0.25).summary()

    lines = [r.getMessage() for r in caplog.records if r.name.startswith("zoo_gym.flower")]
    assert lines == [
        "MultiKrum (zoo-gym multikrum): {'num_malicious_nodes': 2, 'nnm': True, 'm': 5}",
        "TrimmedMean (zoo-gym trimmed_mean): {'beta': 0.25, 'nnm': False}",
    ]
