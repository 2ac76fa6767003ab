"""TLS material for a coordinator: a private CA and a server certificate signed by it.

`gym-coordinator init --tls --host NAME` writes, under `home/tls/`:

    ca.pem       the CA certificate contributors pin (`gym-client join ... --ca-cert ca.pem`)
    ca.key       the CA's private key (0600); needed only to issue a new server certificate
    server.pem   the coordinator's certificate for every --host (subjectAltName), used by gRPC and REST
    server.key   its private key (0600)

Keys are ECDSA P-256, which BoringSSL (gRPC) and OpenSSL (uvicorn, httpx, curl) all accept. The CA
is constrained to sign end-entity certificates only (basicConstraints CA, pathLen 0) and the server
certificate is for server authentication only.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from zoo_gym.coordinator.config import ConfigError

CA_DAYS = 3650
SERVER_DAYS = 825  # the longest validity Apple's TLS clients accept, also for private CAs
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


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)


def write_tls_material(
    directory: Path, hosts: Sequence[str], *, common_name: str = CA_NAME
) -> TlsFiles:
    """Create a CA and a server certificate for `hosts` in `directory`; keys are 0600.

    Refuses to overwrite anything: TLS material that contributors already pinned must not change
    by accident.
    """
    files = TlsFiles(
        ca_cert=directory / "ca.pem",
        ca_key=directory / "ca.key",
        server_cert=directory / "server.pem",
        server_key=directory / "server.key",
        hosts=tuple(hosts),
        fingerprint="",
        not_after=dt.datetime.now(dt.UTC),
    )
    for existing in (files.ca_cert, files.ca_key, files.server_cert, files.server_key):
        if existing.exists():
            raise TlsError(f"{existing} exists; move the old TLS files away first")
    ca_key, ca_cert = create_ca(common_name)
    server_key, server_cert = issue_server_certificate(ca_key, ca_cert, hosts)
    directory.mkdir(parents=True, exist_ok=True)
    _write_key(files.ca_key, ca_key)
    _write_key(files.server_key, server_key)
    files.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.server_cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    return TlsFiles(
        ca_cert=files.ca_cert,
        ca_key=files.ca_key,
        server_cert=files.server_cert,
        server_key=files.server_key,
        hosts=tuple(hosts),
        fingerprint=fingerprint(ca_cert),
        not_after=server_cert.not_valid_after_utc,
    )


def load_certificate(path: Path) -> x509.Certificate:
    """The PEM certificate at `path` (TlsError with one line when it is not one)."""
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except ValueError:
        raise TlsError(f"{path} is not a PEM certificate; point tls_cert at one") from None


def check_server_files(cert: Path, key: Path) -> None:
    """Refuse a certificate and key that do not belong together, or an expired certificate."""
    certificate = load_certificate(cert)
    try:
        private = serialization.load_pem_private_key(key.read_bytes(), password=None)
    except (ValueError, TypeError):
        raise TlsError(
            f"{key} is not an unencrypted PEM private key; point tls_key at one"
        ) from None
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    if private.public_key().public_bytes(serialization.Encoding.PEM, public) != (
        certificate.public_key().public_bytes(serialization.Encoding.PEM, public)
    ):
        raise TlsError(
            f"{key} is not the private key of {cert}; set tls_cert and tls_key to a matching pair"
        )
    if certificate.not_valid_after_utc < dt.datetime.now(dt.UTC):
        raise TlsError(
            f"{cert} expired on {certificate.not_valid_after_utc:%Y-%m-%d}; issue a new server certificate"
        )
