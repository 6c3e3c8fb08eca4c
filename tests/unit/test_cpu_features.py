"""What the CPU has (``cpu_features``), what each family's engine chooses (``kernel_plan``), and
which oneDNN kernel a bf16 model's GEMMs actually run on this CPU (asked of oneDNN's verbose log,
in a child process). The choices are checked for every family on any machine, by forcing the
features; the AMX and AVX512-BF16 kernel checks skip, with the reason, on CPUs that lack them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedllm import cpu_features
from pagedllm.build_record import emulated_family
from pagedllm.cpu_features import FAMILIES, CpuFeatures, matmul_dtype, native_bf16
from pagedllm.models.kernel_plan import plan_kernels
from pagedllm.models.quantized_linear import Linear, prepack_for_onednn

EMULATED = emulated_family()


def cpuid(answer: bool, flag: str) -> bool:
    """torch's CPUID answer about ``flag``, less what ``PAGEDLLM_CPU_FAMILY`` hides from pagedllm."""
    return bool(answer) and not (EMULATED is not None and flag.startswith(EMULATED.drops))


AMX = cpuid(torch.cpu._is_amx_tile_supported(), "amx_tile")
AVX512_BF16 = cpuid(torch.cpu._is_avx512_bf16_supported(), "avx512_bf16")
HERE = cpu_features.detect()

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


def test_this_cpu_agrees_with_torchs_cpuid_answers():
    assert HERE.avx2 == bool(torch.cpu._is_avx2_supported())
    assert HERE.avx512 == cpuid(torch.cpu._is_avx512_supported(), "avx512f")
    assert HERE.native_bf16 == (AMX or AVX512_BF16)
    assert HERE.family in FAMILIES and HERE.family in HERE.describe()


CPUINFO_AVX2_EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse sse2 ssse3 fma cx16 sse4_1 sse4_2 avx f16c hypervisor avx2 bmi2 vaes
"""


def test_the_family_is_read_from_cpuinfo_flags():
    from pagedllm.build_record import cpu_isa_flags

    cpu = CpuFeatures("x86_64", cpu_isa_flags(CPUINFO_AVX2_EPYC))
    assert cpu.family == "avx2" and cpu.avx2 and not cpu.avx512 and not cpu.native_bf16
    assert cpu.describe() == "avx2 (avx2 fma; no avx512/amx)"
    arm = CpuFeatures("aarch64", cpu_isa_flags("Features\t: fp asimd evtstrm aes sve\n"))
    assert arm.family == "sve" and not arm.onednn_packs(torch.float32)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_packs_only_what_onednn_packs_there(family):
    """oneDNN's own requirements (torch 2.13): bf16 packing needs AVX512-BW/VL/DQ or AVX-NE-CONVERT,
    float32 packing AVX2; a family's typical CPU is built with exactly its flags."""
    cpu = CpuFeatures.for_family(family)
    assert cpu.family == family
    x86_avx512 = family in ("amx", "avx512_bf16", "avx512")
    assert cpu.onednn_packs(torch.bfloat16) == x86_avx512
    assert cpu.onednn_packs(torch.float32) == (x86_avx512 or family == "avx2")
    assert cpu.native_bf16 == (family in ("amx", "avx512_bf16"))
    assert CpuFeatures("x86_64", frozenset({"avx2", "fma", "avx_ne_convert"})).onednn_packs(torch.bfloat16)


# family -> (GEMM dtype of a bf16 model, packed, int4 rows, Q8_0 rows, bf16-packed 1-row head)
BF16_PLANS = {
    "amx": (torch.bfloat16, True, 1, 0, 0),
    "avx512_bf16": (torch.bfloat16, True, 64, 48, 0),
    "avx512": (torch.float32, True, 16, 0, 1),
    "avx2": (torch.float32, True, 16, 16, 0),
    "neon": (torch.float32, False, 8, 16, 0),
    "baseline": (torch.float32, False, 8, 16, 0),
}


