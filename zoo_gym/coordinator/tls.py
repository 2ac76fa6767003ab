"""TLS material for a coordinator: a private CA and a server certificate signed by it.

`gym-coordinator init --tls --host NAME` writes, under `home/tls/`:

    ca.pem       the CA certificate contributors pin (`gym-client join ... --ca-cert ca.pem`)
    ca.key       the CA's private key (0600); needed only to issue a new server certificate
                 (`gym-coordinator tls renew`), so it can be kept offline in between
    server.pem   the coordinator's certificate for every --host (subjectAltName), used by gRPC and REST
    server.key   its private key (0600)

Keys are ECDSA P-256, which BoringSSL (gRPC) and OpenSSL (uvicorn, httpx, curl) all accept. The CA
is constrained to sign end-entity certificates only (basicConstraints CA, pathLen 0) and the server
certificate is for server authentication only.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import logging
import os
import re
import ssl
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from zoo_gym.coordinator.config import ConfigError
from zoo_gym.core.files import write_atomic

log = logging.getLogger(__name__)

CA_DAYS = 3650
SERVER_DAYS = 825  # the longest validity Apple's TLS clients accept, also for private CAs
RENEW_WITHIN_DAYS = 30  # `serve` warns, at start and on each reload, when less than this is left
CA_NAME = "zoo-gym coordinator CA"
_DNS_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$", re.IGNORECASE)


class TlsError(ConfigError):
    """A host name or TLS file the operator gave cannot be used; the message says what to do."""


@dataclass(frozen=True)
class TlsFiles:
    """Where `write_tls_material` put everything, and what contributors check."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    hosts: tuple[str, ...]
    fingerprint: str  # SHA-256 of the CA certificate (DER), colon-separated hex
    not_after: dt.datetime


