"""TLS material from `zoo_gym.coordinator.tls`: what the certificates say, and that gRPC
(BoringSSL) and Python's ssl (uvicorn, httpx) really accept them."""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import socket
import ssl
import stat
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID
from tls_probe import file_sha256, served_sha256

from zoo_gym.coordinator.tls import (
    CertificateWatcher,
    TlsError,
    TlsFiles,
    certificate_hosts,
    create_ca,
    expiry_warning,
    follow_in_ssl_context,
    issue_server_certificate,
    load_certificate,
    read_served_pair,
    renew_server_certificate,
    write_tls_material,
)

HOSTS = ("localhost", "127.0.0.1", "coordinator.example.org")
ECHO = "/zoo_gym.test.Echo/Call"


@pytest.fixture(scope="module")
def material(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tls") / "tls"
    write_tls_material(directory, HOSTS)
    return directory


def test_files_and_permissions(material: Path) -> None:
    # Assert: four PEM files; both private keys readable by the owner only
    assert sorted(p.name for p in material.iterdir()) == [
        "ca.key",
        "ca.pem",
        "server.key",
        "server.pem",
    ]
    for key in ("ca.key", "server.key"):
        assert stat.S_IMODE((material / key).stat().st_mode) == 0o600
        private = serialization.load_pem_private_key((material / key).read_bytes(), None)
        assert isinstance(private, ec.EllipticCurvePrivateKey)
        assert private.curve.name == "secp256r1"


def test_ca_certificate(material: Path) -> None:
    ca = load_certificate(material / "ca.pem")

    constraints = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    usage = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert constraints.critical and constraints.value.ca and constraints.value.path_length == 0
    assert usage.key_cert_sign and usage.crl_sign
    ca.verify_directly_issued_by(ca)  # self-signed
    lifetime = ca.not_valid_after_utc - ca.not_valid_before_utc
    assert dt.timedelta(days=3650) <= lifetime <= dt.timedelta(days=3650, minutes=5)


def test_server_certificate(material: Path) -> None:
    ca = load_certificate(material / "ca.pem")
    server = load_certificate(material / "server.pem")

    server.verify_directly_issued_by(ca)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost", "coordinator.example.org"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert not server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    eku = server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    lifetime = server.not_valid_after_utc - server.not_valid_before_utc
    assert dt.timedelta(days=825) <= lifetime <= dt.timedelta(days=825, minutes=5)


def test_fingerprint_is_sha256_of_der(material: Path) -> None:
    from zoo_gym.coordinator.tls import fingerprint

    ca = load_certificate(material / "ca.pem")
    der = ca.public_bytes(serialization.Encoding.DER)

    expected = hashlib.sha256(der).hexdigest().upper()
    assert fingerprint(ca).replace(":", "") == expected
    assert len(fingerprint(ca).split(":")) == 32


def test_server_certificate_ends_with_its_ca() -> None:
    # Prepare: a CA with one day left
    now = dt.datetime.now(dt.UTC)
    ca_key, ca = create_ca(days=1, now=now)

    _, server = issue_server_certificate(ca_key, ca, ["localhost"], now=now)

    assert server.not_valid_after_utc == ca.not_valid_after_utc


@pytest.mark.parametrize("host", ["a b", "", "-bad.example", "x" * 64 + ".org", "under_score.org"])
def test_bad_host_names_refused(host: str, tmp_path: Path) -> None:
    with pytest.raises(TlsError, match="neither an IP address nor a DNS name"):
        write_tls_material(tmp_path / "tls", [host])
    assert not (tmp_path / "tls").exists()


def test_no_host_refused() -> None:
    ca_key, ca = create_ca()
    with pytest.raises(TlsError, match="at least one --host"):
        issue_server_certificate(ca_key, ca, [])


def test_never_overwrites(material: Path) -> None:
    before = (material / "ca.pem").read_bytes()
    with pytest.raises(TlsError, match="exists; move the old TLS files away"):
        write_tls_material(material, ["localhost"])
    assert (material / "ca.pem").read_bytes() == before


def test_mismatched_key_refused(material: Path, tmp_path: Path) -> None:
    other = write_tls_material(tmp_path / "other", ["localhost"])

    with pytest.raises(TlsError, match="is not the private key of"):
        read_served_pair(material / "server.pem", other.server_key)
    with pytest.raises(TlsError, match="is not a PEM certificate"):
        read_served_pair(material / "server.key", material / "server.key")
    read_served_pair(material / "server.pem", material / "server.key")  # the pair is fine


def test_expired_certificate_refused(tmp_path: Path) -> None:
    # Prepare: a certificate that ended yesterday
    past = dt.datetime.now(dt.UTC) - dt.timedelta(days=3)
    ca_key, ca = create_ca(now=past)
    key, cert = issue_server_certificate(ca_key, ca, ["localhost"], days=1, now=past)
    (tmp_path / "s.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "s.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )

    with pytest.raises(TlsError, match="expired on"):
        read_served_pair(tmp_path / "s.pem", tmp_path / "s.key")


# --- the certificates in real TLS stacks ---------------------------------------------------------


@pytest.fixture(scope="module")
def grpc_port(material: Path) -> Iterator[int]:
    """A gRPC server (BoringSSL) on 127.0.0.1 serving one echo method with `material`."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: b"echo:" + request)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("zoo_gym.test.Echo", {"Call": handler}),)
    )
    creds = grpc.ssl_server_credentials(
        [((material / "server.key").read_bytes(), (material / "server.pem").read_bytes())]
    )
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    yield port
    server.stop(0).wait()


def _echo(target: str, roots: bytes, *, override: str | None = None) -> bytes:
    options = [("grpc.ssl_target_name_override", override)] if override else []
    with grpc.secure_channel(target, grpc.ssl_channel_credentials(roots), options=options) as ch:
        call = ch.unary_unary(ECHO)
        reply: bytes = call(b"hi", timeout=10)
        return reply


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1"])
def test_grpc_accepts_the_certificate(material: Path, grpc_port: int, host: str) -> None:
    assert _echo(f"{host}:{grpc_port}", (material / "ca.pem").read_bytes()) == b"echo:hi"


def test_grpc_refuses_another_ca(grpc_port: int, tmp_path: Path) -> None:
    stranger = write_tls_material(tmp_path / "stranger", ["localhost"])

    with pytest.raises(grpc.RpcError) as err:
        _echo(f"localhost:{grpc_port}", stranger.ca_cert.read_bytes())
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_grpc_refuses_a_name_not_in_the_certificate(material: Path, grpc_port: int) -> None:
    with pytest.raises(grpc.RpcError) as err:
        _echo(
            f"127.0.0.1:{grpc_port}",
            (material / "ca.pem").read_bytes(),
            override="evil.example.org",
        )
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_python_ssl_accepts_the_certificate(material: Path) -> None:
    """What uvicorn serves and httpx / `gym-client rewards` checks: Python's ssl (OpenSSL)."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(material / "server.pem", material / "server.key")
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve_one() -> None:
        conn, _ = listener.accept()
        with server_ctx.wrap_socket(conn, server_side=True) as tls:
            tls.sendall(tls.recv(5))

    thread = threading.Thread(target=serve_one, daemon=True)
    thread.start()
    client_ctx = ssl.create_default_context(cafile=str(material / "ca.pem"))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        client_ctx.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        tls.sendall(b"hello")
        assert tls.recv(5) == b"hello"
        assert tls.version() in ("TLSv1.2", "TLSv1.3")
    thread.join(5)
    listener.close()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--host", "localhost"],
            "error: --host names the hosts of the TLS certificate; add --tls",
        ),
        (["--tls"], "error: --tls needs at least one --host"),
        (["--tls", "--host", "a b"], "error: --host 'a b' is neither an IP address nor a DNS name"),
    ],
)
def test_init_refuses_bad_tls_options(tmp_path: Path, args: list[str], message: str) -> None:
    from typer.testing import CliRunner

    from zoo_gym.cli.coordinator import app

    result = CliRunner().invoke(app, ["init", "--home", str(tmp_path / "c"), "--tiny", *args])

    assert result.exit_code == 1
    assert result.stderr.startswith(message) and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "c").exists()  # nothing written


