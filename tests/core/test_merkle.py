"""RFC 9162 §2.1 Merkle tree: hand-built roots, audit paths and consistency proofs."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zoo_gym.core import merkle


def h(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def leaf(i: int) -> bytes:
    return h(b"\x00" + f"entry {i}".encode())


def node(left: bytes, right: bytes) -> bytes:
    return h(b"\x01" + left + right)


def leaves(n: int) -> list[bytes]:
    return [merkle.leaf_hash(f"entry {i}".encode()) for i in range(n)]


def flip(data: bytes, position: int = 0) -> bytes:
    return data[:position] + bytes([data[position] ^ 1]) + data[position + 1 :]


# Roots written out by hand for sizes 1..7, following the split at the largest power of two < n.
HAND_ROOTS = {
    1: lambda: leaf(0),
    2: lambda: node(leaf(0), leaf(1)),
    3: lambda: node(node(leaf(0), leaf(1)), leaf(2)),
    4: lambda: node(node(leaf(0), leaf(1)), node(leaf(2), leaf(3))),
    5: lambda: node(node(node(leaf(0), leaf(1)), node(leaf(2), leaf(3))), leaf(4)),
    6: lambda: node(node(node(leaf(0), leaf(1)), node(leaf(2), leaf(3))), node(leaf(4), leaf(5))),
    7: lambda: node(
        node(node(leaf(0), leaf(1)), node(leaf(2), leaf(3))),
        node(node(leaf(4), leaf(5)), leaf(6)),
    ),
}


def test_leaf_and_empty_hashes() -> None:
    # Prepare / Execute / Assert
    assert merkle.leaf_hash(b"entry 0") == leaf(0)
    assert merkle.root([]) == h(b"")
    assert merkle.node_hash(b"a", b"b") == h(b"\x01ab")


@pytest.mark.parametrize("n", sorted(HAND_ROOTS))
def test_root_matches_hand_built_tree(n: int) -> None:
    assert merkle.root(leaves(n)) == HAND_ROOTS[n]()


@pytest.mark.parametrize("n", range(2, 40))
def test_root_splits_at_largest_power_of_two_below_n(n: int) -> None:
    k = 1
    while k * 2 < n:
        k *= 2
    tree = leaves(n)
    assert merkle.split_point(n) == k
    assert merkle.root(tree) == node(merkle.root(tree[:k]), merkle.root(tree[k:]))


def test_prefix_roots_equal_roots_of_prefixes() -> None:
    tree = leaves(40)
    roots = merkle.prefix_roots(tree, range(41))
    assert roots == {m: merkle.root(tree[:m]) for m in range(41)}
    assert merkle.prefix_roots(tree, [7, 3]) == {3: merkle.root(tree[:3]), 7: merkle.root(tree[:7])}
    with pytest.raises(ValueError):
        merkle.prefix_roots(tree, [41])


def test_inclusion_path_matches_hand_built_tree() -> None:
    # RFC 9162 §2.1.5 example tree of 7 leaves: the path of d0 is [b, h, l] in the RFC's figure.
    tree = leaves(7)
    assert merkle.inclusion_proof(0, tree) == [
        leaf(1),
        node(leaf(2), leaf(3)),
        node(node(leaf(4), leaf(5)), leaf(6)),
    ]
    assert merkle.inclusion_proof(6, tree) == [
        node(leaf(4), leaf(5)),
        node(node(leaf(0), leaf(1)), node(leaf(2), leaf(3))),
    ]


def test_consistency_proofs_match_rfc_example() -> None:
    # RFC 9162 §2.1.5: PROOF(3, D[7]) = [c, d, g, l], PROOF(4, D[7]) = [l], PROOF(6, D[7]) = [i, j, k].
    tree = leaves(7)
    c, d = leaf(2), leaf(3)
    g = node(leaf(0), leaf(1))
    i, j = node(leaf(4), leaf(5)), leaf(6)
    k = node(g, node(c, d))
    l_ = node(i, j)
    assert merkle.consistency_proof(3, tree) == [c, d, g, l_]
    assert merkle.consistency_proof(4, tree) == [l_]
    assert merkle.consistency_proof(6, tree) == [i, j, k]


@pytest.mark.parametrize("size", range(1, 21))
def test_every_inclusion_proof_verifies_and_a_flipped_byte_fails(size: int) -> None:
    tree = leaves(size)
    root = merkle.root(tree)
    for index in range(size):
        proof = merkle.inclusion_proof(index, tree)
        assert merkle.verify_inclusion(index, size, tree[index], proof, root)
        assert not merkle.verify_inclusion(index, size, flip(tree[index]), proof, root)
        assert not merkle.verify_inclusion(index, size, tree[index], proof, flip(root, 31))
        for p in range(len(proof)):
            broken = [*proof[:p], flip(proof[p], 5), *proof[p + 1 :]]
            assert not merkle.verify_inclusion(index, size, tree[index], broken, root)
        if size > 1:
            other = (index + 1) % size
            assert not merkle.verify_inclusion(other, size, tree[index], proof, root)
            assert not merkle.verify_inclusion(index, size, tree[index], proof[:-1], root)


@pytest.mark.parametrize("new_size", range(1, 21))
def test_every_consistency_proof_verifies_and_a_flipped_byte_fails(new_size: int) -> None:
    tree = leaves(new_size)
    new_root = merkle.root(tree)
    for old_size in range(0, new_size + 1):
        old_root = merkle.root(tree[:old_size])
        proof = merkle.consistency_proof(old_size, tree)
        assert merkle.verify_consistency(old_size, new_size, old_root, new_root, proof)
        if 0 < old_size < new_size:
            assert not merkle.verify_consistency(
                old_size, new_size, flip(old_root), new_root, proof
            )
            assert not merkle.verify_consistency(
                old_size, new_size, old_root, flip(new_root), proof
            )
            for p in range(len(proof)):
                broken = [*proof[:p], flip(proof[p], 7), *proof[p + 1 :]]
                assert not merkle.verify_consistency(old_size, new_size, old_root, new_root, broken)
            assert not merkle.verify_consistency(old_size, new_size, old_root, new_root, [])


def test_consistency_rejects_a_rewritten_prefix() -> None:
    tree = leaves(9)
    forged = [merkle.leaf_hash(b"forged"), *tree[1:]]
    proof = merkle.consistency_proof(4, forged)
    assert not merkle.verify_consistency(4, 9, merkle.root(tree[:4]), merkle.root(forged), proof)


def test_out_of_range_arguments() -> None:
    tree = leaves(3)
    with pytest.raises(ValueError):
        merkle.inclusion_proof(3, tree)
    with pytest.raises(ValueError):
        merkle.consistency_proof(4, tree)
    assert not merkle.verify_inclusion(3, 3, tree[0], [], merkle.root(tree))
    assert not merkle.verify_consistency(4, 3, b"", b"", [])
    assert not merkle.verify_consistency(3, 3, merkle.root(tree), flip(merkle.root(tree)), [])


@settings(max_examples=60, deadline=None)
@given(data=st.data(), size=st.integers(min_value=1, max_value=300))
def test_random_sizes(data: st.DataObject, size: int) -> None:
    tree = leaves(size)
    root = merkle.root(tree)
    index = data.draw(st.integers(min_value=0, max_value=size - 1))
    old_size = data.draw(st.integers(min_value=0, max_value=size))
    path = merkle.inclusion_proof(index, tree)
    assert len(path) <= (size - 1).bit_length()
    assert merkle.verify_inclusion(index, size, tree[index], path, root)
    proof = merkle.consistency_proof(old_size, tree)
    old_root = merkle.root(tree[:old_size])
    assert merkle.verify_consistency(old_size, size, old_root, root, proof)
    if 0 < old_size < size:
        assert not merkle.verify_consistency(old_size, size, flip(old_root), root, proof)