def subject_alt_name(host: str) -> x509.GeneralName:
    """`host` as a subjectAltName entry: an IP address, else a DNS name (`*.` allowed first)."""
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    name = host.strip().rstrip(".").lower()
    labels = name.removeprefix("*.").split(".")
    if not name or len(name) > 253 or not all(_DNS_LABEL.match(label) for label in labels):
        raise TlsError(
            f"--host {host!r} is neither an IP address nor a DNS name; "
            "pass the name or address contributors dial, e.g. --host coordinator.example.org"
        )
    return x509.DNSName(name)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def create_ca(
    common_name: str = CA_NAME, *, days: int = CA_DAYS, now: dt.datetime | None = None
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A new CA: P-256 key and a self-signed certificate that may sign server certificates."""
    now = now or dt.datetime.now(dt.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    public = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    """Signatures only; a CA also signs certificates and revocation lists."""
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def issue_server_certificate(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    hosts: Sequence[str],
    *,
    days: int = SERVER_DAYS,
    now: dt.datetime | None = None,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A P-256 key and a certificate for `hosts` (DNS names and IP addresses), signed by the CA."""
    if not hosts:
        raise TlsError(
            "a server certificate needs at least one --host (the name contributors dial)"
        )
    names = [subject_alt_name(h) for h in hosts]
    now = now or dt.datetime.now(dt.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    public = key.public_key()
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(str(names[0].value)))
        .issuer_name(ca_cert.subject)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(min(now + dt.timedelta(days=days), ca_cert.not_valid_after_utc))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(ca=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def fingerprint(cert: x509.Certificate) -> str:
    """SHA-256 of the certificate's DER bytes as AA:BB:... (what `openssl x509 -fingerprint
    -sha256` prints)."""
    return cert.fingerprint(hashes.SHA256()).hex(":").upper()


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(_key_pem(key))


def write_tls_material(
    directory: Path, hosts: Sequence[str], *, common_name: str = CA_NAME
) -> TlsFiles:
    """Create a CA and a server certificate for `hosts` in `directory`; keys are 0600.

    Refuses to overwrite anything: TLS material that contributors already pinned must not change
    by accident.
    """
    paths = [directory / name for name in ("ca.pem", "ca.key", "server.pem", "server.key")]
    for existing in paths:
        if existing.exists():
            raise TlsError(f"{existing} exists; move the old TLS files away first")
    ca_pem, ca_key_path, server_pem, server_key_path = paths
    ca_key, ca_cert = create_ca(common_name)
    server_key, server_cert = issue_server_certificate(ca_key, ca_cert, hosts)
    directory.mkdir(parents=True, exist_ok=True)
    _write_key(ca_key_path, ca_key)
    _write_key(server_key_path, server_key)
    ca_pem.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    server_pem.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    return TlsFiles(
        ca_cert=ca_pem,
        ca_key=ca_key_path,
        server_cert=server_pem,
        server_key=server_key_path,
        hosts=tuple(hosts),
        fingerprint=fingerprint(ca_cert),
        not_after=server_cert.not_valid_after_utc,
    )


def load_certificate(path: Path) -> x509.Certificate:
    """The PEM certificate at `path` (TlsError with one line when it is not one)."""
    return _parse_certificate(path.read_bytes(), path)


def _parse_certificate(pem: bytes, path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(pem)
    except ValueError:
        raise TlsError(f"{path} is not a PEM certificate; point tls_cert at one") from None


def _is_key_of(private: PrivateKeyTypes, certificate: x509.Certificate) -> bool:
    """Whether `private` is the key whose public half `certificate` carries."""
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    der = serialization.Encoding.DER
    return bool(
        private.public_key().public_bytes(der, spki)
        == certificate.public_key().public_bytes(der, spki)
    )


def check_server_pair(
    cert_pem: bytes, key_pem: bytes, *, cert: Path, key: Path
) -> x509.Certificate:
    """The server certificate, after refusing a key that is not its own or an expired one
    (`cert` and `key` name the files the PEM bytes came from, in errors)."""
    certificate = _parse_certificate(cert_pem, cert)
    try:
        private = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError):
        raise TlsError(
            f"{key} is not an unencrypted PEM private key; point tls_key at one"
        ) from None
    if not _is_key_of(private, certificate):
        raise TlsError(
            f"{key} is not the private key of {cert}; set tls_cert and tls_key to a matching pair"
        )
    if certificate.not_valid_after_utc < dt.datetime.now(dt.UTC):
        raise TlsError(
            f"{cert} expired on {certificate.not_valid_after_utc:%Y-%m-%d}; "
            "issue a new one with `gym-coordinator tls renew`"
        )
    return certificate


def certificate_hosts(cert: x509.Certificate) -> list[str]:
    """The DNS names and IP addresses a certificate's subjectAltName covers, in order."""
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [str(name.value) for name in names if isinstance(name, x509.DNSName | x509.IPAddress)]


def _load_ca(ca_cert: Path, ca_key: Path) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    if not ca_key.exists():
        raise TlsError(
            f"no CA key at {ca_key}; bring it back from where it is kept, or pass --ca-key"
        )
    cert = load_certificate(ca_cert)
    try:
        key = serialization.load_pem_private_key(ca_key.read_bytes(), password=None)
    except (ValueError, TypeError):
        raise TlsError(
            f"{ca_key} is not an unencrypted PEM private key; pass the CA's key"
        ) from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not _is_key_of(key, cert):
        raise TlsError(f"{ca_key} is not the private key of {ca_cert}; pass the matching CA key")
    if cert.not_valid_after_utc < dt.datetime.now(dt.UTC):
        raise TlsError(
            f"the CA {ca_cert} expired on {cert.not_valid_after_utc:%Y-%m-%d}; create a new CA "
            "(`gym-coordinator init --tls` in a new home) and hand contributors its certificate"
        )
    return key, cert


def renew_server_certificate(
    *,
    ca_cert: Path,
    ca_key: Path,
    server_cert: Path,
    server_key: Path,
    hosts: Sequence[str] = (),
    days: int = SERVER_DAYS,
) -> TlsFiles:
    """Issue a new server key and certificate from the existing CA and swap them in.

    Contributors pinned the CA, so they keep connecting without any change on their side. The
    hosts are those of the current certificate unless `hosts` names others. The old files are
    kept as `server.pem.old` / `server.key.old` until the next renewal; a running coordinator
    switches to the new pair by itself (`CertificateWatcher`).
    """
    key, cert = _load_ca(ca_cert, ca_key)
    if not hosts:
        if not server_cert.exists():
            raise TlsError(f"no certificate at {server_cert} to take the hosts from; pass --host")
        hosts = certificate_hosts(load_certificate(server_cert))
    new_key, new_cert = issue_server_certificate(key, cert, hosts, days=days)
    for current in (server_cert, server_key):
        if current.exists():
            old = current.with_name(current.name + ".old")
            write_atomic(old, current.read_bytes(), mode=0o600)
    # each file is swapped whole; `serve` checks that the pair on disk matches before using it
    write_atomic(server_key, _key_pem(new_key), mode=0o600)
    write_atomic(server_cert, new_cert.public_bytes(serialization.Encoding.PEM))
    return TlsFiles(
        ca_cert=ca_cert,
        ca_key=ca_key,
        server_cert=server_cert,
        server_key=server_key,
        hosts=tuple(hosts),
        fingerprint=fingerprint(cert),
        not_after=new_cert.not_valid_after_utc,
    )


def expiry_warning(path: Path, cert: x509.Certificate, now: dt.datetime | None = None) -> str:
    """A line for the operator when `cert` expires within RENEW_WITHIN_DAYS, else ''."""
    left = (cert.not_valid_after_utc - (now or dt.datetime.now(dt.UTC))).total_seconds() / 86400
    if left >= RENEW_WITHIN_DAYS:
        return ""
    return (
        f"TLS certificate {path} expires in {max(left, 0):.0f} days "
        f"({cert.not_valid_after_utc:%Y-%m-%d}); renew it with `gym-coordinator tls renew`"
    )


@dataclass(frozen=True)
class ServedPair:
    """A certificate and key `serve` is using: their PEM bytes and the parsed certificate."""

    cert_pem: bytes
    key_pem: bytes
    certificate: x509.Certificate


def read_served_pair(cert: Path, key: Path) -> ServedPair:
    """The pair at `cert`/`key`, checked by `check_server_pair` (TlsError when unusable)."""
    cert_pem, key_pem = cert.read_bytes(), key.read_bytes()
    return ServedPair(cert_pem, key_pem, check_server_pair(cert_pem, key_pem, cert=cert, key=key))


class CertificateWatcher:
    """Serves a renewed certificate without a restart.

    A thread reads `cert` and `key` every `interval_s` seconds (two small files; contents are
    compared, since file times are too coarse to show every rewrite). When they differ from the
    pair in use and form a valid pair (matching, not expired), `current` moves to the new pair
    and each `on_change` callback runs with it. A pair caught half-written, or one that fails the
    checks, is skipped with one warning, and the certificate in use stays until a good pair
    appears.
    """

    def __init__(self, cert: Path, key: Path, *, interval_s: float) -> None:
        self.cert, self.key, self.interval_s = cert, key, interval_s
        self.current = read_served_pair(cert, key)
        self.on_change: list[Callable[[ServedPair], None]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._refused: tuple[bytes, bytes] | None = None  # the last contents warned about

    def pem(self) -> tuple[bytes, bytes]:
        """(certificate chain PEM, key PEM) in use now: what the gRPC server asks per handshake."""
        pair = self.current
        return pair.cert_pem, pair.key_pem

    def start(self) -> None:
        if self.interval_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tls-watch", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.check()

    def check(self) -> bool:
        """Read the files; True when they hold a new valid pair, now in use."""
        try:
            seen = (self.cert.read_bytes(), self.key.read_bytes())
        except OSError as exc:
            if self._refused != (b"", b""):
                log.warning("TLS files unreadable (%s); still serving the certificate in use", exc)
                self._refused = (b"", b"")
            return False
        if seen == self.pem() or seen == self._refused:
            return False
        try:
            certificate = check_server_pair(*seen, cert=self.cert, key=self.key)
        except TlsError as exc:
            log.warning("TLS files changed but cannot be used yet: %s", exc)
            self._refused = seen
            return False
        self._refused = None
        self.current = pair = ServedPair(*seen, certificate)
        log.info(
            "TLS certificate reloaded from %s: valid until %s",
            self.cert,
            f"{certificate.not_valid_after_utc:%Y-%m-%d}",
        )
        for callback in self.on_change:
            try:
                callback(pair)
            except Exception:  # one listener failing must not stop the others or the thread
                log.exception("TLS reload: %r failed; it keeps the previous certificate", callback)
        return True


def follow_in_ssl_context(
    context: ssl.SSLContext, make: Callable[[], ssl.SSLContext]
) -> Callable[[ServedPair], None]:
    """Make new TLS connections to `context` (uvicorn's) use the latest renewed certificate.

    Returns the callback for `CertificateWatcher.on_change`: it builds a fresh context with `make`
    (same settings, new files), and the SNI callback, which OpenSSL runs on every ClientHello
    with or without a server name, moves each new connection onto it. Connections already open
    keep the certificate they were made with.
    """
    latest = [context]

    def switch(
        connection: ssl.SSLObject | ssl.SSLSocket, name: str | None, ctx: ssl.SSLContext
    ) -> None:
        if latest[0] is not ctx:
            connection.context = latest[0]

    context.sni_callback = switch

    def renewed(pair: ServedPair) -> None:
        fresh = make()
        fresh.sni_callback = switch
        latest[0] = fresh

    return renewed
