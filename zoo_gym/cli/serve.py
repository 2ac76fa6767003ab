"""`gym-serve`: published versions and their variants over an OpenAI-compatible API."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from zoo_gym.cli.common import console, err_console, friendly, setup_logging

if TYPE_CHECKING:
    from zoo_gym.serving.server import ServeSettings

app = typer.Typer(
    help="Serve published versions over an OpenAI-compatible API.",
    no_args_is_help=True,
    add_completion=False,
)

ModelsOption = Annotated[
    Path, typer.Option(help="a coordinator's models root (<root>/<version>/, <root>/variants/)")
]
HostOption = Annotated[
    str, typer.Option(help="address to listen on; any but loopback needs an API key")
]
PortOption = Annotated[int, typer.Option(help="port to listen on", min=1, max=65535)]
KeyFileOption = Annotated[
    Path | None,
    typer.Option(help="file of accepted keys' SHA-256 digests, one hex digest a line"),
]
KeyOption = Annotated[
    str | None,
    typer.Option(help="an accepted key (visible to other local users; prefer ZOO_SERVE_API_KEY)"),
]
TlsCertOption = Annotated[
    Path | None,
    typer.Option(help="PEM certificate to serve HTTPS with (the coordinator's tls/server.pem)"),
]
TlsKeyOption = Annotated[
    Path | None, typer.Option(help="the certificate's PEM private key (tls/server.key)")
]
CoordinatorKeyOption = Annotated[
    str | None,
    typer.Option(
        metavar="HEX",
        help="the coordinator's public key: every version's signature and hashes are checked",
    ),
]
DeviceOption = Annotated[str, typer.Option(help="cpu, cuda or cuda:N")]
VersionOption = Annotated[
    list[str] | None, typer.Option("--version", help="serve only this version (repeatable)")
]
VariantsOption = Annotated[
    bool, typer.Option(help="also serve the variants of served versions (models/variants/)")
]
VariantMemoryOption = Annotated[
    int,
    typer.Option(
        help="MiB of variants kept loaded per served version (least recently used go)", min=1
    ),
]
MaxBatchOption = Annotated[int, typer.Option(help="rows decoded together", min=1)]
MaxPromptOption = Annotated[int, typer.Option(help="longest prompt in tokens", min=1)]
MaxNewOption = Annotated[int, typer.Option(help="most tokens one request may generate", min=1)]
MaxQueueOption = Annotated[int, typer.Option(help="requests that may wait; more get 429", min=0)]
BatchWaitOption = Annotated[
    float, typer.Option(help="an idle server waits this many ms to batch requests", min=0.0)
]
MaxBodyOption = Annotated[int, typer.Option(help="largest request body in bytes", min=1)]
ReadTimeoutOption = Annotated[
    float,
    typer.Option(
        help="seconds a client has to send a request's head (else the connection is closed) "
        "and again its body (else 408)",
        min=0.1,
        max=600.0,
    ),
]
MaxConnectionsOption = Annotated[
    int,
    typer.Option(
        help="open connections one client address (an IPv6 /64) may hold; another is answered "
        "503 and closed (behind a proxy every client is the proxy's address)",
        min=1,
    ),
]
VerboseOption = Annotated[bool, typer.Option("--verbose", "-v")]


@app.command()
@friendly
def serve(
    models: ModelsOption,
    host: HostOption = "127.0.0.1",
    port: PortOption = 8000,
    api_key_file: KeyFileOption = None,
    api_key: KeyOption = None,
    tls_cert: TlsCertOption = None,
    tls_key: TlsKeyOption = None,
    coordinator_key: CoordinatorKeyOption = None,
    device: DeviceOption = "cpu",
    version: VersionOption = None,
    variants: VariantsOption = True,
    variant_memory_mb: VariantMemoryOption = 2048,
    max_batch: MaxBatchOption = 8,
    max_prompt_tokens: MaxPromptOption = 2048,
    max_new_tokens: MaxNewOption = 512,
    max_queue: MaxQueueOption = 64,
    batch_wait_ms: BatchWaitOption = 0.0,
    max_body_bytes: MaxBodyOption = 1 << 20,
    read_timeout_s: ReadTimeoutOption = 30.0,
    max_connections_per_address: MaxConnectionsOption = 64,
    verbose: VerboseOption = False,
) -> None:
    """Serve every published version under --models (model ids are version names) until Ctrl-C.

    Clients use /v1/models, /v1/chat/completions and /v1/completions, as with OpenAI's API.
    """
    setup_logging(verbose)
    from zoo_gym.serving.engine import EngineLimits
    from zoo_gym.serving.server import ServeSettings

    settings = ServeSettings(
        models=models,
        host=host,
        port=port,
        api_key_file=api_key_file,
        api_key=api_key,
        tls_cert=tls_cert,
        tls_key=tls_key,
        coordinator_key=coordinator_key,
        device=device,
        versions=tuple(version or ()),
        variants=variants,
        variant_memory_mb=variant_memory_mb,
        limits=EngineLimits(
            max_batch=max_batch,
            max_prompt_tokens=max_prompt_tokens,
            max_new_tokens=max_new_tokens,
            max_queue=max_queue,
            batch_wait_s=batch_wait_ms / 1000,
        ),
        max_body_bytes=max_body_bytes,
        read_timeout_s=read_timeout_s,
        max_connections_per_address=max_connections_per_address,
    )
    _run(settings)


def _run(settings: ServeSettings) -> None:
    """Serve until interrupted; a setting that cannot serve is one line and exit status 1."""
    from zoo_gym.serving.engine_models import ServingError
    from zoo_gym.serving.server import serve as run_server

    try:
        run_server(settings, say=lambda line: console.print(line, markup=False, soft_wrap=True))
    except ServingError as exc:
        err_console.print(f"error: {exc}", markup=False, soft_wrap=True)
        raise typer.Exit(1) from None


def main() -> None:
    app()


if __name__ == "__main__":
    main()
