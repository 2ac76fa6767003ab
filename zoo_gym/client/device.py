"""Where a contributor trains, and in which precision.

`device = "auto"` (the default) trains on the first CUDA device when PyTorch sees one, else on
the CPU. On CUDA the LoRA-family adapters run their frozen base in bfloat16 where the GPU
supports it (Ampere and later) and in float32 where it does not; `full` fine-tuning stays float32
so small updates are not rounded away. The CPU trains in float32.
"""

from __future__ import annotations

import torch

AUTO = "auto"


class DeviceError(ValueError):
    """The configured device is not one this machine has (one-line message)."""


def check_device_name(name: str) -> str:
    """`name` if it names a device PyTorch knows ("auto", "cpu", "cuda", "cuda:1", ...)."""
    if name == AUTO:
        return name
    try:
        torch.device(name)
    except RuntimeError:
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, not {name!r}") from None
    return name


def resolve_device(name: str) -> str:
    """The device `name` trains on on this machine: "auto" picks CUDA when present."""
    if name == AUTO:
        return "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise DeviceError(
                f"device = {name!r}, but PyTorch sees {count} CUDA device(s) here; "
                'set device = "auto" (or "cpu") in client.toml, or pass --device'
            )
    return name


def compute_dtype(device: str, adapter: str) -> torch.dtype:
    """The dtype the base model is loaded in for `adapter` on `device` (module docstring)."""
    if adapter == "full" or torch.device(device).type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32


def describe_device(device: str) -> str:
    """One line for the contributor: which device training uses, in which precision."""
    if torch.device(device).type == "cuda":
        name = torch.cuda.get_device_name(torch.device(device))
        base = "bfloat16" if compute_dtype(device, "lora") == torch.bfloat16 else "float32"
        return f"{device} ({name}; LoRA rounds on a {base} base, full rounds in float32)"
    return f"cpu (float32, {torch.get_num_threads()} threads)"
