"""Create a coordinator home: config, signing key, first model version, optional TLS material."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from zoo_gym.coordinator.registry import ModelRegistry, Published
from zoo_gym.coordinator.tls import subject_alt_name, write_tls_material
from zoo_gym.core.identity import Identity
from zoo_gym.core.weights import weight_files

CONFIG = "coordinator.toml"


def _check_inputs(
    home: Path,
    *,
    tiny: bool,
    base_model: Path | None,
    validation: Path | None,
    tls_hosts: Sequence[str],
) -> None:
    """Refuse what `init_home` could not finish, before anything is written."""
    for host in tls_hosts:
        subject_alt_name(host)
    if (home / CONFIG).exists():
        raise FileExistsError(f"{home / CONFIG} exists; pick another --home or delete it")
    if not tiny and (base_model is None or validation is None):
        raise ValueError("pass --tiny, or both --base-model and --validation")
    if not tiny and base_model is not None:
        weight_files(base_model)  # one file or a consistent index of shards
    if (home / "tls").exists() and tls_hosts:
        raise FileExistsError(f"{home / 'tls'} exists; move the old TLS files away first")


def init_home(
    home: Path,
    *,
    tiny: bool,
    base_model: Path | None = None,
    validation: Path | None = None,
    listen: str = "127.0.0.1:7443",
    rest_listen: str = "127.0.0.1:8080",
    seed: int = 0,
    settings: str = "rounds = 0\nmin_clients = 2\n",
    training: str = 'steps = 30\nlearning_rate = 0.005\ncodec = "bitdelta"\n',
    tls_hosts: Sequence[str] = (),
) -> tuple[Path, Identity, Published]:
    """Write `home/coordinator.toml`, `home/coordinator.key` and models/v0000; returns them.

    `base_model` is a Hugging Face model directory whose weights are one `model.safetensors` or
    an index and its shards (`zoo_gym.core.weights`); v0000 keeps them as they are.

    With `tls_hosts`, also a CA and a server certificate for those names under `home/tls/`
    (see `zoo_gym.coordinator.tls`), and `tls_cert` / `tls_key` in the config.
    """
    _check_inputs(
        home, tiny=tiny, base_model=base_model, validation=validation, tls_hosts=tls_hosts
    )
    home.mkdir(parents=True, exist_ok=True)
    signer = Identity.generate()
    signer.save(home / "coordinator.key")
    if tiny:
        from zoo_gym.core.synthetic import make_examples, write_jsonl
        from zoo_gym.core.tiny import create_tiny_base

        create_tiny_base(home / "base", seed=seed)
        write_jsonl(make_examples(200, seed=seed + 10_000), home / "validation.jsonl")
        base_model, validation = home / "base", home / "validation.jsonl"
    assert base_model is not None and validation is not None
    published = ModelRegistry(home / "models", signer).import_base(base_model)
    # relative when inside the home, so a home can be moved or copied whole
    where = validation.resolve()
    if where.is_relative_to(home.resolve()):
        where = where.relative_to(home.resolve())
    tls = ""
    if tls_hosts:
        files = write_tls_material(home / "tls", tls_hosts)
        tls = (
            f'tls_cert = "{files.server_cert.relative_to(home)}"\n'
            f'tls_key = "{files.server_key.relative_to(home)}"\n'
        )
    (home / CONFIG).write_text(
        f'listen = "{listen}"\nrest_listen = "{rest_listen}"\n{tls}'
        f'validation_data = "{where}"\nseed = {seed}\n{settings}\n[training]\n{training}'
    )
    return home / CONFIG, signer, published
