"""Which certificate a TLS server on 127.0.0.1 presents (used by the TLS and deployment tests)."""

from __future__ import annotations

import hashlib
import socket
import ssl
from pathlib import Path


def served_sha256(port: int, ca: Path, *, host: str = "localhost", alpn: str | None = None) -> str:
    """SHA-256 of the certificate 127.0.0.1:`port` presents for `host`, checked against `ca`.
    An IP address as `host` sends no server name (SNI). gRPC servers need `alpn="h2"` to
    finish the handshake."""
    context = ssl.create_default_context(cafile=str(ca))
    if alpn:
        context.set_alpn_protocols([alpn])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=host) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return hashlib.sha256(der).hexdigest()


def file_sha256(path: Path) -> str:
    """SHA-256 of the PEM certificate at `path`, as `served_sha256` reports a served one."""
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(path.read_text())).hexdigest()
