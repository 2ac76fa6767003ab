"""Build of the optional C extension; the package's metadata is in pyproject.toml.

`zoo_gym.compression._bitpack` packs BitDelta signs and group sums of |x| in one pass on the
CPU. It is optional: without a C compiler the build goes on without it and
`zoo_gym.compression.bitdelta` packs with numpy and torch instead (the same bytes, slower).
Never build it with -ffast-math: the group sums must be added in torch.sum's order.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "zoo_gym.compression._bitpack",
            sources=["zoo_gym/compression/_bitpack.c"],
            extra_compile_args=["-O3", "-ffp-contract=off"],
            optional=True,
        )
    ]
)
