"""What this CPU computes natively, and so which kernels the engine may run on it.

``CpuFeatures`` holds the facts, read once per process (``current()``): the instruction-set flags
of /proc/cpuinfo (x86 ``flags``, Arm ``Features``), or torch's own CPUID answers where there is
no such file. Its properties say what each kernel needs, so a path this CPU lacks is never tried
and then caught:

=========================  =================================================================
``onednn_packs(dtype)``    oneDNN's prepacked weights (``_reorder_linear_weight``): float32 on any
                           x86 CPU with AVX2; bfloat16 needs AVX512-BW/VL/DQ or AVX-NE-CONVERT,
                           float16 AVX512-FP16 or AVX-NE-CONVERT (oneDNN's own requirements,
                           torch 2.13: elsewhere it refuses)
``native_bf16``            bf16 dot products (AVX512-BF16 or AMX-BF16): bf16 GEMMs at or above
                           float32's speed; without them oneDNN converts in its inner loop
``native_fp16``            AMX-FP16 tiles
``int4_matmul``            torch's ``_weight_int4pack_mm_for_cpu`` (AVX-512 and AVX2 code, a
                           scalar loop elsewhere): every CPU
=========================  =================================================================

``family`` names the CPU's class in one word (``amx``, ``avx512_bf16``, ``avx512``, ``avx2``,
``sve``, ``neon``, ``baseline``); ``for_family`` builds a typical CPU of a family, which tests
force through ``current`` to check every family's choices on any machine.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

FAMILIES = ("amx", "avx512_bf16", "avx512", "avx2", "sve", "neon", "baseline")

# What each family's CPUs have, as /proc/cpuinfo spells it (the features the properties read)
_AVX2 = ("avx", "avx2", "fma", "f16c")
_AVX512 = (*_AVX2, "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni")
_FAMILY_FLAGS = {
    "amx": (*_AVX512, "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"),
    "avx512_bf16": (*_AVX512, "avx512_bf16"),
    "avx512": _AVX512,
    "avx2": _AVX2,
    "sve": ("asimd", "sve"),
    "neon": ("asimd",),
    "baseline": (),
}
_ARM_FAMILIES = ("sve", "neon")


@dataclass(frozen=True)
class CpuFeatures:
    """The instruction-set facts of one CPU (``flags`` as /proc/cpuinfo names them)."""

    arch: str                 # "x86_64", "aarch64", ...
    flags: frozenset[str]

    def has(self, *names: str) -> bool:
        return all(n in self.flags for n in names)

    @property
    def x86(self) -> bool:
        return self.arch in ("x86_64", "amd64", "AMD64")

    @property
    def avx2(self) -> bool:
        return self.x86 and self.has("avx2", "fma")

    @property
    def avx512(self) -> bool:
        return self.x86 and self.has("avx512f", "avx512bw", "avx512vl", "avx512dq")

    @property
    def native_bf16(self) -> bool:
        """AVX512-BF16 dot products or AMX-BF16 tiles: bf16 GEMMs run at (or above) float32's speed."""
        return self.x86 and (self.has("avx512_bf16") or self.has("amx_bf16"))

    @property
    def native_fp16(self) -> bool:
        """AMX-FP16 tiles: float16 GEMMs without converting to float32 first."""
        return self.x86 and self.has("amx_fp16")

    @property
    def int4_matmul(self) -> bool:
        """torch's int4 matmul has AVX-512, AVX2 and NEON bodies and a scalar one: every CPU runs it."""
        return True

    def onednn_packs(self, dtype: torch.dtype) -> bool:
        """Whether oneDNN prepacks a weight of ``dtype`` here (see the module docstring)."""
        if not self.avx2:
            return False
        if dtype == torch.float32:
            return True
        if dtype == torch.bfloat16:
            return self.avx512 or self.has("avx_ne_convert")
        if dtype == torch.float16:
            return self.has("avx512_fp16") or self.has("avx_ne_convert")
        return False

    @property
    def family(self) -> str:
        if self.x86:
            if self.has("amx_bf16"):
                return "amx"
            if self.avx512:
                return "avx512_bf16" if self.native_bf16 else "avx512"
            return "avx2" if self.avx2 else "baseline"
        if self.has("sve"):
            return "sve"
        return "neon" if self.has("asimd") else "baseline"

    def describe(self) -> str:
        """``avx2 (avx2 fma f16c, no avx512/amx)``: the family and the flags that chose it."""
        shown = " ".join(sorted(f for f in self.flags if f.startswith(("avx2", "avx512", "amx", "fma", "avx_ne", "sve"))
                                or f == "asimd")) or "no vector extensions"
        if self.x86 and not self.avx512:
            shown += "; no avx512/amx"
        return f"{self.family} ({shown})"

    def runs_kernels_of(self, other: CpuFeatures) -> bool:
        """Whether every oneDNN packing ``other`` would choose also works here: a family forced in a
        test must not ask this CPU's oneDNN for a layout it refuses (our C++ kernels are compiled
        for the real CPU, and oneDNN emulates bf16 GEMMs where the CPU lacks them)."""
        return all(self.onednn_packs(d) or not other.onednn_packs(d)
                   for d in (torch.float32, torch.bfloat16, torch.float16))

    @classmethod
    def for_family(cls, family: str) -> CpuFeatures:
        """A typical CPU of ``family`` (one of ``FAMILIES``), for tests that force ``current``."""
        if family not in _FAMILY_FLAGS:
            raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
        arch = "aarch64" if family in _ARM_FAMILIES else "x86_64"
        return cls(arch, frozenset(_FAMILY_FLAGS[family]))


