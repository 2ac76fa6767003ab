"""Merkle tree hashes and proofs of RFC 9162 (Certificate Transparency v2), section 2.1.

Pure functions, no I/O. A tree over n entries D[0:n] is built from their *leaf hashes*:

    leaf_hash(d)   = SHA-256(0x00 || d)
    MTH({})        = SHA-256()                                  (empty tree)
    MTH({d})       = leaf_hash(d)
    MTH(D[n])      = SHA-256(0x01 || MTH(D[0:k]) || MTH(D[k:n]))

where k is the largest power of two smaller than n (RFC 9162 §2.1.1). Every function below takes
the sequence of leaf hashes (32 bytes each) rather than the entries themselves, so that a log can
cache leaf hashes and never reload the records to build a proof. Each function hashes every leaf
of the range it covers at most once: O(n) SHA-256 calls for a tree of n leaves.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

HASH_SIZE = 32
LEAF_PREFIX = b"\x00"
NODE_PREFIX = b"\x01"


def leaf_hash(entry: bytes) -> bytes:
    """RFC 9162 §2.1.1 leaf hash: SHA-256(0x00 || entry)."""
    return hashlib.sha256(LEAF_PREFIX + entry).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    """RFC 9162 §2.1.1 interior node hash: SHA-256(0x01 || left || right)."""
    return hashlib.sha256(NODE_PREFIX + left + right).digest()


def split_point(n: int) -> int:
    """Largest power of two strictly smaller than n (n >= 2), the split k of RFC 9162 §2.1.1."""
    if n < 2:
        raise ValueError(f"a split needs at least 2 leaves, got {n}")
    return 1 << ((n - 1).bit_length() - 1)


def _subtree_root(leaves: Sequence[bytes], lo: int, hi: int) -> bytes:
    """MTH(D[lo:hi]) for hi > lo, computed bottom-up.

    Pairing neighbours level by level and carrying an unpaired last node up unchanged builds the
    same tree as the recursive split at the largest power of two (RFC 9162 §2.1.1).
    """
    level = list(leaves[lo:hi])
    while len(level) > 1:
        paired = [node_hash(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            paired.append(level[-1])
        level = paired
    return level[0]


def root(leaves: Sequence[bytes]) -> bytes:
    """Merkle tree hash MTH of RFC 9162 §2.1.1 over the given leaf hashes."""
    if not leaves:
        return hashlib.sha256(b"").digest()
    return _subtree_root(leaves, 0, len(leaves))


def prefix_roots(leaves: Sequence[bytes], sizes: Iterable[int]) -> dict[int, bytes]:
    """MTH(D[0:m]) for every m in `sizes`, in one pass over the leaves: O(n + k log n).

    Keeps the roots of the perfect subtrees of the binary decomposition of the prefix (a
    "compact range"); the RFC 9162 §2.1.1 root of a prefix is their right fold,
    SHA-256(0x01 || P1 || SHA-256(0x01 || P2 || ...)), largest subtree first.
    """
    wanted = sorted(set(sizes))
    if wanted and not 0 <= wanted[0] <= wanted[-1] <= len(leaves):
        raise ValueError(f"sizes must lie in 0..{len(leaves)}")
    out: dict[int, bytes] = {}
    pending = iter(wanted)
    target = next(pending, None)
    if target == 0:
        out[0] = root([])
        target = next(pending, None)
    stack: list[tuple[int, bytes]] = []  # (height, root of a perfect subtree), left to right
    for m, leaf in enumerate(leaves, start=1):
        if target is None:
            break
        height, digest = 0, leaf
        while stack and stack[-1][0] == height:
            digest = node_hash(stack.pop()[1], digest)
            height += 1
        stack.append((height, digest))
        if m == target:
            acc = stack[-1][1]
            for _, left in reversed(stack[:-1]):
                acc = node_hash(left, acc)
            out[m] = acc
            target = next(pending, None)
    return out


def inclusion_proof(index: int, leaves: Sequence[bytes]) -> list[bytes]:
    """Audit path PATH(index, D[n]) of RFC 9162 §2.1.3.1 for the leaf at `index`."""
    n = len(leaves)
    if not 0 <= index < n:
        raise ValueError(f"leaf index {index} is outside a tree of size {n}")
    return _path(index, leaves, 0, n)


def _path(m: int, leaves: Sequence[bytes], lo: int, hi: int) -> list[bytes]:
    n = hi - lo
    if n == 1:
        return []
    k = split_point(n)
    if m < k:
        return [*_path(m, leaves, lo, lo + k), _subtree_root(leaves, lo + k, hi)]
    return [*_path(m - k, leaves, lo + k, hi), _subtree_root(leaves, lo, lo + k)]


def verify_inclusion(
    index: int, size: int, leaf_hash: bytes, proof: Sequence[bytes], root: bytes
) -> bool:
    """Check an inclusion proof with the algorithm of RFC 9162 §2.1.3.2."""
    if not 0 <= index < size:
        return False
    fn, sn = index, size - 1
    r = leaf_hash
    for p in proof:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            if not fn & 1:
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    return sn == 0 and r == root


def consistency_proof(old_size: int, leaves: Sequence[bytes]) -> list[bytes]:
    """Consistency proof PROOF(m, D[n]) of RFC 9162 §2.1.4.1 from size m = `old_size` to n.

    Empty when m is 0 or m == n (every tree extends the empty tree and itself).
    """
    n = len(leaves)
    if not 0 <= old_size <= n:
        raise ValueError(f"old size {old_size} is outside 0..{n}")
    if old_size in (0, n):
        return []
    return _subproof(old_size, leaves, 0, n, True)


def _subproof(m: int, leaves: Sequence[bytes], lo: int, hi: int, complete: bool) -> list[bytes]:
    n = hi - lo
    if m == n:
        return [] if complete else [_subtree_root(leaves, lo, hi)]
    k = split_point(n)
    if m <= k:
        return [*_subproof(m, leaves, lo, lo + k, complete), _subtree_root(leaves, lo + k, hi)]
    return [*_subproof(m - k, leaves, lo + k, hi, False), _subtree_root(leaves, lo, lo + k)]


def verify_consistency(
    old_size: int, new_size: int, old_root: bytes, new_root: bytes, proof: Sequence[bytes]
) -> bool:
    """Check a consistency proof with the algorithm of RFC 9162 §2.1.4.2.

    The degenerate cases the RFC leaves to the caller: old_size 0 (any tree is consistent with
    the empty tree) and old_size == new_size (the roots must be equal) take an empty proof.
    """
    if not 0 <= old_size <= new_size:
        return False
    if old_size == 0:
        return not proof
    if old_size == new_size:
        return not proof and old_root == new_root
    if not proof:
        return False
    path = list(proof)
    if old_size & (old_size - 1) == 0:
        path.insert(0, old_root)
    fn, sn = old_size - 1, new_size - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            if not fn & 1:
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    return fr == old_root and sr == new_root and sn == 0