# --- renewal ---------------------------------------------------------------------------------------


def _renew(directory: Path, **kwargs: object) -> TlsFiles:
    paths: dict[str, object] = {
        "ca_cert": directory / "ca.pem",
        "ca_key": directory / "ca.key",
        "server_cert": directory / "server.pem",
        "server_key": directory / "server.key",
    }
    return renew_server_certificate(**(paths | kwargs))  # type: ignore[arg-type]


def test_renewal_keeps_the_ca_and_the_hosts(tmp_path: Path) -> None:
    first = write_tls_material(tmp_path / "tls", HOSTS)
    old_cert, old_key = first.server_cert.read_bytes(), first.server_key.read_bytes()
    ca_before = first.ca_cert.read_bytes()

    renewed = _renew(tmp_path / "tls", days=90)

    assert renewed.fingerprint == first.fingerprint
    assert first.ca_cert.read_bytes() == ca_before
    cert = read_served_pair(first.server_cert, first.server_key).certificate  # a matching pair
    assert first.server_key.read_bytes() != old_key  # a new key, not only a new date
    assert certificate_hosts(cert) == list(HOSTS)
    left = cert.not_valid_after_utc - dt.datetime.now(dt.UTC)
    assert dt.timedelta(days=89) < left <= dt.timedelta(days=90)
    assert (tmp_path / "tls/server.pem.old").read_bytes() == old_cert
    assert (tmp_path / "tls/server.key.old").read_bytes() == old_key
    for key in ("server.key", "server.key.old"):
        assert stat.S_IMODE((tmp_path / "tls" / key).stat().st_mode) == 0o600
    assert not list((tmp_path / "tls").glob(".*.tmp"))
    # the renewed certificate chains to the CA contributors already pinned
    cert.verify_directly_issued_by(load_certificate(first.ca_cert))


