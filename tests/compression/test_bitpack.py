"""The compiled pack (`zoo_gym/compression/_bitpack.c`) against the numpy path and torch.sum.

Every comparison is bit for bit: sign bytes as bytes, scales and sums as their raw float32 bits.
"""

from collections.abc import Iterator

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from numpy.typing import NDArray

from zoo_gym.compression import CodecSpec, bitdelta, encode

try:
    from zoo_gym.compression import _bitpack
except ImportError:  # the build failed: test_the_development_install_built_the_extension fails
    _bitpack = None

KERNELS = _bitpack.kernels if _bitpack is not None else ()
compiled = pytest.mark.skipif(_bitpack is None, reason="the C extension was not built")

GROUPS = [8, 16, 64, 128, 1024, 8192]
# zeros and subnormals; and, a hundred times rarer, values whose sum overflows float32,
# infinities and NaN with and without its sign bit (a group holding one sums to inf or NaN,
# whatever the order of its additions)
SPECIALS = np.array([0.0, -0.0, 1e-45, -1e-45, 1e-40, -3e-39], dtype=np.float32)
NEGATIVE_NAN = np.array([0xFFC00000], dtype=np.uint32).view(np.float32)[0]
RARE = np.array([3e38, -3e38, np.inf, -np.inf, np.nan, NEGATIVE_NAN], dtype=np.float32)
MAX_MULTIPLE = 1024  # groups up to 8 * 1024 = MAX_PACK_GROUP


def _values(rng: np.random.Generator, n: int, special: float) -> torch.Tensor:
    """n float32 values, a share `special` of them from SPECIALS (special / 100 from RARE), the
    others normal or spread over 2 or 12 decades (values of one size make the order of the
    additions show in the sums)."""
    spread = rng.choice([0.0, 1.0, 6.0])
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-spread, spread, n)).astype(np.float32)
    draw = rng.random(n)
    common, rare = draw < special, draw < special / 100
    x[common] = rng.choice(SPECIALS, int(common.sum()))
    x[rare] = rng.choice(RARE, int(rare.sum()))
    return torch.from_numpy(x)


