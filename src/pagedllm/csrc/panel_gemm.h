// A float32 GEMM for CPUs with AVX2 and FMA but no AVX-512: y [M, N] = x [M, K] @ W^T + bias, with
// W held as panels of 16 output columns (``panels`` [ceil(N / 16), K, 16], K-major, zero-padded
// past N; models/quantized_linear.pack_panels makes them once at load).
//
// The micro-kernel keeps a 6 x 16 tile of y in 12 of AVX2's 16 registers: per k it loads the
// panel's 16 weights (2 registers), broadcasts x[i, k] for the 6 rows and does 12 FMAs, so each
// weight read from cache serves 6 rows and each activation 16 columns. Rows go in blocks of 96
// (their K-long activations stay in L2 while every panel passes), the (row block, panel) items
// are split over the threads. On the 2-core AVX2 EPYC (Zen 3) it runs 160-185 GFLOP/s from 32 rows
// where oneDNN's float32 GEMM, packed or not, runs 100-140 (docs/benchmarks.md, "AVX2, session
// 15"); the kernel plan picks it for widened bf16/fp16 models on the AVX2 family only.
//
// Numerics: each output is one float32 FMA chain over k in order (then + bias), so results differ
// from another float32 GEMM only by rounding order; the same call gives the same bits for a row
// whatever the other rows or the thread split (a row's sums never depend on them).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace panel_gemm {

constexpr int64_t kPanel = 16;     // output columns per panel
constexpr int kTileRows = 6;       // rows per micro-kernel call
constexpr int64_t kRowBlock = 96;  // rows whose activations stay in L2 while the panels pass

#if defined(__AVX2__) && defined(__FMA__)
// y[0..R) x [0..16) = x rows (stride ldx) . panel (K x 16), plus bias (16 floats, or null), into
// y (stride ldy). R is 1..6.
template <int R>
inline void tile(const float* x, int64_t ldx, const float* panel, int64_t K, const float* bias, float* y,
                 int64_t ldy) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  const float* x0 = x;
  const float* x1 = x + (R > 1 ? ldx : 0);
  const float* x2 = x + (R > 2 ? 2 * ldx : 0);
  const float* x3 = x + (R > 3 ? 3 * ldx : 0);
  const float* x4 = x + (R > 4 ? 4 * ldx : 0);
  const float* x5 = x + (R > 5 ? 5 * ldx : 0);
  // named accumulators, not arrays: GCC kept an array's 12 registers on the stack (3x slower)
#define PANEL_GEMM_ROW(i)                                      \
  if (R > i) {                                                 \
    const __m256 a = _mm256_broadcast_ss(x##i + k);            \
    c##i##0 = _mm256_fmadd_ps(a, w0, c##i##0);                 \
    c##i##1 = _mm256_fmadd_ps(a, w1, c##i##1);                 \
  }
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(panel + k * kPanel), w1 = _mm256_loadu_ps(panel + k * kPanel + 8);
    PANEL_GEMM_ROW(0) PANEL_GEMM_ROW(1) PANEL_GEMM_ROW(2) PANEL_GEMM_ROW(3) PANEL_GEMM_ROW(4) PANEL_GEMM_ROW(5)
  }
#undef PANEL_GEMM_ROW
  const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
#define PANEL_GEMM_STORE(i)                                               \
  if (R > i) {                                                            \
    _mm256_storeu_ps(y + i * ldy, bias ? _mm256_add_ps(c##i##0, b0) : c##i##0);     \
    _mm256_storeu_ps(y + i * ldy + 8, bias ? _mm256_add_ps(c##i##1, b1) : c##i##1); \
  }
  PANEL_GEMM_STORE(0) PANEL_GEMM_STORE(1) PANEL_GEMM_STORE(2) PANEL_GEMM_STORE(3) PANEL_GEMM_STORE(4)
  PANEL_GEMM_STORE(5)
#undef PANEL_GEMM_STORE
}

constexpr void (*kTiles[])(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t) = {
    tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};
#endif

inline bool available() {
#if defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

// x [M, K] (float32; another dtype is widened first) @ the panels' W^T (+ bias float32 [N]):
// float32 [M, N].
inline torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, std::optional<torch::Tensor> bias,
                                  int64_t N) {
  TORCH_CHECK(available(), "panel_linear needs AVX2 and FMA (this build has neither)");
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.scalar_type() == at::kFloat && panels.size(2) == kPanel,
              "expected x [M, K] and float32 panels [P, K, 16]");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  TORCH_CHECK(panels.size(1) == K && N > 0 && (N + kPanel - 1) / kPanel == P, "panels must be [ceil(N / 16), K, 16]");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N, "bias must be float32 [N]");
  }
  auto xf = x.to(at::kFloat).contiguous();
  panels = panels.contiguous();
  auto out = torch::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0) return out;
#if defined(__AVX2__) && defined(__FMA__)
  std::optional<torch::Tensor> bias_c;
  if (bias.has_value()) bias_c = bias->contiguous();
  const float* xs = xf.data_ptr<float>();
  const float* ps = panels.data_ptr<float>();
  const float* bs = bias_c.has_value() ? bias_c->data_ptr<float>() : nullptr;
  float* ys = out.data_ptr<float>();
  const int64_t row_blocks = (M + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, row_blocks * P, 1, [&](int64_t begin, int64_t end) {
    alignas(32) float edge[kTileRows * kPanel];  // the last panel's tile when N % 16 != 0
    alignas(32) float edge_bias[kPanel];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t rb = item / P, p = item % P;
      const int64_t m_end = std::min(M, (rb + 1) * kRowBlock);
      const int64_t n0 = p * kPanel, cols = std::min<int64_t>(kPanel, N - n0);
      const float* panel = ps + p * K * kPanel;
      const float* b = bs ? bs + n0 : nullptr;
      if (b && cols < kPanel) {
        std::fill(edge_bias, edge_bias + kPanel, 0.f);
        std::copy(b, b + cols, edge_bias);
        b = edge_bias;
      }
      for (int64_t m = rb * kRowBlock; m < m_end; m += kTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, m_end - m));
        if (cols == kPanel) {
          kTiles[rows - 1](xs + m * K, K, panel, K, b, ys + m * N + n0, N);
        } else {
          kTiles[rows - 1](xs + m * K, K, panel, K, b, edge, kPanel);
          for (int r = 0; r < rows; ++r) std::memcpy(ys + (m + r) * N + n0, edge + r * kPanel, cols * sizeof(float));
        }
      }
    }
  });
#endif
  return out;
}

}  // namespace panel_gemm