def test_renewal_can_change_the_hosts(tmp_path: Path) -> None:
    write_tls_material(tmp_path / "tls", ["localhost"])
    _renew(tmp_path / "tls", hosts=["coordinator.example.org", "203.0.113.5"])
    cert = load_certificate(tmp_path / "tls/server.pem")
    assert certificate_hosts(cert) == ["coordinator.example.org", "203.0.113.5"]


def test_renewal_refuses_a_missing_or_foreign_ca_key(tmp_path: Path) -> None:
    files = write_tls_material(tmp_path / "tls", ["localhost"])
    stranger = write_tls_material(tmp_path / "stranger", ["localhost"])
    before = files.server_cert.read_bytes()

    with pytest.raises(TlsError, match="is not the private key of"):
        _renew(tmp_path / "tls", ca_key=stranger.ca_key)
    files.ca_key.unlink()
    with pytest.raises(TlsError, match=r"no CA key at .*; bring it back"):
        _renew(tmp_path / "tls")
    assert files.server_cert.read_bytes() == before  # nothing changed


def test_expiry_warning_starts_thirty_days_out(material: Path) -> None:
    cert = load_certificate(material / "server.pem")
    end = cert.not_valid_after_utc

    assert expiry_warning(Path("s.pem"), cert, now=end - dt.timedelta(days=31)) == ""
    line = expiry_warning(Path("s.pem"), cert, now=end - dt.timedelta(days=12, hours=1))
    assert line.startswith("TLS certificate s.pem expires in 12 days (")
    assert "gym-coordinator tls renew" in line


def test_tls_renew_command(tiny_home: Path) -> None:
    from typer.testing import CliRunner

    from zoo_gym.cli.coordinator import app

    files = write_tls_material(tiny_home / "tls", ["localhost"])
    config = tiny_home / "coordinator.toml"
    config.write_text(
        'tls_cert = "tls/server.pem"\ntls_key = "tls/server.key"\n' + config.read_text()
    )
    runner = CliRunner()

    result = runner.invoke(app, ["tls", "renew", "-c", str(config), "--days", "30"])

    assert result.exit_code == 0, result.output
    assert f"CA unchanged (SHA-256 {files.fingerprint})" in result.stdout
    assert "a running `gym-coordinator serve` switches to it within 60 s" in result.stdout
    assert load_certificate(files.server_cert).not_valid_after_utc < (
        dt.datetime.now(dt.UTC) + dt.timedelta(days=31)
    )

    files.ca_key.unlink()  # kept offline: the operator names where it is
    result = runner.invoke(app, ["tls", "renew", "-c", str(config)])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: no CA key at ")
    assert len(result.stderr.strip().splitlines()) == 1


# --- serving a renewed certificate without a restart --------------------------------------------


def test_watcher_takes_a_renewed_pair_and_skips_a_broken_one(tmp_path: Path) -> None:
    files = write_tls_material(tmp_path / "tls", ["localhost"])
    watcher = CertificateWatcher(files.server_cert, files.server_key, interval_s=0)
    seen: list[str] = []
    watcher.on_change.append(lambda pair: seen.append(pair.cert_pem.decode()))
    first = watcher.current

    assert watcher.check() is False  # nothing changed
    files.server_cert.write_bytes(files.server_cert.read_bytes())  # touched, same bytes
    assert watcher.check() is False and seen == []

    # half a renewal: a new key beside the old certificate is not a pair; the old one stays
    stranger = write_tls_material(tmp_path / "other", ["localhost"])
    files.server_key.write_bytes(stranger.server_key.read_bytes())
    assert watcher.check() is False and watcher.current.cert_pem == first.cert_pem

    _renew(tmp_path / "tls")
    assert watcher.check() is True
    assert watcher.current.cert_pem == files.server_cert.read_bytes() != first.cert_pem
    assert seen == [files.server_cert.read_text()]


