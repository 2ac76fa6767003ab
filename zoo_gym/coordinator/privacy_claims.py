"""What a submission's training metrics state about its privacy, read defensively.

The contributor computes these (`zoo_gym.client.privacy`); the coordinator records them and
cannot check them, so a value that cannot describe a mechanism is read as no claim.
"""

from __future__ import annotations

import math

from flwr.app import RecordDict

from zoo_gym import ledger
from zoo_gym.core.protocol import TRAIN_METRICS


def stated_mechanism(content: RecordDict) -> ledger.DpMechanism | None:
    """The DP-SGD mechanism a submission states in its metrics (`dp_noise_multiplier`,
    `dp_sample_rate`, `dp_steps`, `dp_delta`, `dp_accountant_prv`), or None when it ran none or
    the values cannot describe one (a sigma that is not positive, a rate outside (0, 1], ...)."""
    metrics = content.metric_records.get(TRAIN_METRICS)
    if metrics is None:
        return None
    values = [
        metrics.get(k) for k in ("dp_noise_multiplier", "dp_sample_rate", "dp_steps", "dp_delta")
    ]
    if not all(isinstance(v, int | float) and math.isfinite(v) for v in values):
        return None
    sigma, q, steps, delta = (float(v) for v in values)  # type: ignore[arg-type]
    if not (
        sigma > 0 and 0 < q <= 1 and steps.is_integer() and 1 <= steps <= 1e9 and 0 < delta < 1
    ):
        return None
    accountant = "prv" if metrics.get("dp_accountant_prv") == 1 else "rdp"
    return ledger.DpMechanism(sigma, q, int(steps), delta, accountant)


def claimed_epsilon(content: RecordDict) -> float | None:
    """The round's sample-level epsilon a submission reports (its `epsilon` metric), if finite and >= 0.

    The contributor computes it (`zoo_gym.client.privacy`); the coordinator records it, it cannot check it.
    """
    metrics = content.metric_records.get(TRAIN_METRICS)
    value = metrics.get("epsilon") if metrics is not None else None
    if isinstance(value, int | float) and math.isfinite(value) and value >= 0:
        return float(value)
    return None
