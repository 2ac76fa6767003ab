"""zoo-gym's robust aggregation rules as Flower Message-API strategies.

    from zoo_gym.flower import MultiKrum

    strategy = MultiKrum(num_malicious_nodes=2, nnm=True, fraction_evaluate=0.0)
    result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=3)
    strategy.last_decisions  # [(node_id, Decision(selected, weight, ..., reason)), ...]

Every strategy is Flower's `FedAvg` whose `aggregate_train` runs a `zoo_gym.aggregation`
rule on the round's updates (reply arrays minus the arrays sent); see `strategies`.
"""

from .strategies import (
    Bulyan,
    CenteredClipping,
    GeometricMedian,
    Krum,
    Median,
    MultiKrum,
    RobustFedAvg,
    TrimmedMean,
)

__all__ = [
    "Bulyan",
    "CenteredClipping",
    "GeometricMedian",
    "Krum",
    "Median",
    "MultiKrum",
    "RobustFedAvg",
    "TrimmedMean",
]
