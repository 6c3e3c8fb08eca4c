"""Which matmul kernels a model runs on this CPU family: one plan, chosen from ``cpu_features``.

A projection of a CPU model has a dense kernel (for prefill and big batches) and, with
``quantization="gguf"``, a weight-only kernel over the GGUF's own blocks for steps of at most a
few rows (``quantized_linear``). ``plan_kernels`` decides, from what the CPU has, never by
trying and catching:

- ``compute``: the dtype the dense GEMMs run in (``cpu_features.matmul_dtype``): float32 for a
  bf16/fp16 model on a CPU without native bf16/fp16 dot products (3-4x faster than oneDNN's
  emulated bf16 GEMM there);
- ``pack``: whether the dense weights are kept in oneDNN's blocked layout (only where oneDNN packs
  that dtype on this CPU; float32 models keep MKL's sgemm on the plain weight, as HF does);
- ``dense_kernel``: ``onednn`` (the above), or ``panels``: on the AVX2 family a widened model's
  float32 weights are kept as panels for our own GEMM (``csrc/panel_gemm.h``), 1.2-1.5x oneDNN's
  float32 rate there from 32 rows (session 15 figures below);
- ``int4_rows`` / ``q8_0_rows``: up to how many rows the 4-bit and Q8_0 kernels beat the dense
  GEMM, per family (measured with ``pagedllm bench matmul``; docs/benchmarks.md);
- ``head``: what a 1-row LM head runs where the Q8_0 kernel does not: the bf16 weight packed
  natively (AVX-512 without BF16: half float32's bytes), else the dense kernel.

The crossovers, measured with weights streaming from DRAM as in the engine:
AVX-512 with BF16 (bf16 GEMMs): 4-bit and Q8_0 up to 8 rows (decode at batch 2/4/8 1.76x /
1.37x / 1.05x faster than the prepacked bf16 weights). AMX (Xeon with AMX-BF16, 2 cores, session
12), a bf16 model: the 4-bit kernel at 1 row only and never the Q8_0 head. ``bench matmul``: per
layer 0.097 (4-bit) vs 0.118 ms (packed bf16) at 1 row, 0.118 vs 0.122 at 2, 0.311 vs 0.129 at
8; the head 6.4 ms (Q8_0) vs 1.26 (packed bf16) at 1 row. ``scripts/int4_kernel_ab.py torch ROWS
BATCH Q8_ROWS``, ms per step, two rounds: batch 1 13.8 / 13.6 with (8, 8) against 8.8 / 8.7 with
(1, 0); batch 8 68.0 / 67.5 against 22.0 / 21.9. (A float32 model there keeps (8, 8): unmeasured.)
There ``step_tokens`` is 2,048, not 1,024: oneDNN's AMX bf16 GEMM (``brg_matmul:avx10_1_512_amx``)
runs the down projection (K 1,536, N 576) at 1.2-1.5 TF/s from 512 to 1,280 rows and 2.5-2.7 from
2,048, and qkv (K 576, N 960) at 1.4 for 768-1,024 rows against 2.6-3.0 at 1,040 and above (two
rounds of ``scripts/gemm_rows.py``, session 13); an 8x1024 prefill's GEMMs took 1.07 ms a call
in 1,024-token steps against 0.72-0.82 per 1,024 rows in 4,096-token ones (two runs)
(``scripts/step_budget_ab.py profile 1024`` / ``4096``). ``scripts/step_budget_ab.py
1024,2048,4096`` (one process, budgets alternating; two rounds, tok/s, 1,024 / 2,048 / 4,096):
prefill 32x128 4495, 3845 / 5621, 5679 / 5810, 5869; 8x1024 3187, 3796 / 4200, 4486 / 4239, 4278;
decode x64 835, 850 / 887, 899 / 906, 871; x8 323, 346 / 336, 355 / 340, 365. 2,048 is vLLM's
server default on CPU (its offline one is 4,096): a step's length, so the longest pause a running
stream sees while others prefill, doubles, not quadruples.
AVX-512 without BF16 (float32 GEMMs): the
4-bit kernel up to 16 rows (34 vs 41 ms at 16, 80 vs 60 ms at 32 over 30 layers), the Q8_0 head
never (8.9 vs 6.8 ms at 1 row) but the natively packed bf16 head at 1 row (4.6 vs 6.2 ms).
AVX2 without AVX-512 (float32 GEMMs; AMD EPYC 7B13, 2 cores): our C++ 4-bit kernel
(``int4_kernel="cpp"``) up to 16 rows. Per layer, hot, it takes 0.31 / 0.98 / 1.76 ms at 1 / 8 /
16 rows; torch's takes 0.34 / 1.24 / 2.41 and the packed float32 GEMM 0.74 / 1.02 / 1.48. In the
engine the float32 weights stream 4x the bytes: a batch-16 step takes 87-88 ms with the 4-bit
kernel against 94-123 ms dense, and batch 32 is even (168-186 ms either way). With torch's
kernel the crossover was 8 rows. The Q8_0 head runs up to 16 rows (2.6 vs 9.8 ms at 1 row, 6.7 vs
12.5 at 8). oneDNN packs no bf16 there. A float32 model there never runs the 4-bit kernel: with
float32 activations torch's int4 matmul is 7x slower than the dense GEMM. Ours takes float32
activations as they are, but that path is untimed in the engine.
The AVX2 panel GEMM (same EPYC, session 15, ``pagedllm bench matmul --rows 16,32,64,1024``, hot
weights, ms per layer): 0.81 vs oneDNN's prepacked float32 1.27 at 16 rows, 1.66 vs 2.08 at 32,
2.7 vs 3.4 at 64, 42.7 vs 47-50 at 1,024 (docs/benchmarks.md, "AVX2, session 15"). It is not used for float32
models (they keep MKL's sgemm on the plain weight, as HF does) nor on AVX-512, where oneDNN's
float32 GEMM has 512-bit kernels (unmeasured against panels).
The float32 crossovers on AVX-512 (8 rows) are those of the first engine, not re-measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.config import DEFAULT_STEP_TOKENS
from pagedllm.cpu_features import CpuFeatures, matmul_dtype_for


@dataclass(frozen=True)
class KernelPlan:
    family: str
    dtype: torch.dtype           # the model's dtype
    compute: torch.dtype         # the dense GEMMs' dtype
    pack: bool                   # dense weights in oneDNN's layout
    int4_rows: int               # 4-bit blocks for steps of at most this many rows (0: never)
    q8_0_rows: int               # Q8_0 blocks likewise
    native_head_rows: int        # a bf16-packed head for steps up to this many rows (where no Q8_0 head)
    int4_kernel: str = "torch"   # the 4-bit kernel: "torch" (its int4 matmul) or "cpp" (our q4_linear)
    step_tokens: int = DEFAULT_STEP_TOKENS  # the default token budget of a step (max_num_batched_tokens)
    dense_kernel: str = "onednn"  # "onednn" (packed per `pack`, or plain) or "panels" (the AVX2 panel GEMM)

    def __post_init__(self) -> None:
        if min(self.int4_rows, self.q8_0_rows, self.native_head_rows) < 0:
            raise ValueError("row crossovers must be >= 0")
        if self.step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1, got {self.step_tokens}")
        if self.int4_kernel not in ("torch", "cpp"):
            raise ValueError(f"int4_kernel must be 'torch' or 'cpp', got {self.int4_kernel!r}")
        if self.dense_kernel not in ("onednn", "panels"):
            raise ValueError(f"dense_kernel must be 'onednn' or 'panels', got {self.dense_kernel!r}")
        if self.dense_kernel == "panels" and not self.widened:
            raise ValueError("the panel GEMM runs widened bf16/fp16 models only")

    @property
    def widened(self) -> bool:
        """bf16/fp16 weights whose dense GEMMs compute in float32."""
        return self.compute == torch.float32 and self.dtype != torch.float32

    def describe(self) -> str:
        """``float32 GEMMs (widened), oneDNN-packed; GGUF blocks: int4 <= 8 rows, Q8_0 <= 16 rows``."""
        name = {torch.float32: "float32", torch.bfloat16: "bf16", torch.float16: "fp16"}
        dense = f"{name[self.compute]} GEMMs" + (" (widened)" if self.widened else "")
        if self.dense_kernel == "panels":
            dense += ", AVX2 panels"
        else:
            dense += ", oneDNN-packed" if self.pack else ", plain weights"
        int4 = "int4" if self.int4_kernel == "torch" else "int4 (C++)"
        small = [f"{kind} <= {rows} rows" for kind, rows in
                 ((int4, self.int4_rows), ("Q8_0", self.q8_0_rows), ("bf16 head", self.native_head_rows)) if rows]
        return dense + (f"; small steps: {', '.join(small)}" if small else "") + f"; steps of {self.step_tokens} tokens"


def plan_kernels(cpu: CpuFeatures, dtype: torch.dtype) -> KernelPlan:
    """The kernels a ``dtype`` model runs on ``cpu`` (see the module docstring for the figures)."""
    compute = matmul_dtype_for(cpu, dtype)
    widened = compute == torch.float32 and dtype != torch.float32
    # float32 models keep MKL's sgemm on the plain weight; fp16 ones are packed only when widened
    pack = cpu.onednn_packs(torch.float32) if widened else dtype == torch.bfloat16 and cpu.onednn_packs(dtype)
    if dtype == torch.float32 and not cpu.avx512:
        # torch's int4 kernel with float32 activations has no fast AVX2 body: 2.15 ms for gate_up at
        # 1 row against 0.15 with bf16 ones and 0.29 for the dense float32 GEMM (a one-off timing loop
        # on the AVX2 EPYC; bench matmul times the kernels with bf16 activations only)
        int4_rows, q8_0_rows, native_head = 0, 16, 0
    elif not widened and cpu.family == "amx" and dtype == torch.bfloat16:
        # AMX tiles make the packed bf16 GEMM win from 2 rows, and the bf16 head at every size
        int4_rows, q8_0_rows, native_head = 1, 0, 0
    elif not widened:
        int4_rows, q8_0_rows, native_head = 8, 8, 0
    elif cpu.avx512:
        int4_rows, q8_0_rows = 16, 0
        native_head = 1 if cpu.onednn_packs(dtype) else 0
    elif cpu.family == "avx2":  # our C++ 4-bit kernel; the Q8_0 head streams a quarter of float32's bytes
        int4_rows, q8_0_rows, native_head = 16, 16, 0
    else:  # narrower (neon, sve, baseline): torch's 4-bit kernel, the AVX2 crossovers otherwise (untested)
        int4_rows, q8_0_rows, native_head = 8, 16, 0
    # our C++ 4-bit kernel has an AVX2 body that beats torch's int4 kernel there; elsewhere torch's
    int4_kernel = "cpp" if cpu.family == "avx2" else "torch"
    # AMX tiles run oneDNN's bf16 GEMM at half speed below ~2,048 rows for some of the projections
    # (the module docstring): steps of 2,048 tokens prefill 15-40% faster there
    step_tokens = 2048 if not widened and cpu.family == "amx" and dtype == torch.bfloat16 else DEFAULT_STEP_TOKENS
    # our AVX2 float32 GEMM beats oneDNN's float32 one there (the module docstring)
    dense_kernel = "panels" if widened and cpu.family == "avx2" else "onednn"
    return KernelPlan(cpu.family, dtype, compute, pack, int4_rows, q8_0_rows, native_head, int4_kernel, step_tokens,
                      dense_kernel)
