"""Every Triton kernel of the package compiles for the GPUs it serves, without one.

The kernel tests run in the Triton interpreter where there is no CUDA device, and the
interpreter takes code the compiler refuses (and runs some of it differently). This compiles
each kernel ahead of time, with each specialisation the package launches, to PTX and machine
code for Hopper (sm_90: H100, H200) and Ampere (sm_80: A100) with the `ptxas` that Triton ships,
and checks that its shared memory fits the chip. It runs in a process of its own: the kernels
must be decorated with the interpreter off.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from zoo_gym.compression.kernels import bitdelta_triton as bitdelta
from zoo_gym.serving import kernels as serving

ACCUMULATE = dict(
    x_ptr="*X", out_ptr="*X", rows_ptr="*i64", starts_ptr="*i64", bits_table="*i64",
    scales_table="*i64", scale_like="*S", N="i32", K="i32", group="i32", stride_x="i32",
    stride_out="i32", ROW_GROUPS="constexpr", IEEE="constexpr", BLOCK_M="constexpr",
    BLOCK_N="constexpr", BLOCK_K="constexpr",
)
ROWS = dict(
    out_ptr="*X", ids_ptr="*i64", rows_ptr="*i64", starts_ptr="*i64", bits_table="*i64",
    scales_table="*i64", scale_like="*S", cols="i32", group="i32", stride_out="i32",
    BLOCK="constexpr",
)
GEMV = dict(
    x_ptr="*X", out_ptr="*X", rows_ptr="*i64", starts_ptr="*i64", bits_table="*i64",
    scales_table="*i64", scale_like="*S", N="i32", group="i32", stride_x="i32",
    stride_out="i32", bias_ptr="*X", per_row="i32", ROW_WORDS="constexpr", BLOCK_N="constexpr",
    STEP="constexpr", HAS_BIAS="constexpr",
)
EXACT = {"enable_fp_fusion": False}
cases = []
for x, s in (("bf16", "fp16"), ("fp16", "bf16"), ("fp32", "fp32")):  # model, scales
    for row_groups in (True, False):
        sig = {k: v.replace("X", x).replace("S", s) for k, v in ACCUMULATE.items()}
        k = serving.WIDE_K if row_groups else serving.NARROW_K
        consts = dict(ROW_GROUPS=row_groups, IEEE=x == "fp32", BLOCK_M=serving.BLOCK_M,
                      BLOCK_N=serving.BLOCK_N, BLOCK_K=k)
        cases.append((serving._accumulate_kernel, sig, consts, {}))
    sig = {k: v.replace("X", x).replace("S", s) for k, v in ROWS.items()}
    cases.append((serving._rows_kernel, sig, dict(BLOCK=serving.ROWS_BLOCK), {}))
    sig = {k: v.replace("X", x).replace("S", s) for k, v in GEMV.items()}
    for bias, (block, warps) in zip((True, False), serving.GEMV_SHAPES):
        consts = dict(ROW_WORDS=28, BLOCK_N=block, STEP=serving.WIDE_K // 32, HAS_BIAS=bias)
        cases.append((serving._gemv_kernel, sig, consts, dict(num_warps=warps)))
for group in (8, 136):
    sig = dict(x_ptr="*fp32", bits_ptr="*u8", scale_ptr="*fp32", n="i64", n_groups="i64",
               GROUP="constexpr", ROWS="constexpr")
    cases.append((bitdelta._pack_kernel, sig, dict(GROUP=group, ROWS=bitdelta._PACK_ROWS), {}))
for accumulate in (True, False):
    sig = dict(bits_ptr="*u8", scale_ptr="*fp32", out_ptr="*fp32", n="i64", group="i32",
               weight="fp32", ACCUMULATE="constexpr", BLOCK="constexpr")
    consts = dict(ACCUMULATE=accumulate, BLOCK=bitdelta._BLOCK)
    cases.append((bitdelta._unpack_kernel, sig, consts, EXACT))
for w in ("fp32", "fp16", "bf16"):
    sig = dict(w_ptr="*" + w, bits_ptr="*u8", scale_ptr="*fp32", n="i64", group="i32",
               alpha="fp32", BF16="constexpr", BLOCK="constexpr")
    cases.append((bitdelta._apply_kernel, sig, dict(BF16=w == "bf16", BLOCK=bitdelta._BLOCK), EXACT))
done = []
for capability, shared in ((90, 232448), (80, 166912)):
    target = GPUTarget("cuda", capability, 32)
    for fn, sig, consts, options in cases:
        kernel = triton.compile(ASTSource(fn, sig, consts), target=target, options=options)
        assert kernel.metadata.shared <= shared, (fn.__name__, consts, kernel.metadata.shared)
        done.append(f"sm_{capability} {fn.__name__} {sorted(consts.items())}")
print(json.dumps(done))
"""


def test_every_kernel_compiles_for_hopper_and_ampere() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = os.environ.get("TRITON_CACHE_DIR", "") or "/tmp/zoo-gym-triton-aot"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(compiled) == 2 * (3 * 5 + 2 + 2 + 3)
    assert any("_accumulate_kernel" in c and "('ROW_GROUPS', True)" in c for c in compiled)
