"""`device = "auto"`: CUDA when PyTorch sees it, else the CPU; a device the machine lacks is one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zoo_gym.client.config import ClientConfig, ClientConfigError, load_client_config
from zoo_gym.client.device import DeviceError, compute_dtype, describe_device, resolve_device
from zoo_gym.client.session import JoinError, join


def test_auto_is_the_default_and_picks_what_the_machine_has(tmp_path: Path) -> None:
    config = ClientConfig(home=tmp_path)

    assert config.device == "auto"
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto") == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_on_a_machine_without_it_is_refused_in_one_line() -> None:
    with pytest.raises(DeviceError) as caught:
        resolve_device("cuda:1")

    assert "PyTorch sees 0 CUDA device(s) here" in str(caught.value)
    assert 'set device = "auto"' in str(caught.value) and "\n" not in str(caught.value)


def test_a_name_torch_does_not_know_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "client.toml").write_text('device = "gpu0"\n')

    with pytest.raises(ClientConfigError) as caught:
        load_client_config(tmp_path / "client.toml")

    assert "device must be auto, cpu, cuda or cuda:N, not 'gpu0'" in str(caught.value)


def test_cpu_trains_in_float32_and_says_so() -> None:
    assert compute_dtype("cpu", "lora") == torch.float32
    assert compute_dtype("cpu", "full") == torch.float32
    assert describe_device("cpu") == f"cpu (float32, {torch.get_num_threads()} threads)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_join_stops_before_connecting_when_the_device_is_missing(tmp_path: Path) -> None:
    config = ClientConfig(home=tmp_path, coordinator="127.0.0.1:1", device="cuda")
    config = config.model_copy(update={"data": tmp_path / "data.jsonl"})

    with pytest.raises(JoinError, match="CUDA device"):
        join(config, say=lambda line: None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_uses_bfloat16_for_lora_where_supported() -> None:
    expected = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    assert compute_dtype("cuda", "lora") == expected
    assert compute_dtype("cuda", "full") == torch.float32
    assert describe_device("cuda").startswith("cuda (")
