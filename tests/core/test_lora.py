import math

import pytest
import torch

from zoo_gym.core.lora import (
    LoraSpec,
    carry_key,
    dense_delta,
    for_base,
    frozen_a,
    is_carry,
    merge_dense,
    merge_ffa,
    merge_update,
    module_of,
    target_weights,
    update_key,
    update_shapes,
)
from zoo_gym.core.tiny import build_tiny_model


def test_frozen_a_is_a_pure_function_of_seed_and_module() -> None:
    a = frozen_a(7, "model.layers.0.self_attn.q_proj", 64, 8)

    assert a.shape == (8, 64) and a.dtype == torch.float32
    assert torch.equal(a, frozen_a(7, "model.layers.0.self_attn.q_proj", 64, 8))
    assert not torch.equal(a, frozen_a(8, "model.layers.0.self_attn.q_proj", 64, 8))
    assert not torch.equal(a, frozen_a(7, "model.layers.0.self_attn.k_proj", 64, 8))


def test_frozen_a_is_pinned() -> None:
    # A must have the same bits on every machine and every release.
    a = frozen_a(0, "m", 4, 2)

    assert a[0].tolist() == [
        0.24119263887405396,
        -0.1959245800971985,
        -0.3961511254310608,
        -0.39659589529037476,
    ]
    assert a[1, 0].item() == 0.061565101146698


def test_frozen_a_has_peft_kaiming_scale() -> None:
    a = frozen_a(0, "x", 1024, 64)

    bound = 1 / math.sqrt(1024)
    assert float(a.abs().max()) <= bound
    assert float(a.std()) == pytest.approx(bound / math.sqrt(3), rel=0.02)


def test_dense_delta_by_hand() -> None:
    spec = LoraSpec(rank=2, alpha=4.0)
    b = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])  # (out=3, r=2)
    a = frozen_a(5, "m.q_proj", 4, 2)  # (r=2, in=4)

    dense = dense_delta({update_key("m.q_proj"): b}, spec=spec, seed=5, shapes={"m.q_proj": (3, 4)})

    assert list(dense) == ["m.q_proj.weight"]
    expected = 2.0 * torch.stack([a[0], 2 * a[1], a[0] + a[1]])
    torch.testing.assert_close(dense["m.q_proj.weight"], expected)


def test_dense_delta_rejects_bad_updates() -> None:
    spec = LoraSpec(rank=2)

    with pytest.raises(ValueError, match="expected"):
        dense_delta(
            {"m.q_proj.lora_B": torch.zeros(3, 4)}, spec=spec, seed=0, shapes={"m.q_proj": (3, 4)}
        )
    with pytest.raises(ValueError, match="not a target module"):
        dense_delta({"m.x.lora_B": torch.zeros(3, 2)}, spec=spec, seed=0, shapes={})
    with pytest.raises(ValueError, match="not an FFA-LoRA update key"):
        module_of("m.q_proj.weight")


def test_aggregation_of_b_is_exact() -> None:
    spec = LoraSpec(rank=2)
    shapes = {"m.q_proj": (3, 4)}
    bs = [torch.randn(3, 2, generator=torch.Generator().manual_seed(i)) for i in range(3)]

    of_mean = dense_delta({"m.q_proj.lora_B": sum(bs) / 3}, spec=spec, seed=1, shapes=shapes)
    denses = [dense_delta({"m.q_proj.lora_B": b}, spec=spec, seed=1, shapes=shapes) for b in bs]

    mean_of = sum(d["m.q_proj.weight"] for d in denses) / 3
    torch.testing.assert_close(of_mean["m.q_proj.weight"], mean_of)


