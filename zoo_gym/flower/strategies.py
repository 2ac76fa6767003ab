"""zoo-gym's robust rules as Flower Message-API strategies, for any Flower ServerApp.

Each strategy is Flower's `FedAvg` (node sampling, train and evaluate configs, federated and
central evaluation, `start`, all unchanged) whose `aggregate_train` runs a rule of
`zoo_gym.aggregation` on the round's *updates*: each reply's arrays minus the arrays sent
this round (kept by `configure_train` as `current_arrays`). The updates of the n usable
replies go into one `(n, d)` float32 buffer; distances and sums are float64, as in every
zoo-gym rule. Flower's own Krum and Bulyan compute ||x||^2 + ||y||^2 - 2 x.y in float32 on the
full weights, which loses updates that are small next to the weights and can select an
attacker; these strategies do not. The new global arrays are the arrays sent plus the
aggregate, with the same keys, shapes and dtypes.

What each reply got is in `last_decisions`: `(node_id, Decision)` per reply, in reply order
(selected, weight, trimmed share, score, reason). A reply is left out, with a warning and a
decision saying why, when it is an error, carries no ArrayRecord under `arrayrecord_key`, has
keys or shapes other than the arrays sent, has no `weighted_by_key` metric, or holds a value
that is not finite. Fewer usable replies than the rule needs for its `num_malicious_nodes`
(`zoo_gym.aggregation.min_clients`) is a ValueError. Training metrics are aggregated as
FedAvg does (weighted by `weighted_by_key`) over the replies the rule selected.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any, ClassVar

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from numpy.typing import NDArray

from zoo_gym.aggregation import Aggregate, Decision, aggregate, min_clients

from .arrays import Sent, apply, mismatch, sent, subtract_into

log = logging.getLogger(__name__)


def _left_out(reason: str) -> Decision:
    return Decision(selected=False, weight=0.0, trimmed_share=1.0, score=None, reason=reason)


class RobustFedAvg(FedAvg):
    """Flower's FedAvg with a zoo-gym rule in `aggregate_train` (see the module docstring).

    Parameters
    ----------
    num_malicious_nodes : int (default: 0)
        f, the number of Byzantine replies per round the rule must tolerate. A round needs
        `zoo_gym.aggregation.min_clients(rule, f)` usable replies.
    nnm : bool (default: False)
        Nearest-neighbour mixing [Allouah et al., 2023] before the rule: each update is
        replaced by the mean of its n - f nearest updates.
    **fedavg
        Flower's FedAvg arguments, by keyword: `fraction_train`, `fraction_evaluate`,
        `min_train_nodes`, `min_evaluate_nodes`, `min_available_nodes`, `weighted_by_key`,
        `arrayrecord_key`, `configrecord_key`, `train_metrics_aggr_fn`,
        `evaluate_metrics_aggr_fn`.
    """

    rule: ClassVar[str]  # the name in zoo_gym.aggregation.RULES

    def __init__(self, *, num_malicious_nodes: int = 0, nnm: bool = False, **fedavg: Any) -> None:
        f = num_malicious_nodes
        if isinstance(f, bool) or not isinstance(f, int) or f < 0:
            raise ValueError(f"num_malicious_nodes must be an int >= 0, got {f!r}")
        super().__init__(**fedavg)
        self.num_malicious_nodes = num_malicious_nodes
        self.nnm = nnm
        self.current_arrays: ArrayRecord | None = None  # the arrays sent this round
        self.last_decisions: list[tuple[int, Decision]] = []

    def params(self, n: int) -> dict[str, Any]:
        """The rule's keyword parameters for a round of n usable replies."""
        return {}

    def malicious(self, n: int) -> int:
        """f for a round of n usable replies."""
        return self.num_malicious_nodes

    def settings(self) -> dict[str, Any]:
        """The rule's settings, for `summary`."""
        return {"num_malicious_nodes": self.num_malicious_nodes, "nnm": self.nnm} | self.params(0)

    def summary(self) -> None:
        """Log the rule's settings, then FedAvg's."""
        log.info("%s (zoo-gym %s): %s", type(self).__name__, self.rule, self.settings())
        super().summary()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """FedAvg's configure_train; the arrays sent are kept to form the updates."""
        self.current_arrays = arrays
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The arrays sent plus the rule's aggregate of the updates, and the selected replies'
        metrics aggregated as FedAvg does."""
        if self.current_arrays is None:
            raise ValueError(
                f"{type(self).__name__}.aggregate_train needs the arrays sent this round; "
                "call configure_train first (Strategy.start does) or set current_arrays"
            )
        replies = list(replies)
        layout = sent(self.current_arrays)
        reasons = [self._check(msg, layout) for msg in replies]
        buffer = np.empty((reasons.count(None), layout.d), dtype=np.float32)  # (n, d) updates
        kept = self._fill(buffer, replies, reasons, layout)
        for msg, why in zip(replies, reasons, strict=True):
            if why is not None:
                log.warning("aggregate_train: reply from node %d left out: %s", _node(msg), why)
        result = self._aggregate(torch.from_numpy(buffer[: len(kept)]), [replies[i] for i in kept])
        decided = dict(zip(kept, result.decisions, strict=True))
        self.last_decisions = [
            (_node(msg), decided[i] if i in decided else _left_out(str(reasons[i])))
            for i, msg in enumerate(replies)
        ]
        chosen = [replies[i].content for i in kept if decided[i].selected]
        log.info(
            "aggregate_train: %s selected %d of %d replies (%d left out before the rule)",
            type(self).__name__,
            len(chosen),
            len(replies),
            len(replies) - len(kept),
        )
        metrics = self.train_metrics_aggr_fn(chosen, self.weighted_by_key) if chosen else None
        return apply(layout, result.vector), metrics

    def weights(self, replies: list[Message]) -> torch.Tensor | None:
        """Per-reply weights for the rule, `(n,)`; None: the rule treats replies equally."""
        return None

    def _check(self, msg: Message, layout: Sent) -> str | None:
        """Why a reply cannot take part, or None."""
        if msg.has_error():
            return f"error reply: {msg.error.reason}"
        if self.arrayrecord_key not in msg.content.array_records:
            return f"no ArrayRecord under {self.arrayrecord_key!r}"
        why = mismatch(msg.content.array_records[self.arrayrecord_key], layout)
        if why is None and self._weight(msg) is None:
            why = f"no finite number {self.weighted_by_key!r} in its MetricRecord"
        return why

    def _weight(self, msg: Message) -> float | None:
        for record in msg.content.metric_records.values():
            value = record.get(self.weighted_by_key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                return float(value) if math.isfinite(value) else None
        return None

    def _fill(
        self,
        buffer: NDArray[np.float32],
        replies: list[Message],
        reasons: list[str | None],
        layout: Sent,
    ) -> list[int]:
        """Write each usable reply's update into the next row of `buffer`; a reply whose update
        is not finite is left out (its reason set). Returns the replies written, in order."""
        kept: list[int] = []
        for i, msg in enumerate(replies):
            if reasons[i] is not None:
                continue
            row = buffer[len(kept)]
            subtract_into(row, msg.content.array_records[self.arrayrecord_key], layout)
            if not np.isfinite(row).all():
                reasons[i] = "a value of its arrays, or of its update, is not finite"
                continue
            kept.append(i)
        return kept

    def _aggregate(self, updates: torch.Tensor, replies: list[Message]) -> Aggregate:
        """The rule over the `(n, d)` updates, or ValueError when n is too few for f."""
        n = updates.shape[0]
        f = self.malicious(n)
        need = min_clients(self.rule, f)
        if n < need:
            raise ValueError(
                f"{type(self).__name__} with num_malicious_nodes={f} needs at least {need} "
                f"usable replies, got {n}; sample more nodes (min_train_nodes, fraction_train) "
                "or lower num_malicious_nodes"
            )
        pre = "nnm" if self.nnm else None
        weights = self.weights(replies)
        return aggregate(self.rule, updates, f=f, weights=weights, pre=pre, **self.params(n))


def _node(msg: Message) -> int:
    return int(msg.metadata.src_node_id)


class Krum(RobustFedAvg):
    """Krum [Blanchard et al., 2017]: the global arrays move by the one update with the lowest
    score, score(i) = sum of squared distances from update i to its n - f - 2 nearest updates.

    In place of Flower's `Krum`, with the same `num_malicious_nodes` (f); distances are those
    of the updates, from a float64 Gram matrix. Needs n >= 2f + 3 replies. Other arguments:
    see `RobustFedAvg`.
    """

    rule = "krum"


class MultiKrum(RobustFedAvg):
    """Multi-Krum [Blanchard et al., 2017]: the mean of the m updates with the lowest Krum scores.

    In place of Flower's `MultiKrum`: `num_malicious_nodes` is f and `num_nodes_to_select` is
    m, by default n - f (Flower's default is 1, which is Krum). Needs n >= 2f + 3 replies.
    Other arguments: see `RobustFedAvg`.
    """

    rule = "multikrum"

    def __init__(self, *, num_nodes_to_select: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.num_nodes_to_select = num_nodes_to_select

    def params(self, n: int) -> dict[str, Any]:
        return {} if self.num_nodes_to_select is None else {"m": self.num_nodes_to_select}


class Bulyan(RobustFedAvg):
    """Bulyan [El Mhamdi et al., 2018]: recursive Krum chooses theta = n - 2f updates, then per
    coordinate the mean of the n - 4f chosen values closest to their median.

    In place of Flower's `Bulyan` (whose default selection is Flower's Multi-Krum), with the same
    `num_malicious_nodes` (f). Needs n >= 4f + 3 replies. Other arguments: see `RobustFedAvg`.
    """

    rule = "bulyan"


class TrimmedMean(RobustFedAvg):
    """Coordinate-wise trimmed mean [Yin et al., 2018]: per coordinate, the mean of the updates
    after dropping the f lowest and the f highest values.

    In place of Flower's `FedTrimmedAvg`. Give either `beta`, the fraction cut from each side
    as in Flower (f = int(beta * n) each round; beta in [0, 0.5)), or `num_malicious_nodes` (f,
    the same each round; needs n >= 2f + 1). Neither: beta = 0.2, Flower's default. Other
    arguments: see `RobustFedAvg`.
    """

    rule = "trimmed_mean"

    def __init__(
        self,
        *,
        beta: float | None = None,
        num_malicious_nodes: int | None = None,
        **kwargs: Any,
    ) -> None:
        if beta is not None and num_malicious_nodes is not None:
            raise ValueError(
                "TrimmedMean takes beta (a fraction of the replies) or num_malicious_nodes "
                "(a count), not both"
            )
        if num_malicious_nodes is None:
            beta = 0.2 if beta is None else beta
            if not 0.0 <= beta < 0.5:
                raise ValueError(f"beta must be in [0, 0.5), got {beta!r}")
        super().__init__(num_malicious_nodes=num_malicious_nodes or 0, **kwargs)
        self.beta = beta

    def malicious(self, n: int) -> int:
        return self.num_malicious_nodes if self.beta is None else int(self.beta * n)

    def settings(self) -> dict[str, Any]:
        return super().settings() if self.beta is None else {"beta": self.beta, "nnm": self.nnm}


class Median(RobustFedAvg):
    """Coordinate-wise median [Yin et al., 2018], in place of Flower's `FedMedian`.

    `num_malicious_nodes` (f) only sets the replies needed (n >= 2f + 1) and the neighbours
    of `nnm`. Other arguments: see `RobustFedAvg`.
    """

    rule = "median"


class GeometricMedian(RobustFedAvg):
    """Geometric median by smoothed Weiszfeld iterations, RFA [Pillutla, Kakade and
    Harchaoui, 2022]: argmin_z sum_i a_i ||z - x_i||.

    `iters`, `eps` (smoothing floor) and `tol` (relative improvement to stop at) as in
    `zoo_gym.aggregation.geometric_median`; `weighted=True` takes a_i from each reply's
    `weighted_by_key` metric (the number of examples, as RFA weights), else a_i = 1.
    Needs n >= 2f + 1 replies. Other arguments: see `RobustFedAvg`.
    """

    rule = "geometric_median"

    def __init__(
        self,
        *,
        iters: int = 100,
        eps: float = 1e-8,
        tol: float = 1e-7,
        weighted: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.iters, self.eps, self.tol, self.weighted = iters, eps, tol, weighted

    def params(self, n: int) -> dict[str, Any]:
        return {"iters": self.iters, "eps": self.eps, "tol": self.tol}

    def weights(self, replies: list[Message]) -> torch.Tensor | None:
        if not self.weighted:
            return None
        return torch.tensor([self._weight(msg) for msg in replies], dtype=torch.float64)


class CenteredClipping(RobustFedAvg):
    """Centered clipping [Karimireddy, He and Jaggi, 2021] around the arrays sent (a zero
    update): `iters` steps of v <- v + (1/n) sum_i (x_i - v) min(1, tau / ||x_i - v||).

    `tau`: the clipping radius, or None for the median distance to the centre at each step
    (see `zoo_gym.aggregation.centered_clipping`). Needs n >= 2f + 1 replies. Other
    arguments: see `RobustFedAvg`.
    """

    rule = "centered_clipping"

    def __init__(self, *, tau: float | None = None, iters: int = 5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tau, self.iters = tau, iters

    def params(self, n: int) -> dict[str, Any]:
        return {"tau": self.tau, "iters": self.iters}
