"""Byzantine-robust aggregation of model updates: one module and one function per rule.

Every rule takes the updates as one `(n, d)` tensor of deltas and returns an `Aggregate`:
the `(d,)` float32 aggregate and one `Decision` per update (selected, weight, trimmed
share, score, reason), so the ledger can say why a contribution earned what it did.
Sums run in float64; distances come from one Gram matrix accumulated in float64 over
column chunks; coordinate-wise rules sort column chunks; no rule copies the `(n, d)`
input, and everything runs on the device the updates are on.
"""

from ._core import Aggregate, Decision
from .bulyan import bulyan
from .centered_clipping import centered_clipping
from .clipping import clip_updates
from .dispatch import PARAMS, RULES, WEIGHTED_RULES, aggregate, min_clients
from .fedavg import fedavg
from .geometric_median import geometric_median
from .krum import krum
from .median import median
from .nnm import nnm
from .trimmed_mean import trimmed_mean

__all__ = [
    "PARAMS",
    "RULES",
    "WEIGHTED_RULES",
    "Aggregate",
    "Decision",
    "aggregate",
    "bulyan",
    "centered_clipping",
    "clip_updates",
    "fedavg",
    "geometric_median",
    "krum",
    "median",
    "min_clients",
    "nnm",
    "trimmed_mean",
]