def test_target_weights_of_tiny_model() -> None:
    model = build_tiny_model(vocab_size=100)

    targets = target_weights(model, LoraSpec())

    assert len(targets) == 2 * 7
    assert targets["model.layers.0.self_attn.q_proj"] == (64, 64)
    assert targets["model.layers.0.self_attn.k_proj"] == (32, 64)
    assert targets["model.layers.1.mlp.down_proj"] == (64, 128)
    assert target_weights(model.state_dict(), LoraSpec(target_modules=("v_proj",))) == {
        "model.layers.0.self_attn.v_proj": (32, 64),
        "model.layers.1.self_attn.v_proj": (32, 64),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_ffa_in_place_keeps_dtype(dtype: torch.dtype) -> None:
    spec = LoraSpec(rank=2, alpha=2.0)
    weight = torch.ones(3, 4, dtype=dtype)
    state = {"m.q_proj.weight": weight, "m.q_proj.bias": torch.zeros(3)}
    update = {"m.q_proj.lora_B": torch.full((3, 2), 0.5)}

    merge_ffa(state, update, spec=spec, seed=3)

    expected = 1 + 0.5 * frozen_a(3, "m.q_proj", 4, 2).sum(0).expand(3, 4)
    assert state["m.q_proj.weight"] is weight and weight.dtype == dtype
    torch.testing.assert_close(weight.float(), expected.to(dtype).float())
    assert torch.equal(state["m.q_proj.bias"], torch.zeros(3))


def test_merge_dense_adds_by_name_in_place() -> None:
    weight = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.bfloat16)
    bias = torch.tensor([0.5, -0.5])
    state = {"m.q_proj.weight": weight, "m.q_proj.bias": bias, "m.norm.weight": torch.ones(2)}

    merge_dense(
        state,
        {
            "m.q_proj.weight": torch.tensor([[0.5, -1.0], [0.0, 2.0]]),
            "m.q_proj.bias": torch.tensor([1.0, 1.0]),
        },
    )

    assert state["m.q_proj.weight"] is weight and weight.dtype == torch.bfloat16
    assert weight.float().tolist() == [[1.5, 1.0], [3.0, 6.0]]
    assert bias.tolist() == [1.5, 0.5]
    assert state["m.norm.weight"].tolist() == [1.0, 1.0]
    with pytest.raises(
        ValueError, match=r"m.k_proj.weight: the update's shape \(2, 2\) does not fit"
    ):
        merge_dense(state, {"m.k_proj.weight": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match=r"does not fit the base \(shape \(2, 2\)\)"):
        merge_dense(state, {"m.q_proj.weight": torch.zeros(2, 3)})


def test_merge_update_dispatches_on_the_adapter() -> None:
    spec = LoraSpec(rank=2, alpha=2.0)
    b = torch.full((3, 2), 0.5)
    dense = spec.scaling * b @ frozen_a(3, "m.q_proj", 4, 2)
    ffa_state = {"m.q_proj.weight": torch.zeros(3, 4)}
    lora_state = {"m.q_proj.weight": torch.zeros(3, 4)}

    merge_update(ffa_state, {"m.q_proj.lora_B": b}, adapter="ffa_lora", spec=spec, seed=3)
    merge_update(lora_state, {"m.q_proj.weight": dense}, adapter="lora", spec=spec, seed=3)

    torch.testing.assert_close(ffa_state["m.q_proj.weight"], lora_state["m.q_proj.weight"])


def test_update_shapes_per_adapter() -> None:
    spec = LoraSpec(rank=4, target_modules=("q_proj",))
    state = {
        "m.q_proj.weight": torch.zeros(8, 6),
        "m.q_proj.bias": torch.zeros(8),
        "m.k_proj.weight": torch.zeros(2, 6),
        "m.embed.weight": torch.zeros(10, 6),
        "m.position_ids": torch.zeros(5, dtype=torch.long),
    }

    assert update_shapes(state, adapter="ffa_lora", spec=spec) == {"m.q_proj.lora_B": (8, 4)}
    for adapter in ("lora", "dora", "qlora"):
        assert update_shapes(state, adapter=adapter, spec=spec) == {"m.q_proj.weight": (8, 6)}
    assert update_shapes(state, adapter="full", spec=spec) == {
        "m.q_proj.weight": (8, 6),
        "m.q_proj.bias": (8,),
        "m.k_proj.weight": (2, 6),
        "m.embed.weight": (10, 6),
    }


def test_the_first_round_of_an_epoch_of_a_adds_a_carried_b_per_module() -> None:
    spec = LoraSpec(rank=4, target_modules=("q_proj", "k_proj"))
    state = {"m.q_proj.weight": torch.zeros(8, 6), "m.k_proj.weight": torch.zeros(2, 6)}

    carrying = update_shapes(state, adapter="ffa_lora", spec=spec, carry=True)

    assert update_shapes(state, adapter="ffa_lora", spec=spec) == {
        "m.q_proj.lora_B": (8, 4),
        "m.k_proj.lora_B": (2, 4),
    }
    assert carrying == {
        "m.q_proj.lora_B": (8, 4),
        "m.q_proj.lora_B_carry": (8, 4),
        "m.k_proj.lora_B": (2, 4),
        "m.k_proj.lora_B_carry": (2, 4),
    }
    assert carry_key("m.q_proj") == "m.q_proj.lora_B_carry" and is_carry("m.q_proj.lora_B_carry")
    assert module_of("m.q_proj.lora_B_carry") == "m.q_proj" and not is_carry("m.q_proj.lora_B")
    with pytest.raises(ValueError, match="only ffa_lora updates carry"):
        update_shapes(state, adapter="lora", spec=spec, carry=True)


def test_a_carried_b_is_merged_with_the_previous_a() -> None:
    # W += s·(B·A_new + B_carry·A_old), A_new of seed 3 and A_old of seed 2, by hand
    spec = LoraSpec(rank=2, alpha=4.0)
    b = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])  # (out 3, r 2)
    back = torch.tensor([[0.0, 1.0], [-1.0, 0.0], [0.5, 0.0]])
    a_new, a_old = frozen_a(3, "m.q_proj", 4, 2), frozen_a(2, "m.q_proj", 4, 2)
    state = {"m.q_proj.weight": torch.ones(3, 4)}

    merge_update(
        state,
        {"m.q_proj.lora_B": b, "m.q_proj.lora_B_carry": back},
        adapter="ffa_lora",
        spec=spec,
        seed=3,
        carry_seed=2,
    )

    new_rows = torch.stack([a_new[0], 2 * a_new[1], a_new[0] + a_new[1]])
    old_rows = torch.stack([a_old[1], -a_old[0], 0.5 * a_old[0]])
    torch.testing.assert_close(state["m.q_proj.weight"], 1 + 2.0 * (new_rows + old_rows))
    with pytest.raises(ValueError, match="needs the seed of the previous epoch's A"):
        merge_ffa(state, {"m.q_proj.lora_B_carry": back}, spec=spec, seed=3)


