"""Create a coordinator home: config, signing key, first model version."""

from __future__ import annotations

from pathlib import Path

from zoo_gym.coordinator.registry import ModelRegistry, Published
from zoo_gym.core.identity import Identity

CONFIG = "coordinator.toml"


def init_home(
    home: Path,
    *,
    tiny: bool,
    base_model: Path | None = None,
    validation: Path | None = None,
    listen: str = "127.0.0.1:7443",
    rest_listen: str = "127.0.0.1:8080",
    seed: int = 0,
    settings: str = 'rounds = 0\nmin_clients = 2\naggregator = "fedavg"\n',
    training: str = 'steps = 30\nlearning_rate = 0.005\ncodec = "bitdelta"\n',
) -> tuple[Path, Identity, Published]:
    """Write `home/coordinator.toml`, `home/coordinator.key` and models/v0000; returns them."""
    home.mkdir(parents=True, exist_ok=True)
    if (home / CONFIG).exists():
        raise FileExistsError(f"{home / CONFIG} exists; pick another --home or delete it")
    if not tiny and (base_model is None or validation is None):
        raise ValueError("pass --tiny, or both --base-model and --validation")
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
    (home / CONFIG).write_text(
        f'listen = "{listen}"\nrest_listen = "{rest_listen}"\n'
        f'validation_data = "{where}"\nseed = {seed}\n{settings}\n[training]\n{training}'
    )
    return home / CONFIG, signer, published
