"""A mixed batch on the GPU (the Triton kernels in every hook) against merged models there."""

import json
from pathlib import Path

import pytest
import torch

from zoo_gym.compression import CodecSpec, decode, encode
from zoo_gym.core.hashing import sha256_bytes
from zoo_gym.core.tiny import build_tiny_model
from zoo_gym.serving.variants import RECORD_FORMAT, attach, load_variant, variant_files

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _write_variant(models: Path, version: str, seed: int) -> dict[str, torch.Tensor]:
    """A random BitDelta variant of v0000 as `gym-coordinator variant` writes it; returns the
    merged weights P + decode(variant)."""
    base = build_tiny_model(vocab_size=512).state_dict()
    gen = torch.Generator().manual_seed(seed)
    delta = {k: 0.02 * torch.randn(v.shape, generator=gen) for k, v in base.items()}
    payload = encode(delta, CodecSpec("bitdelta", group_size=128))
    envelope, record = variant_files(models, version, "v0000")
    envelope.parent.mkdir(parents=True, exist_ok=True)
    envelope.write_bytes(payload)
    fields = dict(version=version, parent="v0000", codec="bitdelta", group_size=128)
    fields |= dict(sha256=sha256_bytes(payload), size=len(payload), format=RECORD_FORMAT)
    record.write_text(json.dumps(fields))
    decoded = decode(payload, max_elements=10**8)
    return {k: v + decoded[k].view(v.shape) for k, v in base.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mixed_batch_on_cuda_gives_each_row_its_merged_models_logits(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    merged = {v: _write_variant(tmp_path, v, seed) for seed, v in enumerate(["v0001", "v0002"])}
    model = build_tiny_model(vocab_size=512).to("cuda", dtype).eval()
    variants = {v: load_variant(tmp_path, v, base="v0000", device="cuda") for v in merged}
    rows = [None, "v0002", "v0001", None, "v0001"]
    ids = torch.randint(4, 512, (len(rows), 12), generator=torch.Generator().manual_seed(7))
    mixed = attach(model)

    with torch.no_grad(), mixed.assign([None if r is None else variants[r] for r in rows]):
        logits = model(ids.cuda()).logits.float().cpu()

    reference = build_tiny_model(vocab_size=512).to("cuda", dtype).eval()
    base_state = {k: v.clone() for k, v in reference.state_dict().items()}
    tolerance = (
        {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 0.05, "atol": 0.05}
    )
    with torch.no_grad():
        for r, version in enumerate(rows):
            reference.load_state_dict(base_state if version is None else merged[version])
            expected = reference(ids[r : r + 1].cuda()).logits.float().cpu()
            torch.testing.assert_close(logits[r], expected[0], **tolerance)
    assert not torch.allclose(logits[1], logits[0], atol=1e-2)  # the variants do change logits
