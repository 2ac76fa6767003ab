"""First-order quality: q_i = grad U(0) . x_i, one backward pass for all n updates.

Taylor at the base: U(x) = U(0) + grad U(0) . x + O(||x||^2), so the first-order estimate of
update i's own quality U(x_i) - U(0) (what `individual` measures with one evaluation per
update) is g . x_i with g = grad U(0). With U = minus the validation loss L this is
-grad L(base) . x_i, the loss decrease a step along x_i would bring if the loss were linear
around the base; the same gradient dot product TracIn [Pruthi et al., 2020, "Estimating
Training Data Influence by Tracing Gradient Descent", NeurIPS] uses for a training step. It
costs one forward and backward pass of the validation loss at the base, whatever n, plus one
`(n, d)` by `(d,)` product; it misses curvature, so an update long enough to overshoot the
minimum along its direction is overrated.

`update_gradient` turns the gradient with respect to the base's weights into g in the
update's own coordinates:

- ``ffa_lora`` (the update is B `(out, r)`, merged as W + s B A with the round's frozen A
  `(r, in)` and s = alpha / r): dU/dB = s (dU/dW) A^T, one `(out, in)` by `(in, r)` product
  per module for all n updates, so g . B_i = (dU/dW) . (s B_i A) without forming any
  `(out, in)` delta. A carried B (``"<module>.lora_B_carry"``, the first round of an epoch
  of A) goes with the previous epoch's A the same way. A ``Conv1D`` weight stored `(in, out)`
  has its gradient transposed first.
- dense adapters (``lora``, ``dora``, ``qlora``, ``full``: the update is the weight delta in
  the weight's stored shape): g is dU/dW itself.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

import torch
from torch import Tensor

from zoo_gym.core.delta import Layout, numel
from zoo_gym.core.lora import LoraSpec, frozen_a, is_carry, module_of

from ._core import AggregateFn, Gradient, Quality, Utility, check_updates
from .rows import Updates, column_chunks, shape_of

log = logging.getLogger(__name__)

#: values of one float64 chunk of the rows `(n, chunk)` while scoring: memory bounded, not n x d
CHUNK_VALUES = 1 << 22


def first_order(
    updates: Updates,
    *,
    utility: Utility | None = None,
    aggregate_fn: AggregateFn | None = None,
    baseline: float | None = None,
    gradient: Gradient | None = None,
) -> Quality:
    """First-order quality of each update: q_i = g . x_i with g = grad U(0) `(d,)`.

    `updates` is (n, d); `gradient()` returns g in the same coordinates (see
    `update_gradient`), called once. `utility` and `aggregate_fn` are accepted for a uniform
    interface and not used; `baseline` is passed through to the result. Dot products are
    accumulated in float64 over column chunks of at most `CHUNK_VALUES` values.

    Cost: one backward pass (the gradient), no utility evaluation, no aggregation.
    """
    n, d = check_updates(updates, "first_order")
    if gradient is None:
        raise ValueError(
            "first_order needs gradient: grad U(0) in the update's coordinates, (d,), "
            "from one backward pass of the validation loss at the base"
        )
    g = gradient()
    if not isinstance(g, Tensor) or tuple(g.shape) != (d,) or not g.is_floating_point():
        shape = tuple(g.shape) if isinstance(g, Tensor) else type(g).__name__
        raise ValueError(
            f"first_order: gradient() must return a floating ({d},) tensor, got {shape}"
        )
    scores = row_dots(updates, g)
    if not all(math.isfinite(s) for s in scores):
        raise ValueError(
            "first_order: the gradient at the base is not finite; check the validation set "
            "and the base model before scoring updates"
        )
    log.debug("first-order quality of %d updates: 1 backward pass", n)
    return Quality(
        method="first_order",
        scores=scores,
        baseline=None if baseline is None else float(baseline),
        aggregate_utility=None,
        utility_calls=0,
        aggregations=0,
        backward_passes=1,
    )


def row_dots(updates: Updates, g: Tensor) -> tuple[float, ...]:
    """x_i . g for every row of `updates` `(n, d)` and `g` `(d,)`, accumulated in float64 over
    column chunks (of at most `CHUNK_VALUES` values of a tensor; within a source's budget);
    on the device of `updates`."""
    n, _ = shape_of(updates)
    g = g.to(device=updates.device, dtype=torch.float64)  # (d,)
    total = torch.zeros(n, dtype=torch.float64, device=updates.device)  # (n,)
    for start, chunk in column_chunks(updates, CHUNK_VALUES):
        total += chunk.double() @ g[start : start + chunk.shape[1]]
    return tuple(float(x) for x in total.cpu())


def update_gradient(
    weight_gradient: Mapping[str, Tensor],
    layout: Layout,
    *,
    adapter: str,
    spec: LoraSpec,
    seed: int,
    carry_seed: int | None = None,
) -> Tensor:
    """g = grad U(0) in the coordinates of an update with `layout`, float32 `(d,)`.

    `weight_gradient` maps a base weight's name to dU/dW in the weight's stored shape (for
    ``ffa_lora`` the ``"<module>.weight"`` of every module in the layout; for the dense
    adapters every name of the layout). ``ffa_lora``: each ``"<module>.lora_B"`` entry is
    s (dU/dW) A^T `(out, r)`, with A the round's frozen A for `seed`, and each
    ``"<module>.lora_B_carry"`` the same with the A of `carry_seed` (see the module
    docstring); dense adapters: dU/dW as it is. The result is on the gradients' device.
    """
    parts = []
    for entry in layout:
        if adapter == "ffa_lora":
            module = module_of(entry.name)
            grad = _weight_gradient(weight_gradient, module + ".weight", entry.name)
            grad = grad.T if module in spec.fan_in_fan_out else grad  # (out, in)
            a = frozen_a(
                _a_seed(entry.name, seed, carry_seed), module, int(grad.shape[1]), spec.rank
            )
            part = spec.scaling * (grad.float() @ a.to(grad.device).T)  # (out, r)
        else:
            part = _weight_gradient(weight_gradient, entry.name, entry.name).float()
        if tuple(part.shape) != entry.shape:
            raise ValueError(
                f"update_gradient: {entry.name} has shape {entry.shape} in the layout, but the "
                f"gradient of its weight gives {tuple(part.shape)}; the layout and the base differ"
            )
        parts.append(part.reshape(-1))
    g = torch.cat(parts) if parts else torch.zeros(0)  # (d,)
    assert g.numel() == numel(layout)
    return g


def _a_seed(key: str, seed: int, carry_seed: int | None) -> int:
    """The seed of the A that update entry `key` is merged with."""
    if not is_carry(key):
        return seed
    if carry_seed is None:
        raise ValueError(
            f"update_gradient: {key} is a carried B; pass carry_seed, the seed of the previous epoch's A"
        )
    return carry_seed


def _weight_gradient(weight_gradient: Mapping[str, Tensor], name: str, entry: str) -> Tensor:
    """dU/dW of weight `name`, or one ValueError naming the update entry that needs it."""
    grad = weight_gradient.get(name)
    if grad is None:
        raise ValueError(
            f"update_gradient: no gradient for {name}, which update entry {entry} changes; "
            "compute the gradient with respect to every weight the update touches"
        )
    if grad.dim() != 2 and name != entry:
        raise ValueError(f"update_gradient: {name} must be 2-D, got {tuple(grad.shape)}")
    return grad