def test_a_failing_listener_does_not_stop_the_others(tmp_path: Path) -> None:
    files = write_tls_material(tmp_path / "tls", ["localhost"])
    watcher = CertificateWatcher(files.server_cert, files.server_key, interval_s=0)
    seen: list[bytes] = []

    def broken(pair: object) -> None:
        raise OSError("disk gone")

    watcher.on_change += [broken, lambda pair: seen.append(pair.cert_pem)]
    _renew(tmp_path / "tls")

    assert watcher.check() is True
    assert seen == [files.server_cert.read_bytes()]


def test_watcher_thread_follows_the_files(tmp_path: Path) -> None:
    files = write_tls_material(tmp_path / "tls", ["localhost"])
    watcher = CertificateWatcher(files.server_cert, files.server_key, interval_s=0.05)
    renewed = threading.Event()
    watcher.on_change.append(lambda pair: renewed.set())
    watcher.start()
    try:
        _renew(tmp_path / "tls")
        assert renewed.wait(10)
    finally:
        watcher.stop()


def test_https_serves_the_renewed_certificate_to_new_connections(tmp_path: Path) -> None:
    files = write_tls_material(tmp_path / "tls", ["localhost", "127.0.0.1"])
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(files.server_cert, files.server_key)

    def fresh() -> ssl.SSLContext:
        made = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        made.load_cert_chain(files.server_cert, files.server_key)
        return made

    renewed = follow_in_ssl_context(context, fresh)
    names: list[str | None] = []  # the server name each client sent
    switch = context.sni_callback
    assert switch is not None

    def spy(sock: ssl.SSLObject, name: str | None, ctx: ssl.SSLContext) -> int | None:
        names.append(name)
        return switch(sock, name, ctx)  # type: ignore[arg-type]

    context.sni_callback = spy  # type: ignore[assignment]
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve(n: int) -> None:
        for _ in range(n):
            conn, _ = listener.accept()
            with context.wrap_socket(conn, server_side=True) as tls:
                tls.recv(1)

    thread = threading.Thread(target=serve, args=(2,), daemon=True)
    thread.start()
    before = served_sha256(port, files.ca_cert)
    assert before == file_sha256(files.server_cert)
    watcher = CertificateWatcher(files.server_cert, files.server_key, interval_s=0)
    watcher.on_change.append(renewed)
    _renew(tmp_path / "tls")
    assert watcher.check()

    after = served_sha256(port, files.ca_cert, host="127.0.0.1")  # an IP address: no SNI
    assert after == file_sha256(files.server_cert) != before
    assert names == ["localhost", None]
    thread.join(5)
    listener.close()


def test_grpc_serves_the_renewed_certificate_to_new_connections(tmp_path: Path) -> None:
    from zoo_gym.transport.server import following_credentials

    files = write_tls_material(tmp_path / "tls", ["localhost"])
    watcher = CertificateWatcher(files.server_cert, files.server_key, interval_s=0)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: b"echo:" + request)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("zoo_gym.test.Echo", {"Call": handler}),)
    )
    port = server.add_secure_port("127.0.0.1:0", following_credentials(watcher.pem))
    server.start()
    try:
        before = served_sha256(port, files.ca_cert, alpn="h2")
        assert before == file_sha256(files.server_cert)
        _renew(tmp_path / "tls")
        assert watcher.check()

        assert served_sha256(port, files.ca_cert, alpn="h2") == file_sha256(files.server_cert)
        assert _echo(f"localhost:{port}", files.ca_cert.read_bytes()) == b"echo:hi"
    finally:
        server.stop(0).wait()


# --- the contributor's channel -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "loopback"),
    [
        ("localhost:7443", True),
        ("127.0.0.1:7443", True),
        ("127.8.9.10:1", True),
        ("[::1]:7443", True),
        ("coordinator.example.org:7443", False),
        ("203.0.113.5:7443", False),
        ("[2001:db8::1]:7443", False),
    ],
)
def test_only_loopback_addresses_default_to_plaintext(target: str, loopback: bool) -> None:
    from zoo_gym.transport.client import is_loopback

    assert is_loopback(target) is loopback


def test_a_client_without_the_ca_uses_tls_and_says_why_the_handshake_failed(
    grpc_port: int,
) -> None:
    # a coordinator elsewhere is reached over TLS checked against the system's CAs, which do
    # not know this CA: the contributor is told to pass --ca-cert
    from zoo_gym.core.identity import Identity
    from zoo_gym.transport.client import FederationClient, TransportError

    client = FederationClient(
        f"localhost:{grpc_port}", Identity.generate(), plaintext=False, timeout_s=10
    )
    try:
        with pytest.raises(TransportError, match=r"TLS handshake .* failed .* --ca-cert"):
            client.register("nobody")
    finally:
        client.close()
