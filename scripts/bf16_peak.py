"""This CPU's peak rate of bf16 dot products (VDPBF16PS on 512-bit registers, AVX-512 BF16), the
roofline that the bf16 GEMMs and the 4-bit tile kernels are measured against: a C++ loop of
independent VDPBF16PS (16 accumulators, no memory operands) on 1 and 2 OpenMP threads, compiled
with the system's g++ into a temporary folder. Prints GFLOP/s (2 per multiply-add).

    .venv/bin/python scripts/bf16_peak.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <omp.h>
int main(int argc, char** argv) {
  const int threads = std::atoi(argv[1]);
  const long iters = 20000000;
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
    {
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_ps(i);
      __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80 + omp_get_thread_num());
      const __m512bh b = (__m512bh)_mm512_set1_epi32(0x3f803f81);
      for (long it = 0; it < iters; ++it) {
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
        __asm__ volatile("" : "+v"(a));  // a stays in a register, the loop is not folded
      }
      float s = 0;
      for (int i = 0; i < 16; ++i) s += _mm512_reduce_add_ps(acc[i]);
      if (s == 1.234f) std::printf("%f", s);
    }
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double flops = 64.0 * 16 * iters * threads;  // 32 multiply-adds per instruction
    if (flops / sec > best) best = flops / sec;
  }
  std::printf("%d thread(s): %.1f GFLOP/s\n", threads, best / 1e9);
}
"""


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "peak.cpp", Path(tmp) / "peak"
        src.write_text(SOURCE)
        try:
            build = subprocess.run(["g++", "-O3", "-funroll-loops", "-march=native", "-fopenmp", str(src), "-o",
                                    str(exe)], capture_output=True, text=True)
        except FileNotFoundError:
            sys.exit("no g++ here")
        if build.returncode != 0:
            lines = build.stderr.strip().splitlines()
            sys.exit(f"no AVX-512 BF16 build here: {lines[-1] if lines else 'g++ failed'}")
        for threads in (1, 2):
            print(subprocess.run([str(exe), str(threads)], capture_output=True, text=True, check=True).stdout, end="")


if __name__ == "__main__":
    main()
