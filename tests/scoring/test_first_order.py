"""First-order quality: hand-computed scores, a finite-difference check through a real merge,
and the FFA-LoRA gradient path against the dense one for the same weight-space update."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from zoo_gym.core.delta import TensorSpec, flatten
from zoo_gym.core.lora import LoraSpec, carry_key, frozen_a, merge_ffa, update_key
from zoo_gym.scoring import (
    METHODS,
    first_order,
    individual,
    score_contributions,
    taylor,
    update_gradient,
)

W = torch.tensor([1.0, 2.0])
UPDATES = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]])  # w.x_i = 1, 2, -3


def quadratic(x: Tensor) -> float:
    """U(x) = w.x - 0.5 ||x||^2 + 0.5: grad U(0) = w."""
    return float(W @ x - 0.5 * x @ x) + 0.5


def test_first_order_is_the_gradient_dot_each_update() -> None:
    calls = []

    def gradient() -> Tensor:
        calls.append(1)
        return W.clone()

    q = first_order(UPDATES, gradient=gradient)

    assert q.method == "first_order"
    assert q.scores == (1.0, 2.0, -3.0)
    assert (q.utility_calls, q.aggregations, q.backward_passes) == (0, 0, 1)
    assert calls == [1]  # one backward pass for all n


def test_first_order_is_the_linear_part_of_individual() -> None:
    # individual: U(x_i) - U(0) = w.x_i - 0.5 ||x_i||^2 = 0.5, 1.5, -4.0
    exact = individual(UPDATES, utility=quadratic)
    estimate = first_order(UPDATES, gradient=lambda: W)

    assert exact.scores == (0.5, 1.5, -4.0)
    assert [e - 0.5 * float(x @ x) for e, x in zip(estimate.scores, UPDATES, strict=True)] == list(
        exact.scores
    )


def test_first_order_is_a_method_of_score_contributions() -> None:
    q = score_contributions(UPDATES, utility=quadratic, method="first_order", gradient=lambda: W)

    assert "first_order" in METHODS
    assert q.scores == (1.0, 2.0, -3.0)
    assert q.seconds > 0


def test_first_order_refuses_a_missing_or_misshapen_gradient() -> None:
    with pytest.raises(ValueError, match="first_order needs gradient"):
        first_order(UPDATES)
    with pytest.raises(ValueError, match=r"must return a floating \(2,\) tensor, got \(3,\)"):
        first_order(UPDATES, gradient=lambda: torch.ones(3))
    with pytest.raises(ValueError, match="gradient at the base is not finite"):
        first_order(UPDATES, gradient=lambda: torch.tensor([1.0, float("nan")]))


def test_chunked_dot_products_equal_one_product(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(0)
    updates = torch.randn(5, 37, generator=gen)
    g = torch.randn(37, generator=gen)
    monkeypatch.setattr(taylor, "CHUNK_VALUES", 12)  # 2 columns per chunk

    chunked = taylor.row_dots(updates, g)

    assert chunked == pytest.approx((updates.double() @ g.double()).tolist(), abs=1e-12)


# -- a real model: FFA-LoRA merge, autograd gradient, finite differences -------------------------

SPEC = LoraSpec(rank=3, alpha=6.0, target_modules=("proj",))
SEED = 11


class Tiny(nn.Module):
    """y = proj(tanh(x)) with a squared-error loss on fixed data."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(7, 5, bias=False)


def _data() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(32, 7, generator=gen), torch.randn(32, 5, generator=gen)


def _loss(model: Tiny) -> Tensor:
    x, y = _data()
    return ((model.proj(torch.tanh(x)) - y) ** 2).mean()


def _utility_gradient(model: Tiny) -> dict[str, Tensor]:
    """dU/dW with U = minus the loss, keyed by the state dict's weight name."""
    model.zero_grad()
    (-_loss(model)).backward()
    assert model.proj.weight.grad is not None
    return {"proj.weight": model.proj.weight.grad.clone()}


