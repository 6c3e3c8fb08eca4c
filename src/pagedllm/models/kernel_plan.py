"""Which matmul kernels a model runs on this CPU family: one plan, chosen from ``cpu_features``.

A projection of a CPU model has a dense kernel (for prefill and big batches) and, with
``quantization="gguf"``, a weight-only kernel over the GGUF's own blocks for steps of at most a
few rows (``quantized_linear``). ``plan_kernels`` decides, from what the CPU has, never by
trying and catching:

- ``compute``: the dtype the dense GEMMs run in (``cpu_features.matmul_dtype``): float32 for a
  bf16/fp16 model on a CPU without native bf16/fp16 dot products (faster than oneDNN's
  emulated bf16 GEMM there);
- ``pack``: whether the dense weights are kept in oneDNN's blocked layout (only where oneDNN packs
  that dtype on this CPU; float32 models keep MKL's sgemm on the plain weight, as HF does);
- ``dense_kernel``: ``onednn`` (the above), or ``panels``: on the AVX2 family a widened model's
  float32 weights are kept as panels for our own GEMM (``csrc/panel_gemm.h``), faster than oneDNN's
  float32 GEMM there from 16 rows;
- ``int4_rows`` / ``q8_0_rows``: up to how many rows the 4-bit and Q8_0 kernels beat the dense
  GEMM, per family (measured with ``pagedllm bench matmul``; docs/benchmarks.md);
- ``head``: what a 1-row LM head runs where the Q8_0 kernel does not: the bf16 weight packed
  natively (AVX-512 without BF16: half float32's bytes), else the dense kernel.
- ``int8_kernel``: ``quantization="int8"``'s small-step kernel: torch's weight-only int8 matmul, or
  on AVX-512 and AVX2 for float32/float16 models our C++ Q8_0 kernel (torch's is fast with bf16 rows
  only).

The crossovers and budgets per family (the figures that chose them, with machines and commands:
docs/design.md, "Figures behind the code's choices"): AVX-512 with BF16: a bf16 model's 4-bit and
Q8_0 blocks on our tile kernels (``csrc/bf16_tiles.h``, VDPBF16PS) up to 64 and 48 rows. Every AVX-512
family and AVX2 (measured on AVX-512 BF16, and with the AVX2 builds there): a float32 model's on
our C++ 4-bit and Q8_0 kernels up to 32 rows; a float16 model's 4-bit blocks on our C++ kernel too
(torch's int4 kernel is fast with bf16 activations only), and ``quantization="int8"``'s float32 and
float16 rows on our C++ Q8_0 kernel. AMX: a bf16 model runs the 4-bit kernel at 1 row only and
never the Q8_0 head; ``step_tokens`` 2,048. AVX-512 without BF16: the 4-bit kernel up to 16 rows,
the natively packed bf16 head at 1 row. AVX2 without AVX-512: a bf16/fp16 model's blocks on our
C++ 4-bit kernel and the Q8_0 head up to 16 rows, the panel GEMM for its widened dense weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.config import DEFAULT_STEP_TOKENS
from pagedllm.cpu_features import CpuFeatures, matmul_dtype_for

DEFAULT_INT8_ROWS = 16
INT4_KERNELS = ("torch", "cpp", "tiles")


@dataclass(frozen=True)
class KernelPlan:
    family: str
    dtype: torch.dtype           # the model's dtype
    compute: torch.dtype         # the dense GEMMs' dtype
    pack: bool                   # dense weights in oneDNN's layout
    int4_rows: int               # 4-bit blocks for steps of at most this many rows (0: never)
    q8_0_rows: int               # Q8_0 blocks likewise
    native_head_rows: int        # a bf16-packed head for steps up to this many rows (where no Q8_0 head)
    int4_kernel: str = "torch"   # the 4-bit kernel: "torch" (its int4 matmul), "cpp" (our q4_linear) or
    #                              "tiles" (our AVX-512 BF16 q4_tiles_linear, bfloat16 models)
    step_tokens: int = DEFAULT_STEP_TOKENS  # the default token budget of a step (max_num_batched_tokens)
    dense_kernel: str = "onednn"  # "onednn" (packed per `pack`, or plain) or "panels" (the AVX2 panel GEMM)
    int8_rows: int = DEFAULT_INT8_ROWS  # quantization="int8": its int8 kernel up to this many rows
    q8_0_kernel: str = "cpp"     # the Q8_0 kernel: "cpp" (our q8_0_linear) or "tiles" (q8_0_tiles_linear)
    int8_kernel: str = "torch"   # quantization="int8": "torch" (its weight-only int8 matmul) or "cpp" (our
    #                              q8_0_linear, the channel's scale on every 32-input block)

    def __post_init__(self) -> None:
        if min(self.int4_rows, self.q8_0_rows, self.native_head_rows, self.int8_rows) < 0:
            raise ValueError("row crossovers must be >= 0")
        if self.step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1, got {self.step_tokens}")
        if self.int4_kernel not in INT4_KERNELS:
            raise ValueError(f"int4_kernel must be one of {INT4_KERNELS}, got {self.int4_kernel!r}")
        if self.q8_0_kernel not in ("cpp", "tiles"):
            raise ValueError(f"q8_0_kernel must be 'cpp' or 'tiles', got {self.q8_0_kernel!r}")
        if self.int8_kernel not in ("torch", "cpp"):
            raise ValueError(f"int8_kernel must be 'torch' or 'cpp', got {self.int8_kernel!r}")
        if "tiles" in (self.int4_kernel, self.q8_0_kernel) and self.dtype != torch.bfloat16:
            raise ValueError("the tile kernels take bfloat16 rows only")
        if self.dense_kernel not in ("onednn", "panels"):
            raise ValueError(f"dense_kernel must be 'onednn' or 'panels', got {self.dense_kernel!r}")
        if self.dense_kernel == "panels" and not self.widened:
            raise ValueError("the panel GEMM runs widened bf16/fp16 models only")

    @property
    def widened(self) -> bool:
        """bf16/fp16 weights whose dense GEMMs compute in float32."""
        return self.compute == torch.float32 and self.dtype != torch.float32

    def describe(self, quantization: str = "gguf") -> str:
        """``float32 GEMMs (widened), oneDNN-packed; small steps: int4 <= 8 rows, Q8_0 <= 16 rows; ...``:
        the small-step kernels that ``quantization`` (the engine's, resolved) runs: the 4-bit and
        Q8_0 ones for ``gguf`` / ``awq``, the int8 one for ``int8``, none of them for ``none``."""
        name = {torch.float32: "float32", torch.bfloat16: "bf16", torch.float16: "fp16"}
        dense = f"{name[self.compute]} GEMMs" + (" (widened)" if self.widened else "")
        if self.dense_kernel == "panels":
            dense += ", AVX2 panels"
        else:
            dense += ", oneDNN-packed" if self.pack else ", plain weights"
        int4 = {"torch": "int4", "cpp": "int4 (C++)", "tiles": "int4 (C++ BF16 tiles)"}[self.int4_kernel]
        q8_0 = "Q8_0 (C++ BF16 tiles)" if self.q8_0_kernel == "tiles" else "Q8_0"
        int8 = "int8 (C++, Q8_0 blocks)" if self.int8_kernel == "cpp" else "int8"
        kinds = {"gguf": ((int4, self.int4_rows), (q8_0, self.q8_0_rows)),
                 "awq": ((int4, self.int4_rows),), "int8": ((int8, self.int8_rows),)}.get(quantization, ())
        small = [f"{kind} <= {rows} rows" for kind, rows in (*kinds, ("bf16 head", self.native_head_rows)) if rows]
        return dense + (f"; small steps: {', '.join(small)}" if small else "") + f"; steps of {self.step_tokens} tokens"


def plan_kernels(cpu: CpuFeatures, dtype: torch.dtype) -> KernelPlan:
    """The kernels a ``dtype`` model runs on ``cpu`` (see the module docstring for the figures)."""
    compute = matmul_dtype_for(cpu, dtype)
    widened = compute == torch.float32 and dtype != torch.float32
    # float32 models keep MKL's sgemm on the plain weight; fp16 ones are packed only when widened
    pack = cpu.onednn_packs(torch.float32) if widened else dtype == torch.bfloat16 and cpu.onednn_packs(dtype)
    ours = cpu.avx512 or cpu.family == "avx2"  # x86 families where our C++ 4-bit kernel has a vector body
    if dtype == torch.float32 and not ours:
        # torch's int4 kernel with float32 activations has no fast body (on AVX2: 2.15 ms for gate_up
        # at 1 row against 0.15 with bf16 ones and 0.29 for the dense float32 GEMM)
        int4_rows, q8_0_rows, native_head = 0, 16, 0
    elif not widened and cpu.family == "amx" and dtype == torch.bfloat16:
        # AMX tiles make the packed bf16 GEMM win from 2 rows, and the bf16 head at every size
        int4_rows, q8_0_rows, native_head = 1, 0, 0
    elif not widened and cpu.family == "avx512_bf16" and dtype == torch.bfloat16:
        # our BF16 tile kernels (4.5 bits a weight streamed where the dense GEMM reads 16, the Q8_0 head
        # 8.5): decode steps of 32-64 rows ran 3-14% faster with them than with the dense GEMMs, but at
        # 64 rows only without the Q8_0 head (docs/design.md); speculation verifies up to 48 rows exactly
        int4_rows, q8_0_rows, native_head = 64, 48, 0
    elif dtype == torch.float32:
        # AVX-512 and AVX2 families: float32 activations on our C++ 4-bit and Q8_0 kernels, whose steps
        # of 12-32 rows ran 1.2-2.3x faster than the dense float32 GEMMs' (docs/design.md)
        int4_rows, q8_0_rows, native_head = 32, 32, 0
    elif not widened:
        int4_rows, q8_0_rows, native_head = 8, 8, 0
    elif cpu.avx512:
        int4_rows, q8_0_rows = 16, 0
        native_head = 1 if cpu.onednn_packs(dtype) else 0
    elif cpu.family == "avx2":  # our C++ 4-bit kernel; the Q8_0 head streams a quarter of float32's bytes
        int4_rows, q8_0_rows, native_head = 16, 16, 0
    else:  # narrower (neon, sve, baseline): torch's 4-bit kernel, the AVX2 crossovers otherwise (untested)
        int4_rows, q8_0_rows, native_head = 8, 16, 0
    # our C++ 4-bit kernel has an AVX2 body that beats torch's int4 kernel there, and on AVX-512 for
    # float32 and float16 activations (torch's is fast for bf16 ones only: 10x slower steps); with AVX-512
    # BF16 dot products, our tile kernel beats it for bfloat16 models, and its Q8_0 twin our float32
    # Q8_0 kernel (figures: docs/design.md, "Figures behind the code's choices"); elsewhere torch's
    tiles = cpu.family == "avx512_bf16" and dtype == torch.bfloat16 and not widened
    cpp = cpu.family == "avx2" or (dtype != torch.bfloat16 and cpu.avx512)
    int4_kernel = "cpp" if cpp else "tiles" if tiles else "torch"
    # torch's weight-only int8 kernel likewise: fast with bf16 activations only (docs/design.md)
    int8_kernel = "cpp" if dtype != torch.bfloat16 and ours else "torch"
    # AMX tiles run oneDNN's bf16 GEMM at half speed below ~2,048 rows for some of the projections
    # (the module docstring): steps of 2,048 tokens prefill 15-40% faster there
    step_tokens = 2048 if not widened and cpu.family == "amx" and dtype == torch.bfloat16 else DEFAULT_STEP_TOKENS
    # our AVX2 float32 GEMM beats oneDNN's float32 one there (the module docstring)
    dense_kernel = "panels" if widened and cpu.family == "avx2" else "onednn"
    return KernelPlan(cpu.family, dtype, compute, pack, int4_rows, q8_0_rows, native_head, int4_kernel, step_tokens,
                      dense_kernel, q8_0_kernel="tiles" if tiles else "cpp", int8_kernel=int8_kernel)