def _torch_flags() -> frozenset[str]:
    """The flags torch's CPUID reading vouches for (where /proc/cpuinfo is not there)."""
    cpu = torch.cpu
    answers = {
        ("avx2", "fma"): cpu._is_avx2_supported(),
        ("avx512f", "avx512bw", "avx512vl", "avx512dq"): cpu._is_avx512_supported(),
        ("avx512_bf16",): cpu._is_avx512_bf16_supported(),
        ("avx512_vnni",): cpu._is_vnni_supported(),
        ("amx_tile", "amx_bf16"): cpu._is_amx_tile_supported(),
        ("amx_fp16",): cpu._is_amx_fp16_supported(),
    }
    return frozenset(f for names, yes in answers.items() if yes for f in names)


@functools.cache
def detect() -> CpuFeatures:
    """This machine's CPU: /proc/cpuinfo's first processor, else torch's CPUID answers; passing for
    a smaller family where ``PAGEDLLM_CPU_FAMILY`` says so (``build_record.as_family``)."""
    from pagedllm.build_record import as_family, cpu_isa_flags, emulated_family

    arch = platform.machine()
    try:
        flags = cpu_isa_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        flags = frozenset()
    if not flags and arch in ("x86_64", "AMD64"):
        flags = _torch_flags()
    return CpuFeatures(arch, as_family(flags, emulated_family()))


def current() -> CpuFeatures:
    """The CPU the engine chooses its kernels for (tests replace this to force a family)."""
    return detect()


def native_bf16() -> bool:
    return current().native_bf16


def native_fp16() -> bool:
    return current().native_fp16


def matmul_dtype_for(cpu: CpuFeatures, dtype: torch.dtype) -> torch.dtype:
    """The dtype CPU GEMMs should compute in, on ``cpu``, for weights and activations stored in ``dtype``.

    Without native bf16/fp16 dot products, oneDNN's bf16 GEMM converts inside its inner loop and
    runs several times slower than float32 (figures: docs/design.md). Products of bf16 or fp16 values are exact in
    float32, so computing there and rounding the result once is what a native kernel does too,
    up to the order of the float32 sum."""
    if dtype == torch.bfloat16 and not cpu.native_bf16:
        return torch.float32
    if dtype == torch.float16 and not cpu.native_fp16:
        return torch.float32
    return dtype


def matmul_dtype(dtype: torch.dtype) -> torch.dtype:
    """``matmul_dtype_for`` this machine's CPU."""
    return matmul_dtype_for(current(), dtype)
