"""Ed25519 identities for contributors and the coordinator.

A contributor *is* its key: the contributor id is the first 16 bytes of
SHA-256(raw public key), hex encoded. Keys are stored as PEM (PKCS#8, unencrypted,
file mode 0600).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey


class IdentityError(ValueError):
    """A key file is missing, unreadable or not an Ed25519 key."""


CONTRIBUTOR_ID = r"^[0-9a-f]{32}$"
"""What `contributor_id` returns: 32 lowercase hex digits."""


def contributor_id(public_key: bytes) -> str:
    """Stable contributor id for a raw 32-byte Ed25519 public key."""
    return hashlib.sha256(public_key).hexdigest()[:32]


def node_id(public_key: bytes) -> int:
    """Flower node id (positive int63) for a raw public key."""
    return int.from_bytes(hashlib.sha256(b"node" + public_key).digest()[:8], "big") >> 1


@dataclass(frozen=True)
class Identity:
    """An Ed25519 key pair."""

    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """The key pair whose private key is `seed` (32 bytes): for simulated contributors."""
        if len(seed) != 32:
            raise IdentityError(f"an Ed25519 seed is 32 bytes, got {len(seed)}")
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @property
    def public_key(self) -> bytes:
        return self.private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @property
    def contributor_id(self) -> str:
        return contributor_id(self.public_key)

    def sign(self, message: bytes) -> bytes:
        return self.private_key.sign(message)

    def save(self, path: Path) -> None:
        pem = self.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(pem)

    @classmethod
    def load(cls, path: Path) -> Identity:
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except FileNotFoundError:
            raise IdentityError(f"no key at {path}; create one with `init`") from None
        except ValueError as exc:
            raise IdentityError(f"{path} is not a readable PEM private key ({exc})") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise IdentityError(f"{path} holds a {type(key).__name__}, expected an Ed25519 key")
        return cls(key)


def verify(public_key: bytes, signature: bytes, message: bytes) -> bool:
    """True when `signature` is a valid Ed25519 signature of `message` by `public_key`."""
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True
