from collections.abc import Mapping

import torch
from torch import Tensor, nn
from torch.func import functional_call

from zoo_gym.compression import bitdelta
from zoo_gym.compression.distill import compressed_params, distill_scales, logit_loss
from zoo_gym.core.tiny import build_tiny_model

GROUP = 128


def logits(model: nn.Module, params: Mapping[str, Tensor], input_ids: Tensor) -> Tensor:
    return functional_call(model, dict(params), (input_ids,)).logits.float()


def logit_error(
    model: nn.Module,
    base: Mapping[str, Tensor],
    finetuned: Mapping[str, Tensor],
    signs: Mapping[str, Tensor],
    scales: Mapping[str, Tensor],
    groups: Mapping[str, int],
    input_ids: Tensor,
) -> float:
    """The BitDelta objective of `scales` on held-out ids: compressed vs fine-tuned logits."""
    with torch.no_grad():
        params = compressed_params(base, finetuned, signs, scales, groups)
        return float(
            logit_loss(logits(model, params, input_ids), logits(model, finetuned, input_ids))
        )


def test_distilled_scales_reduce_the_logit_error_of_the_tiny_model() -> None:
    torch.manual_seed(0)
    model = build_tiny_model(vocab_size=512, seed=0)
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    finetuned = dict(base)
    signs, scales, groups = {}, {}, {}
    for name, w in base.items():
        if w.dim() == 2 and "layers" in name:
            # a fine-tune whose magnitudes vary within each group: 1-bit with mean |delta| is off
            delta = (
                0.05 * torch.randn(w.shape, generator=gen) * torch.rand(w.shape[1], generator=gen)
            )
            finetuned[name] = w + delta
            groups[name] = GROUP
            _, scales[name] = bitdelta.pack(delta.reshape(-1), groups[name])
            signs[name] = torch.where(delta >= 0, 1.0, -1.0)
    calibration = torch.randint(0, 512, (32, 24), generator=gen)
    held_out = torch.randint(0, 512, (8, 24), generator=gen)

    fitted = distill_scales(
        model, base, finetuned, signs, scales, groups, calibration, steps=100, lr=3e-4
    )

    before = logit_error(model, base, finetuned, signs, scales, groups, held_out)
    after = logit_error(model, base, finetuned, signs, fitted, groups, held_out)
    # measured: 0.0263 -> 0.0235 (-10.5%) on held-out ids
    assert after < 0.92 * before, (before, after)
    assert all(fitted[n].shape == scales[n].shape for n in scales)
    assert torch.equal(model.state_dict()[next(iter(signs))], base[next(iter(signs))])
