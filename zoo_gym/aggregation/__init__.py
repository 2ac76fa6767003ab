"""Byzantine-robust aggregation of model updates: one module and one function per rule.

Every rule takes the updates as one `(n, d)` tensor of deltas and returns an `Aggregate`:
the `(d,)` float32 aggregate and one `Decision` per update (selected, weight, trimmed
share, score, reason), so the ledger can say why a contribution earned what it did.
Sums run in float64; distances come from one Gram matrix accumulated in float64 over
column chunks; coordinate-wise rules sort column chunks; no rule copies the `(n, d)`
input, and everything runs on the device the updates are on.

Column sources. A rule reads its updates only as column chunks `(n, c)` of all n updates
(or of the rows it selected), so it also accepts a column source (`columns.Columns`: `n`,
`d`, `dtype`, `device`, `budget`, `columns(start, stop, rows)`) instead of the tensor.
`TensorColumns` wraps a tensor (views; `budget=None` is exactly the tensor path);
`zoo_gym.compression.columns.PayloadColumns` decodes each chunk from compressed envelopes,
so memory is the source's `budget` plus O(n^2) and the `(d,)` output, whatever n x d is.
Passes over the updates: FedAvg, median and trimmed mean one; Krum, Multi-Krum and Bulyan
two (the Gram matrix, then the selected rows); NNM one for its Gram matrix, then it is a
source mixed chunk by chunk; geometric median one per step plus one; centered clipping
iters + 1. The rules that read their updates more than once read a source whose whole
`(n, d)` fits in half its budget only once (`columns.cached`). On CPU every pass shares
its column ranges among `torch.get_num_threads()` threads, each running single-threaded
kernels (no per-kernel barrier of all threads, which stalls a busy machine).
"""

from ._core import Aggregate, Decision, reads_sign_bits
from .bulyan import bulyan
from .centered_clipping import centered_clipping
from .clipping import clip_updates
from .columns import Columns, TensorColumns
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
    "Columns",
    "Decision",
    "TensorColumns",
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
    "reads_sign_bits",
    "trimmed_mean",
]
