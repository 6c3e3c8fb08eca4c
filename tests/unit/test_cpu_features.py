"""Which oneDNN kernel a bf16 model's GEMMs actually run, on each CPU family (asked of oneDNN's
verbose log, in a child process). The AMX and AVX512-BF16 checks skip, with the reason, on CPUs
that lack those instructions: their kernels cannot run there."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedllm.cpu_features import matmul_dtype, native_bf16

AMX = bool(torch.cpu._is_amx_tile_supported())
AVX512_BF16 = bool(torch.cpu._is_avx512_bf16_supported())

# the engine's choice for a bf16 model: Linear.prepack(matmul_dtype(bfloat16)), then a 64-row step
SCRIPT = """
import torch
from pagedllm.cpu_features import matmul_dtype
from pagedllm.models.quantized_linear import Linear
lin = Linear(512, 256, bias=False).to(torch.bfloat16)
assert lin.prepack(matmul_dtype(torch.bfloat16))
print("out dtype", lin.forward(torch.randn(64, 512).bfloat16()).dtype)
"""


def gemm_kernel() -> tuple[str, str]:
    """(implementation, source data type) of the inner product oneDNN ran for the 64-row step."""
    env = {**os.environ, "ONEDNN_VERBOSE": "1"}
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "out dtype torch.bfloat16" in r.stdout
    (line,) = [ln for ln in r.stdout.splitlines() if ",exec," in ln and ",inner_product," in ln]
    fields = line.split(",")
    implementation = fields[fields.index("inner_product") + 1]
    source = next(f for f in line.split() if "src:" in f).split("src:")[1].split(":")[0]
    return implementation, source


def test_matmul_dtype_follows_the_cpu_flags():
    assert native_bf16() == (AMX or AVX512_BF16)
    assert matmul_dtype(torch.bfloat16) == (torch.bfloat16 if native_bf16() else torch.float32)
    assert matmul_dtype(torch.float32) == torch.float32


@pytest.mark.skipif(native_bf16(), reason="this CPU has native bf16 GEMMs (AVX512-BF16 or AMX): nothing is widened")
def test_without_native_bf16_the_gemm_is_onednns_float32_kernel():
    implementation, source = gemm_kernel()
    assert source == "f32" and implementation.startswith("brg"), (implementation, source)


@pytest.mark.skipif(not AMX, reason="this CPU has no AMX (amx_bf16): oneDNN's AMX kernels cannot run here")
def test_on_amx_cpus_the_bf16_gemm_runs_onednns_amx_kernel():
    implementation, source = gemm_kernel()
    assert source == "bf16" and "amx" in implementation, (implementation, source)


@pytest.mark.skipif(AMX or not AVX512_BF16, reason="needs AVX512-BF16 without AMX (an AMD EPYC, or an older Xeon)")
def test_on_avx512_bf16_cpus_the_bf16_gemm_runs_a_native_bf16_kernel():
    implementation, source = gemm_kernel()
    assert source == "bf16" and "bf16" in implementation, (implementation, source)