def test_first_order_matches_a_finite_difference_of_the_merged_model() -> None:
    # L(base + eps u) - L(base) ~ eps grad L . u, through merge_ffa of the real B update
    torch.manual_seed(0)
    model = Tiny()
    layout = (TensorSpec(update_key("proj"), (5, SPEC.rank)),)
    b = torch.randn(5, SPEC.rank, generator=torch.Generator().manual_seed(2))
    eps = 1e-3
    g = update_gradient(_utility_gradient(model), layout, adapter="ffa_lora", spec=SPEC, seed=SEED)
    base_loss = float(_loss(model).detach())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    merge_ffa(state, {update_key("proj"): eps * b}, spec=SPEC, seed=SEED)
    model.load_state_dict(state)

    estimate = first_order(flatten({update_key("proj"): eps * b}, layout)[None], gradient=lambda: g)
    measured = base_loss - float(_loss(model).detach())  # U(eps u) - U(0)

    assert abs(measured) > 1e-4  # the step moves the loss well above float32 noise
    assert estimate.scores[0] == pytest.approx(measured, rel=2e-2)


@pytest.mark.parametrize("fan_in_fan_out", [False, True])
def test_ffa_path_equals_dense_path_for_the_same_weight_update(fan_in_fan_out: bool) -> None:
    # g . B through (s grad_W A^T) equals grad_W . (s B A), the dense delta of the same B
    gen = torch.Generator().manual_seed(3)
    spec = LoraSpec(
        rank=3,
        alpha=6.0,
        target_modules=("proj",),
        fan_in_fan_out=frozenset({"proj"}) if fan_in_fan_out else frozenset(),
    )
    b = torch.randn(4, 5, 3, generator=gen)  # four updates, (out, r) each
    grad_w = torch.randn(5, 7, generator=gen)  # (out, in)
    stored_grad = grad_w.T.contiguous() if fan_in_fan_out else grad_w
    a = frozen_a(SEED, "proj", 7, 3)  # (r, in)
    dense = spec.scaling * b @ a  # (4, out, in)
    dense_stored = dense.transpose(1, 2) if fan_in_fan_out else dense
    ffa_layout = (TensorSpec(update_key("proj"), (5, 3)),)
    dense_layout = (TensorSpec("proj.weight", tuple(stored_grad.shape)),)

    g_ffa = update_gradient(
        {"proj.weight": stored_grad}, ffa_layout, adapter="ffa_lora", spec=spec, seed=SEED
    )
    g_dense = update_gradient(
        {"proj.weight": stored_grad}, dense_layout, adapter="lora", spec=spec, seed=SEED
    )
    via_b = first_order(b.reshape(4, -1), gradient=lambda: g_ffa).scores
    via_dense = first_order(dense_stored.reshape(4, -1), gradient=lambda: g_dense).scores

    assert g_ffa.shape == (15,) and g_dense.shape == (35,)
    assert via_b == pytest.approx(via_dense, rel=1e-5, abs=1e-6)
    hand = [float((grad_w * dense[i]).sum()) for i in range(4)]
    assert via_dense == pytest.approx(hand, rel=1e-5, abs=1e-6)


def test_update_gradient_names_the_missing_weight() -> None:
    layout = (TensorSpec(update_key("proj"), (5, 3)),)

    with pytest.raises(ValueError, match=r"no gradient for proj.weight, which update entry"):
        update_gradient({}, layout, adapter="ffa_lora", spec=SPEC, seed=SEED)
    with pytest.raises(ValueError, match=r"the layout and the base differ"):
        update_gradient(
            {"proj.weight": torch.zeros(6, 7)}, layout, adapter="ffa_lora", spec=SPEC, seed=SEED
        )


def test_a_carried_b_goes_with_the_previous_epochs_a() -> None:
    # W + s (B A_new + B_carry A_old): g . (B, B_carry) equals grad_W . the dense delta
    gen = torch.Generator().manual_seed(4)
    b, b_carry = torch.randn(5, 3, generator=gen), torch.randn(5, 3, generator=gen)
    grad_w = torch.randn(5, 7, generator=gen)
    layout = (
        TensorSpec(update_key("proj"), (5, 3)),
        TensorSpec(carry_key("proj"), (5, 3)),
    )
    dense = SPEC.scaling * (b @ frozen_a(SEED, "proj", 7, 3) + b_carry @ frozen_a(5, "proj", 7, 3))

    g = update_gradient(
        {"proj.weight": grad_w}, layout, adapter="ffa_lora", spec=SPEC, seed=SEED, carry_seed=5
    )
    [score] = first_order(
        torch.cat([b.reshape(-1), b_carry.reshape(-1)])[None], gradient=lambda: g
    ).scores

    assert score == pytest.approx(float((grad_w * dense).sum()), rel=1e-5)
    with pytest.raises(ValueError, match="is a carried B; pass carry_seed"):
        update_gradient({"proj.weight": grad_w}, layout, adapter="ffa_lora", spec=SPEC, seed=SEED)