def test_conv1d_weights_are_stored_in_out_and_merged_transposed() -> None:
    # Prepare: a Conv1D-style weight stored (in, out) = (4, 3), named in fan_in_fan_out
    spec = LoraSpec(
        rank=2, alpha=4.0, target_modules=("c_attn",), fan_in_fan_out=frozenset({"m.c_attn"})
    )
    state = {"m.c_attn.weight": torch.zeros(4, 3), "m.c_attn.bias": torch.zeros(3)}
    b = torch.arange(6, dtype=torch.float32).reshape(3, 2)  # (out, r)

    # Execute
    shapes = target_weights(state, spec)
    merge_ffa(state, {"m.c_attn.lora_B": b}, spec=spec, seed=5)

    # Assert: logical (out, in) shapes, B (out, r), dense deltas in the stored shape, and
    # W += (s * B @ A)^T as peft merges a fan_in_fan_out layer
    assert shapes == {"m.c_attn": (3, 4)}
    assert update_shapes(state, adapter="ffa_lora", spec=spec) == {"m.c_attn.lora_B": (3, 2)}
    assert update_shapes(state, adapter="lora", spec=spec) == {"m.c_attn.weight": (4, 3)}
    expected = (2.0 * b @ frozen_a(5, "m.c_attn", 4, 2)).T
    torch.testing.assert_close(state["m.c_attn.weight"], expected)
    dense = dense_delta({"m.c_attn.lora_B": b}, spec=spec, seed=5, shapes=shapes)
    torch.testing.assert_close(dense["m.c_attn.weight"], expected)


def test_for_base_fills_in_the_orientation_and_refuses_targets_that_match_nothing() -> None:
    linear = {"t.h.0.attn.c_attn": True, "t.h.0.mlp.c_fc": True, "lm_head": False}

    spec = for_base(LoraSpec(target_modules=("c_attn",)), linear, adapter="ffa_lora")

    assert spec.fan_in_fan_out == {"t.h.0.attn.c_attn", "t.h.0.mlp.c_fc"}
    assert for_base(LoraSpec(target_modules=("q_proj",)), linear, adapter="full").target_modules
    with pytest.raises(ValueError) as refused:
        for_base(LoraSpec(target_modules=("q_proj",)), linear, adapter="lora")
    assert str(refused.value) == (
        "none of the target modules (q_proj) is a linear layer of the base model; its linear "
        "layers are c_attn, c_fc, lm_head: name some of these in target_modules"
    )
