"""Build of the optional C extensions; the package's metadata is in pyproject.toml.

`zoo_gym.compression._bitpack` packs BitDelta signs and group sums of |x| in one pass on the
CPU; `zoo_gym.aggregation._orderstat` computes the coordinate-wise median and trimmed mean of
column chunks with sorting networks on the CPU. Both are optional: without a C compiler the
build goes on without them and `zoo_gym.compression.bitdelta` packs with numpy and torch, and
`zoo_gym.aggregation._select` sorts with NumPy, instead (the same results, slower). Never build
these two with -ffast-math: their sums must be added in torch.sum's order.
`zoo_gym.aggregation._passes` sums rows (in float64, in order: the same bits as NumPy's path),
forms the shifted Gram products of up to 160 updates with AVX-512 (to rounding, as the GEMM
does), and the distances and sums of BitDelta rows from their sign bits; without it NumPy and
torch's GEMM run instead on decoded values; the same flags.
`zoo_gym.serving._binary_gemm` computes the 1-bit products of BitDelta variants with a batch's
rows on the CPU; without it `zoo_gym.serving.binary` decodes each variant's weights in torch.
It runs its threads as an OpenMP team where the compiler has OpenMP (the team of torch's own
libgomp once torch is loaded), POSIX threads of its own otherwise.
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError, LinkError

OPENMP = ["-fopenmp"]


class BuildExt(build_ext):
    """Builds each extension asking for OpenMP once more without it where the compiler
    lacks it (Apple's clang)."""

    def build_extension(self, ext: Extension) -> None:
        if not set(OPENMP) & set(ext.extra_compile_args):
            super().build_extension(ext)
            return
        try:
            super().build_extension(ext)
        except (CompileError, LinkError) as exc:
            self.warn(f"{ext.name} without OpenMP: {exc}")
            ext.extra_compile_args = [a for a in ext.extra_compile_args if a not in OPENMP]
            ext.extra_link_args = [a for a in ext.extra_link_args if a not in OPENMP]
            super().build_extension(ext)


setup(
    ext_modules=[
        Extension(
            "zoo_gym.compression._bitpack",
            sources=["zoo_gym/compression/_bitpack.c"],
            extra_compile_args=["-O3", "-ffp-contract=off"],
            optional=True,
        ),
        Extension(
            "zoo_gym.aggregation._orderstat",
            sources=["zoo_gym/aggregation/_orderstat.c"],
            depends=["zoo_gym/core/_bits.h", "zoo_gym/core/_floats.h"],
            extra_compile_args=["-O3", "-ffp-contract=off"],
            optional=True,
        ),
        Extension(
            "zoo_gym.aggregation._passes",
            sources=["zoo_gym/aggregation/_passes.c"],
            depends=["zoo_gym/core/_bits.h", "zoo_gym/core/_floats.h"],
            extra_compile_args=["-O3", "-ffp-contract=off"],
            optional=True,
        ),
        Extension(
            "zoo_gym.serving._binary_gemm",
            sources=["zoo_gym/serving/_binary_gemm.c"],
            depends=["zoo_gym/core/_floats.h"],
            extra_compile_args=["-O3", *OPENMP],
            extra_link_args=OPENMP,
            optional=True,
        ),
    ],
    cmdclass={"build_ext": BuildExt},
)