def _plain(x: torch.Tensor, group: int) -> tuple[bytes, torch.Tensor]:
    """Sign bytes by numpy.packbits of ``x >= 0`` and sums by one torch.sum over the groups
    of |x| zero-padded to whole groups (as the CPU path pads them)."""
    n = x.numel()
    padded = torch.zeros(-(-n // group) * group)
    padded[:n] = x.abs()
    return np.packbits(x.numpy() >= 0).tobytes(), torch.sum(padded.view(-1, group), 1)


def _raw(x: torch.Tensor | NDArray[np.float32]) -> torch.Tensor:
    """The float32 bits of `x` as int32, so that NaN, inf and -0.0 compare exactly."""
    t = torch.from_numpy(x) if isinstance(x, np.ndarray) else x
    return t.contiguous().view(torch.int32)


def _pack_concat(
    xs: list[torch.Tensor], group: int, *, compiled: bool
) -> tuple[list[bytes], torch.Tensor]:
    """Each tensor's sign bytes and all scales from `pack_concat` on the chosen path."""
    previous = bitdelta.use_compiled(compiled)
    try:
        bits, starts, scales = bitdelta.pack_concat(xs, group)
    finally:
        bitdelta.use_compiled(previous)
    signs = [bits[s : s + (x.numel() + 7) // 8].tobytes() for s, x in zip(starts, xs, strict=True)]
    return signs, scales


def _lengths(group: int) -> st.SearchStrategy[int]:
    edges = [0, 1, 7, 8, group - 1, group, group + 1, 3 * group + 5, 100_003]
    return st.sampled_from(edges) | st.integers(0, 3 * group + 9)


@st.composite
def updates(draw: st.DrawFn) -> tuple[list[torch.Tensor], int]:
    """A group size and a few tensors of edge-case lengths with special values among them."""
    group = draw(st.sampled_from(GROUPS) | st.integers(1, MAX_MULTIPLE).map(lambda k: 8 * k))
    lengths = draw(st.lists(_lengths(group), min_size=1, max_size=6))
    special = draw(st.sampled_from([0.0, 0.01, 0.3, 1.0]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return [_values(rng, n, special) for n in lengths], group


@pytest.fixture(autouse=True)
def _compiled_back_on() -> Iterator[None]:
    yield
    bitdelta.use_compiled(True)


def test_the_development_install_built_the_extension() -> None:
    # A compiler was present where the package was installed (CI, development): the build must
    # not have failed silently into the numpy fallback.
    assert bitdelta.compiled_available(), (
        "zoo_gym.compression._bitpack was not built: install a C compiler, then pip install -e ."
    )
    assert "portable" in KERNELS


@compiled
@settings(max_examples=80, deadline=None)
@given(update=updates())
def test_compiled_pack_concat_equals_the_numpy_path_bit_for_bit(
    update: tuple[list[torch.Tensor], int],
) -> None:
    # Prepare
    xs, group = update

    # Execute
    compiled_signs, compiled_scales = _pack_concat(xs, group, compiled=True)
    numpy_signs, numpy_scales = _pack_concat(xs, group, compiled=False)

    # Assert
    assert compiled_signs == numpy_signs
    assert torch.equal(_raw(compiled_scales), _raw(numpy_scales))


@compiled
@settings(max_examples=60, deadline=None)
@given(update=updates(), kernel=st.sampled_from(KERNELS))
def test_every_kernel_writes_packbits_and_torch_sum_at_the_offsets(
    update: tuple[list[torch.Tensor], int], kernel: str
) -> None:
    # Prepare: all tensors into one byte buffer and one sums buffer, with a guard byte and a
    # guard sum between tensors that must stay untouched
    xs, group = update
    nbytes = [(x.numel() + 7) // 8 for x in xs]
    ngroups = [-(-x.numel() // group) for x in xs]
    bits = np.full(sum(nbytes) + len(xs), 0xA5, dtype=np.uint8)
    sums = np.full(sum(ngroups) + len(xs), -7.0, dtype=np.float32)

    # Execute
    b = s = 0
    for x, nb, ng in zip(xs, nbytes, ngroups, strict=True):
        _bitpack.pack(x.numpy(), group, bits, b, sums, s, kernel)
        b, s = b + nb + 1, s + ng + 1

    # Assert
    b = s = 0
    for x, nb, ng in zip(xs, nbytes, ngroups, strict=True):
        signs, expected = _plain(x, group)
        assert bits[b : b + nb].tobytes() == signs
        assert torch.equal(_raw(sums[s : s + ng]), _raw(expected))
        assert bits[b + nb] == 0xA5 and sums[s + ng] == -7.0
        b, s = b + nb + 1, s + ng + 1


@compiled
@pytest.mark.parametrize("group", [*GROUPS, 24, 8000])
def test_every_kernel_at_every_edge_length(group: int) -> None:
    rng = np.random.default_rng(group)
    for n in [1, 7, 8, 9, group - 1, group, group + 1, 64 * group + 3]:
        x = _values(rng, n, 0.01)
        signs, expected = _plain(x, group)
        for kernel in KERNELS:
            bits = np.empty(len(signs), dtype=np.uint8)
            sums = np.empty(expected.numel(), dtype=np.float32)
            _bitpack.pack(x.numpy(), group, bits, 0, sums, 0, kernel)
            assert bits.tobytes() == signs, (n, kernel)
            assert torch.equal(_raw(sums), _raw(expected)), (n, kernel)


@compiled
def test_group_sums_that_overflow_float32_are_inf_on_both_paths() -> None:
    # 3e38 + 3e38 is past float32's largest value 3.4e38
    xs = [torch.full((300,), 3e38), torch.tensor([3e38, -3e38, 1.0])]

    compiled_signs, compiled_scales = _pack_concat(xs, 8, compiled=True)
    numpy_signs, numpy_scales = _pack_concat(xs, 8, compiled=False)

    assert compiled_signs == numpy_signs
    assert torch.equal(_raw(compiled_scales), _raw(numpy_scales))
    assert bool(torch.isinf(compiled_scales).all())


@compiled
def test_zero_and_negative_zero_are_set_bits_and_nan_a_clear_one() -> None:
    x = torch.tensor([0.0, -0.0, float("nan"), -1.0, 2.0, -1e-45, 1e-45, float("-inf"), 5.0])

    bits = np.empty(2, dtype=np.uint8)
    sums = np.empty(1, dtype=np.float32)
    _bitpack.pack(x.numpy(), 16, bits, 0, sums, 0)

    assert bits.tolist() == [0b11001010, 0b10000000]  # unused low bits of the last byte are 0
    assert np.isnan(sums[0])


@compiled
def test_many_tensors_in_one_update_match_the_numpy_path() -> None:
    # Prepare: 300 tensors of mixed shapes and dtypes, some strided, some requiring grad
    rng = np.random.default_rng(7)
    xs: list[torch.Tensor] = []
    for i in range(300):
        x = _values(rng, int(rng.integers(0, 5000)), 0.01)
        if i % 7 == 0:
            x = x.half()
        if i % 11 == 0 and x.numel() >= 2:
            x = x[::2]
        xs.append(x.requires_grad_(i % 5 == 0))

    compiled_signs, compiled_scales = _pack_concat(xs, 64, compiled=True)
    numpy_signs, numpy_scales = _pack_concat(xs, 64, compiled=False)

    assert compiled_signs == numpy_signs
    assert torch.equal(_raw(compiled_scales), _raw(numpy_scales))


@pytest.mark.parametrize("group", [8, 128, 4096])
def test_numpy_path_across_chunk_boundaries_matches_the_plain_computation(group: int) -> None:
    # The fallback keeps its own check for groups the compiled pass takes
    chunk = bitdelta._chunk_len(group, bitdelta._PACK_CHUNK)
    rng = np.random.default_rng(group)
    xs = [_values(rng, n, 0.01) for n in [chunk - 5, 17, 2 * chunk + 3, 0, chunk, 300_001]]

    signs, scales = _pack_concat(xs, group, compiled=False)

    expected = [_plain(x, group) for x in xs]
    assert signs == [s for s, _ in expected]
    means = []
    for x, (_, sums) in zip(xs, expected, strict=True):
        lengths = torch.full_like(sums, float(group))
        if x.numel() % group:
            lengths[-1] = float(x.numel() % group)
        means.append(sums / lengths)
    assert torch.equal(_raw(scales), _raw(torch.cat(means)))


@compiled
def test_envelopes_are_the_same_bytes_on_both_paths() -> None:
    rng = np.random.default_rng(3)
    delta = {f"layer{i}.lora_B": _values(rng, 896 * 16 + i * 13, 0.0).view(-1, 1) for i in range(9)}
    for group in (8, 128, 1000):
        spec = CodecSpec("bitdelta", group_size=group, scale_dtype="float32")
        bitdelta.use_compiled(True)
        compiled = encode(delta, spec)
        bitdelta.use_compiled(False)
        assert encode(delta, spec) == compiled


@compiled
def test_use_compiled_returns_the_previous_setting() -> None:
    assert bitdelta.use_compiled(False) is True
    assert bitdelta.use_compiled(True) is False
    assert bitdelta.use_compiled(True) is True


@compiled
@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ((np.zeros(16, np.float32), 12, np.empty(2, np.uint8), 0), ValueError, "multiple of 8"),
        ((np.zeros(16, np.float32), 16384, np.empty(2, np.uint8), 0), ValueError, "from 8 to 8192"),
        ((np.zeros(17, np.float32), 8, np.empty(2, np.uint8), 0), ValueError, "need 3 bytes"),
        ((np.zeros(16, np.float32), 8, np.empty(4, np.uint8), 3), ValueError, "from offset 3"),
        ((np.zeros(16, np.float64), 8, np.empty(4, np.uint8), 0), TypeError, "float32"),
        ((np.zeros(16, np.float32), 8, bytes(4), 0), BufferError, "writable"),
    ],
)
def test_bad_arguments_raise_before_anything_is_written(
    arguments: tuple[object, ...], error: type[Exception], message: str
) -> None:
    sums = np.zeros(8, np.float32)
    with pytest.raises(error, match=message):
        _bitpack.pack(*arguments, sums, 0)


@pytest.mark.parametrize("enabled", [True, False])
def test_gather_rows_copies_each_rows_bytes(enabled: bool) -> None:
    # sources of different lengths, read from different offsets into rows of a wider array
    sources = [np.arange(k, k + 40, dtype=np.uint8) for k in (0, 100, 200)]
    starts = np.array([3, 0, 30], dtype=np.int64)
    out = np.full((3, 12), 7, dtype=np.uint8)
    previous = bitdelta.use_compiled(enabled)
    try:
        bitdelta.gather_rows(sources, starts, out[:, :10])
    finally:
        bitdelta.use_compiled(previous)
    assert out[:, :10].tolist() == [
        list(range(3, 13)),
        list(range(100, 110)),
        list(range(230, 240)),
    ]
    assert (out[:, 10:] == 7).all()  # nothing past the count


@compiled
def test_gather_refuses_bytes_outside_a_source() -> None:
    out = np.empty((2, 8), dtype=np.uint8)
    sources = [bytes(16), bytes(10)]
    with pytest.raises(ValueError, match=r"bytes \[4, 12\) lie outside source 1"):
        _bitpack.gather(sources, np.array([0, 4], dtype=np.int64), 8, out)
    with pytest.raises(ValueError, match="starts"):
        _bitpack.gather(sources, np.array([0, 4], dtype=np.int32), 8, out)