@pytest.mark.parametrize("family", list(BF16_PLANS))
def test_each_family_gets_its_measured_kernel_plan(family):
    plan = plan_kernels(CpuFeatures.for_family(family), torch.bfloat16)
    assert (plan.compute, plan.pack, plan.int4_rows, plan.q8_0_rows, plan.native_head_rows) == BF16_PLANS[family]
    assert plan.widened == (plan.compute == torch.float32)
    fp32 = plan_kernels(CpuFeatures.for_family(family), torch.float32)
    assert fp32.compute == torch.float32 and not fp32.pack and not fp32.widened  # MKL's sgemm, as HF
    # float32 activations on our C++ 4-bit kernel up to 32 rows where it has a vector body (AVX2 steps
    # 2-5x faster than with the 4-bit blocks off, session 32); torch's int4 kernel with float32
    # activations, 7x slower than the dense GEMM on AVX2, never
    ours = family in ("amx", "avx512_bf16", "avx512", "avx2")
    assert (fp32.int4_rows, fp32.q8_0_rows) == ((32, 32) if ours else (0, 16))
    # our C++ 4-bit kernel where its AVX2 body beats torch's int4 one, and for float32 activations
    # wherever a float32 model runs 4-bit blocks (torch's took 10x as long per step on AVX-512 BF16);
    # torch's elsewhere, and our AVX-512 BF16 tile kernel for bf16 models with BF16 dot products (AMX
    # keeps torch's at 1 row)
    assert fp32.int4_kernel == ("cpp" if family in ("amx", "avx512_bf16", "avx512", "avx2") else "torch")
    # float16 activations likewise (torch's: 113 / 940 ms decode steps at batch 1 / 8 on AVX-512 BF16)
    fp16 = plan_kernels(CpuFeatures.for_family(family), torch.float16)
    assert fp16.int4_kernel == ("cpp" if family in ("amx", "avx512_bf16", "avx512", "avx2") else "torch")
    # quantization="int8": torch's int8 kernel for bf16 rows, our C++ Q8_0 kernel for float32/float16
    # ones on AVX-512 and AVX2 (torch's took 458 / 532 ms steps at batch 8 on AVX-512 BF16, 385 / 373
    # with the AVX2 builds, against 40 / 29 with ours)
    assert (fp32.int8_kernel, fp16.int8_kernel, plan.int8_kernel) == (("cpp", "cpp", "torch") if ours else
                                                                      ("torch", "torch", "torch"))
    assert plan.int4_kernel == {"avx2": "cpp", "avx512_bf16": "tiles"}.get(family, "torch")
    assert ("int4 (C++) <= 16 rows" in plan.describe()) == (family == "avx2")
    assert ("int4 (C++ BF16 tiles) <= 64 rows" in plan.describe()) == (family == "avx512_bf16")
    assert plan.q8_0_kernel == ("tiles" if family == "avx512_bf16" else "cpp") and fp32.q8_0_kernel == "cpp"
    assert ("Q8_0 (C++ BF16 tiles) <= 48 rows" in plan.describe()) == (family == "avx512_bf16")
    # steps of 2,048 tokens where AMX tiles run the bf16 GEMMs (measured there); 1,024 elsewhere
    assert plan.step_tokens == (2048 if family == "amx" else 1024) and fp32.step_tokens == 1024
    assert f"steps of {plan.step_tokens} tokens" in plan.describe()
    # the small-step kernels the engine's quantization runs, and only those
    assert "int4" not in plan.describe("none") and "int8" not in plan.describe("gguf")
    assert "Q8_0" not in plan.describe("awq") and "int4" not in plan.describe("int8")
    assert ("int8 (C++, Q8_0 blocks) <= 16 rows" in fp32.describe("int8")) == ours
    assert f"int8 <= {plan.int8_rows} rows" in plan.describe("int8")
    # our AVX2 panel GEMM for widened models on AVX2 only; float32 models keep MKL's sgemm
    assert plan.dense_kernel == ("panels" if family == "avx2" else "onednn") and fp32.dense_kernel == "onednn"
    assert ("AVX2 panels" in plan.describe()) == (family == "avx2")


