"""`gym-coordinator`: set up and run a coordinator."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from zoo_gym.cli.common import console, friendly, setup_logging
from zoo_gym.coordinator.setup import CONFIG

app = typer.Typer(help="Run a zoo-gym coordinator.", no_args_is_help=True, add_completion=False)


@app.command()
@friendly
def init(
    home: Annotated[Path, typer.Option(help="directory for config, keys, models and the ledger")] = Path("coordinator"),
    tiny: Annotated[bool, typer.Option(help="create a tiny demo model, task and validation split")] = False,
    base_model: Annotated[Path | None, typer.Option(help="Hugging Face model directory to start from")] = None,
    validation: Annotated[Path | None, typer.Option(help="validation JSONL (Alpaca/ShareGPT)")] = None,
    listen: Annotated[str, typer.Option(help="gRPC address for contributors")] = "127.0.0.1:7443",
    rest_listen: Annotated[str, typer.Option(help="REST address for operators")] = "127.0.0.1:8080",
    seed: int = 0,
) -> None:
    """Write a config, an Ed25519 signing key and the first model version (v0000)."""
    from zoo_gym.coordinator.setup import init_home

    if not tiny and (base_model is None or validation is None):
        raise typer.BadParameter("pass --tiny, or both --base-model and --validation")
    config, signer, published = init_home(
        home, tiny=tiny, base_model=base_model, validation=validation, listen=listen,
        rest_listen=rest_listen, seed=seed,
    )
    console.print(f"coordinator home {home}: config {config}, base {published.version}")
    console.print(f"coordinator key (contributors pin it): {signer.public_key.hex()}")


@app.command()
@friendly
def serve(
    config: Annotated[Path, typer.Option("--config", "-c", help="coordinator.toml")] = Path("coordinator") / CONFIG,
    rounds: Annotated[int | None, typer.Option(help="override: rounds to run (0 = until stopped)")] = None,
    min_clients: Annotated[int | None, typer.Option(help="override: clients needed to start a round")] = None,
    aggregator: Annotated[str | None, typer.Option(help="override: aggregation rule")] = None,
    listen: Annotated[str | None, typer.Option(help="override: gRPC address")] = None,
    rest_listen: Annotated[str | None, typer.Option(help="override: REST address")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = True,
) -> None:
    """Serve contributors (gRPC) and operators (REST) and run rounds."""
    setup_logging(verbose)
    from zoo_gym.coordinator.config import CoordinatorConfig, load_config
    from zoo_gym.coordinator.service import Coordinator

    cfg = load_config(config)
    overrides = {k: v for k, v in {"rounds": rounds, "min_clients": min_clients, "aggregator": aggregator,
                                   "listen": listen, "rest_listen": rest_listen}.items() if v is not None}
    if overrides:
        cfg = CoordinatorConfig.model_validate({**cfg.model_dump(), **overrides})
    Coordinator(cfg).serve()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
