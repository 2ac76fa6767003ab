"""`gym-serve`'s process: settings checked, keys read, models loaded, the engine and uvicorn run.

A server without an API key answers anyone who reaches it, so it starts only on a loopback
address (127.0.0.1, ::1, localhost); anywhere else it needs keys (`--api-key-file`,
`--api-key` or the environment variable `ZOO_SERVE_API_KEY`). That is checked before any
model is loaded, so a wrong start costs nothing.

With `--tls-cert` and `--tls-key` (PEM; the coordinator's `tls/server.pem` and `server.key`
serve where the certificate names this host) it serves HTTPS; the pair is checked before any
model loads too. Without them, on an address that is not loopback, keys and prompts travel in
clear: the server says so at its start (a reverse proxy may add TLS in front of it). A renewed
certificate is served from the next start.

A client has `read_timeout_s` to send a request's head (else the connection is closed, as the
coordinator's REST API does: `transport.heads`) and again its body (else 408: `api_guard`), so
clients trickling bytes cannot hold the server's connections; and one address holds at most
`max_connections_per_address` of them (another is answered 503 and closed before it is read).
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn

from zoo_gym.serving.api import create_app
from zoo_gym.serving.api_guard import KeyCheck, key_digest, read_key_file
from zoo_gym.serving.engine import Engine, EngineLimits
from zoo_gym.serving.engine_models import ServingError, load_models
from zoo_gym.transport.client import is_loopback_host
from zoo_gym.transport.heads import guarded_h11

log = logging.getLogger(__name__)

KEY_VARIABLE = "ZOO_SERVE_API_KEY"
MAX_HEADER_BYTES = 16 * 1024


@dataclass(frozen=True)
class ServeSettings:
    models: Path
    host: str = "127.0.0.1"
    port: int = 8000
    api_key_file: Path | None = None
    api_key: str | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    coordinator_key: str | None = None  # hex Ed25519 public key that signed the versions
    device: str = "cpu"
    versions: tuple[str, ...] = ()  # every published version when empty
    variants: bool = True
    variant_memory_mb: int = 2048  # loaded variants per served version, LRU beyond it
    limits: EngineLimits = field(default_factory=EngineLimits)
    max_body_bytes: int = 1 << 20
    read_timeout_s: float = 30.0
    max_connections_per_address: int = 64


def key_check(settings: ServeSettings) -> KeyCheck:
    """The accepted key digests; ServingError for an unreadable key file, or for a server
    without keys on an address that is not loopback."""
    digests = []
    if settings.api_key_file is not None:
        try:
            text = settings.api_key_file.read_text()
        except OSError as exc:
            raise ServingError(f"--api-key-file {settings.api_key_file}: {exc.strerror}") from None
        try:
            digests += read_key_file(text, str(settings.api_key_file))
        except ValueError as exc:
            raise ServingError(str(exc)) from None
    key = settings.api_key or os.environ.get(KEY_VARIABLE)
    if key:
        digests.append(key_digest(key))
    if not digests and not is_loopback_host(settings.host):
        raise ServingError(
            f"no API key configured: anyone reaching {settings.host} could use the models; "
            f"give --api-key-file, --api-key or {KEY_VARIABLE}, or serve on 127.0.0.1"
        )
    if settings.api_key_file is not None and not digests:
        raise ServingError(f"--api-key-file {settings.api_key_file} lists no key digest")
    return KeyCheck(digests)


def check_tls(settings: ServeSettings) -> bool:
    """Whether the server serves HTTPS; ServingError where the certificate and key are not
    both given or do not load as a pair."""
    cert, key = settings.tls_cert, settings.tls_key
    if cert is None and key is None:
        if not is_loopback_host(settings.host):
            log.warning(
                "serving %s over plain HTTP: API keys and prompts travel in clear; give "
                "--tls-cert and --tls-key, or put TLS in front of it",
                settings.host,
            )
        return False
    if cert is None or key is None:
        raise ServingError("--tls-cert and --tls-key go together; give both (PEM files)")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ServingError(
            f"--tls-cert {cert} and --tls-key {key} cannot serve TLS ({_tls_reason(exc)}); "
            "give a PEM certificate and its own private key"
        ) from None
    return True


def _tls_reason(exc: OSError) -> str:
    """What was wrong with a certificate and key, in a few words."""
    if not isinstance(exc, ssl.SSLError):
        return exc.strerror or str(exc)
    if exc.reason == "KEY_VALUES_MISMATCH":
        return "the key is not the certificate's"
    return f"not a PEM certificate and key: {exc.reason or exc}"


def coordinator_key_bytes(hex_key: str | None) -> bytes | None:
    if hex_key is None:
        return None
    try:
        key = bytes.fromhex(hex_key)
    except ValueError:
        key = b""
    if len(key) != 32:
        raise ServingError(
            "--coordinator-key takes the coordinator's Ed25519 public key as 64 hex digits"
        )
    return key


def build_engine(settings: ServeSettings) -> Engine:
    models = load_models(
        settings.models,
        coordinator_key=coordinator_key_bytes(settings.coordinator_key),
        device=settings.device,
        only=settings.versions,
        variants=settings.variants,
        variant_memory=settings.variant_memory_mb << 20,
    )
    return Engine(models, settings.limits)


def serve(settings: ServeSettings, *, say: Callable[[str], None] = log.info) -> None:
    """Check the settings, load the models, and serve until interrupted (SIGINT / SIGTERM);
    `say` hears what is served where."""
    keys = key_check(settings)
    tls = check_tls(settings)
    engine = build_engine(settings)
    app = create_app(
        engine,
        keys,
        max_body_bytes=settings.max_body_bytes,
        read_timeout_s=settings.read_timeout_s,
    )
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        # h11 bounds the request line and headers (httptools does not), within a deadline,
        # and connections per address
        http=guarded_h11(settings.read_timeout_s, settings.max_connections_per_address),
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        ssl_certfile=str(settings.tls_cert) if tls else None,
        ssl_keyfile=str(settings.tls_key) if tls else None,
    )
    engine.start()
    access = "API key required" if keys.required else "no API key: loopback only"
    say(
        f"serving {', '.join(engine.models)} on "
        f"{'https' if tls else 'http'}://{settings.host}:{settings.port}/v1 "
        f"({access})"
    )
    try:
        uvicorn.Server(config).run()
    finally:
        engine.stop()