@pytest.mark.parametrize("family", ["avx2", "baseline", "neon"])
def test_a_packing_the_cpu_lacks_is_never_asked_of_onednn(monkeypatch, family):
    """Where the features say oneDNN refuses, it is not called (and its refusal caught): a bf16
    layer widens into a plain float32 copy where even float32 is not packed, else into a packed one."""
    cpu = CpuFeatures.for_family(family)
    monkeypatch.setattr(cpu_features, "current", lambda: cpu)
    asked = []
    real = sys.modules["pagedllm.models.quantized_linear"]._REORDER

    def spy(weight, batch):
        asked.append(weight.dtype)
        return real(weight, batch)

    monkeypatch.setattr("pagedllm.models.quantized_linear._REORDER", spy)
    weight = torch.randn(32, 64).bfloat16()
    assert prepack_for_onednn(weight) is None and asked == []  # no bf16 packing on any of these
    lin = Linear(64, 32, bias=True).to(torch.bfloat16)
    w32, b32 = lin.weight.detach().float(), lin.bias.detach().float()
    assert lin.prepack(torch.float32) and lin.widen == torch.float32 and lin.weight is None
    assert asked == ([torch.float32] if family == "avx2" else [])
    assert (lin.packed is not None) == (family == "avx2") and (lin.wide_weight is not None) == (family != "avx2")
    x = torch.randn(5, 64).bfloat16()
    with torch.no_grad():
        y = lin(x)
    assert y.dtype == torch.bfloat16
    exact = torch.nn.functional.linear(x.float(), w32, b32)
    torch.testing.assert_close(y.float(), exact, rtol=2**-8, atol=1e-3)



@pytest.mark.skipif(native_bf16(), reason=f"this CPU ({HERE.describe()}) has native bf16 GEMMs: nothing is widened")
def test_without_native_bf16_the_gemm_is_onednns_float32_kernel():
    implementation, source = gemm_kernel()
    assert source == "f32" and implementation.startswith("brg"), (implementation, source)


@pytest.mark.skipif(not AMX, reason=f"this CPU ({HERE.describe()}) has no AMX: oneDNN's AMX kernels cannot run here")
def test_on_amx_cpus_the_bf16_gemm_runs_onednns_amx_kernel():
    implementation, source = gemm_kernel()
    assert source == "bf16" and "amx" in implementation, (implementation, source)


@pytest.mark.skipif(AMX or not AVX512_BF16,
                    reason=f"needs AVX512-BF16 without AMX (an AMD EPYC, an older Xeon); this CPU: {HERE.describe()}")
def test_on_avx512_bf16_cpus_the_bf16_gemm_runs_a_native_bf16_kernel():
    implementation, source = gemm_kernel()
    assert source == "bf16" and "bf16" in implementation, (implementation, source)


@pytest.mark.parametrize(("family", "expected"), [("amx", "bfloat16"), ("avx512_bf16", "bfloat16"),
                                                   ("avx512", "bfloat16"), ("avx2", "bfloat16"),
                                                   ("neon", "float32"), ("baseline", "float32")])
def test_auto_dtype_is_the_familys_fastest(monkeypatch, family, expected):
    """bf16 on every x86 family with AVX2 or more (its GEMMs widened to float32 where the CPU lacks
    bf16 dot products, measured faster at 1-32 requests on AVX2, docs/benchmarks.md); float32 where
    nothing has been measured. An explicit dtype is kept, and CUDA is always bf16."""
    from pagedllm.models.loader import resolve_dtype

    monkeypatch.setattr(cpu_features, "current", lambda: CpuFeatures.for_family(family))
    assert resolve_dtype("auto", "cpu") == expected
    assert resolve_dtype("float32", "cpu") == "float32" and resolve_dtype("auto", "cuda") == "bfloat16"
