// Weight-only matrix products for bfloat16 rows on CPUs with AVX-512 BF16 dot products (VDPBF16PS),
// over GGUF's own blocks: 4-bit (Q4_0/Q4_1) and 8-bit (Q8_0). The weights are laid out in tiles of
// 16 output channels so that one instruction multiplies 16 channels by a pair of inputs (32
// multiply-adds) and each unpacked tile serves up to 8 rows of x at once: a step of 8 rows costs
// far less than 8 steps of one (speculative decoding verifies its guesses as such rows). Per tile
// of channels n0..n0+15 and per 32-weight block g (a tile's blocks are consecutive):
//   4-bit codes uint8 [N / 16, G, 8, 32]: step s holds inputs 32g + 4s .. 32g + 4s + 3 as two
//               32-nibble vectors; byte j's low nibble is the code of channel n0 + j / 2 at input
//               32g + 4s + j % 2, its high nibble at input 32g + 4s + 2 + j % 2 (a pair of inputs
//               per channel, as VDPBF16PS pairs them);
//   4-bit scale_min float16 or float32 [N / 16, G, 2, 16]: the 16 channels' scales, then their
//               minimums (GGUF's own float16 values, exact; float32 for AWQ's minimums -scale * zero,
//               which float16 rounds), w = scale * code + minimum;
//   Q8_0 codes  int8 [N / 16, G, 16, 32]: step p, byte j: channel n0 + j / 2 at input 32g + 2p + j % 2;
//   Q8_0 scales float32 [N / 16, G, 16], w = scale * code.
// Arithmetic per row and tile: each block's codes (exact in bfloat16: 4 or 8 bits) dotted with the
// row's bfloat16 inputs (exact products, float32 sums in two partial sums per block), times the
// block's scale, plus (4-bit) the minimum times the row's float32 sum over the block. Every row
// takes this same arithmetic whatever rows are beside it, so a row's result is the same bit for
// bit for any number of rows (speculative decoding needs a guess's row to equal its own decode
// step, docs/speculative.md). Bound by models/csrc/layer_ops_cpu.cpp and called by the decoder
// stack; available() says whether this build has the kernels.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"

namespace bf16_tiles {

constexpr int64_t kTile = 16;  // output channels per tile
constexpr int kMaxRows = 8;    // rows sharing one unpacked tile
// How far ahead of the block being multiplied its codes are prefetched, in bytes: the walk runs
// through one thread's tiles in address order, but the hardware prefetcher alone leaves a cold
// 2-thread pass waiting on memory (batch-8 decode steps 8-20% faster with 2 KiB ahead on an AMD
// EPYC Zen 4, scripts/decode_step_time.py 8: docs/design.md); past the codes' end a prefetch is a
// no-op, never a fault.
constexpr uintptr_t kPrefetchBytes = 2048;

inline bool available() {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
typedef int32_t pair_bits __attribute__((may_alias));  // two bfloat16 inputs read as one 32-bit lane

inline __m512bh pair(const uint16_t* x) { return (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const pair_bits*>(x)); }

// 16 channels' scales (or minimums) as float32: from float16 bits, or float32 (AWQ's pairs)
inline __m512 scales16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 scales16(const float* p) { return _mm512_loadu_ps(p); }

// Prefetches the `bytes` (whole cache lines) that lie kPrefetchBytes past `block`. The address is
// computed as an integer: on a thread's last tiles it lies past the codes' end, where pointer
// arithmetic would be undefined (the prefetch itself never faults).
inline void prefetch_ahead(const void* block, int bytes) {
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(block) + kPrefetchBytes;
  for (int line = 0; line < bytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
}

// 16 outputs stored as float32, or rounded to bfloat16 bits (O = uint16_t) to nearest even as torch's
// .to(bfloat16) rounds them (a NaN as c10::BFloat16 writes it)
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(pagedllm_cpu::bf16_bits(v)));
}

// R rows of x (bfloat16 bits, row stride K) times 4-bit tile t; xsum [R, G] float32; S: uint16_t
// (float16 bits) or float, the scale_min type; O: float or uint16_t (bfloat16 bits), the output's.
template <int R, typename S, typename O>
void q4_rows(const uint16_t* x, const float* xsum, const uint8_t* codes, const S* scale_min, O* out,
             int64_t out_stride, int64_t K, int64_t t) {
  const int64_t G = K / 32;
  // bfloat16 bits of 0..15, indexed by a code (VPERMW reads each index's low 5 bits)
  alignas(64) static const uint16_t kCodeBits[32] = {0,      0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
                                                     0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
  const __m512i table = _mm512_load_si512(kCodeBits);
  const __m512i low4 = _mm512_set1_epi16(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* c = codes + (t * G + g) * 256;
    prefetch_ahead(c, 256);
    __m512 even[R], odd[R];  // the block's two partial sums: inputs 4s, 4s + 1 and 4s + 2, 4s + 3
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
    for (int s = 0; s < 8; ++s) {
      const __m512i nibbles = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + s * 32)));
      const __m512bh w0 = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(nibbles, low4), table);
      const __m512bh w1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(nibbles, 4), table);
      for (int r = 0; r < R; ++r) {
        const uint16_t* xr = x + r * K + g * 32 + s * 4;
        even[r] = _mm512_dpbf16_ps(even[r], w0, pair(xr));
        odd[r] = _mm512_dpbf16_ps(odd[r], w1, pair(xr + 2));
      }
    }
    const S* sm = scale_min + (t * G + g) * 32;
    const __m512 d = scales16(sm);
    const __m512 m = scales16(sm + 16);
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_add_ps(even[r], odd[r]), d, acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * G + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store16(out + r * out_stride + t * kTile, acc[r]);
}

// R rows of x (bfloat16 bits, row stride K) times Q8_0 tile t; O as in q4_rows.
template <int R, typename O>
void q8_0_rows(const uint16_t* x, const int8_t* codes, const float* scales, O* out, int64_t out_stride, int64_t K,
               int64_t t) {
  const int64_t G = K / 32;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const int8_t* c = codes + (t * G + g) * 512;
    prefetch_ahead(c, 512);
    __m512 even[R], odd[R];  // the block's two partial sums: steps 0, 2, .. and 1, 3, ..
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
    for (int p = 0; p < 16; p += 2) {
      __m512bh w[2];
      for (int h = 0; h < 2; ++h) {
        const int8_t* cp = c + (p + h) * 32;
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cp))));
        const __m512 hi =
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cp + 16))));
        w[h] = _mm512_cvtne2ps_pbh(hi, lo);  // exact: |code| <= 128
      }
      for (int r = 0; r < R; ++r) {
        const uint16_t* xr = x + r * K + g * 32 + p * 2;
        even[r] = _mm512_dpbf16_ps(even[r], w[0], pair(xr));
        odd[r] = _mm512_dpbf16_ps(odd[r], w[1], pair(xr + 2));
      }
    }
    const __m512 d = _mm512_loadu_ps(scales + (t * G + g) * kTile);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_add_ps(even[r], odd[r]), d, acc[r]);
  }
  for (int r = 0; r < R; ++r) store16(out + r * out_stride + t * kTile, acc[r]);
}

template <typename S, typename O>
using Q4Rows = void (*)(const uint16_t*, const float*, const uint8_t*, const S*, O*, int64_t, int64_t, int64_t);
template <typename S, typename O>
constexpr Q4Rows<S, O> kQ4Rows[] = {q4_rows<1, S, O>, q4_rows<2, S, O>, q4_rows<3, S, O>, q4_rows<4, S, O>,
                                    q4_rows<5, S, O>, q4_rows<6, S, O>, q4_rows<7, S, O>, q4_rows<8, S, O>};
template <typename O>
using Q8Rows = void (*)(const uint16_t*, const int8_t*, const float*, O*, int64_t, int64_t, int64_t);
template <typename O>
constexpr Q8Rows<O> kQ8Rows[] = {q8_0_rows<1, O>, q8_0_rows<2, O>, q8_0_rows<3, O>, q8_0_rows<4, O>,
                                 q8_0_rows<5, O>, q8_0_rows<6, O>, q8_0_rows<7, O>, q8_0_rows<8, O>};
// Each row's float32 sum over each 32-input block of bfloat16 x [M, K]: per block, eight partial sums
// part[j] = (x[j] + x[j + 8]) + (x[j + 16] + x[j + 24]), then ((p0 + p1) + (p2 + p3)) + ((p4 + p5) +
// (p6 + p7)): a fixed order (as the 4-bit minimums' term needs: a row's result never depends on its
// neighbours), 8 lanes at a time.
inline void block_sums(const uint16_t* x, int64_t blocks, float* sums) {
  auto widen8 = [](const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  };
  for (int64_t i = 0; i < blocks; ++i) {
    const uint16_t* b = x + i * 32;
    const __m256 part = _mm256_add_ps(_mm256_add_ps(widen8(b), widen8(b + 8)), _mm256_add_ps(widen8(b + 16), widen8(b + 24)));
    const __m256 pairs = _mm256_add_ps(part, _mm256_permute_ps(part, 0xB1));      // lane 2k: p2k + p2k+1
    const __m256 quads = _mm256_add_ps(pairs, _mm256_permute_ps(pairs, 0x4E));    // lane 4k: pairs 2k, 2k+1 summed
    const __m128 halves = _mm_add_ss(_mm256_castps256_ps128(quads), _mm256_extractf128_ps(quads, 1));
    sums[i] = _mm_cvtss_f32(halves);
  }
}
#endif

inline void check_x(const torch::Tensor& x) {
  TORCH_CHECK(available(), "this build has no AVX-512 BF16 tile kernels");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be bfloat16 [M, K]");
  TORCH_CHECK(x.size(1) % 32 == 0, "K must be a multiple of 32");
}

// x bfloat16 [M, K] @ W^T for W's 4-bit blocks in the tile layout above; returns float32 [M, N], or
// bfloat16 with bf16_out (each float32 sum rounded once, in the kernel: no second pass over the rows).
inline torch::Tensor q4_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scale_min, bool bf16_out = false) {
  check_x(x);
  const int64_t M = x.size(0), K = x.size(1), G = K / 32;
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 4 && codes.size(1) == G && codes.size(2) == 8 &&
                  codes.size(3) == 32,
              "codes must be uint8 [N / 16, K / 32, 8, 32]");
  const int64_t T = codes.size(0), N = T * kTile;
  const bool half_pairs = scale_min.scalar_type() == at::kHalf;
  TORCH_CHECK((half_pairs || scale_min.scalar_type() == at::kFloat) && scale_min.dim() == 4 &&
                  scale_min.size(0) == T && scale_min.size(1) == G && scale_min.size(2) == 2 &&
                  scale_min.size(3) == kTile,
              "scale_min must be float16 or float32 [N / 16, K / 32, 2, 16]");
  codes = codes.contiguous();
  scale_min = scale_min.contiguous();
  x = x.contiguous();
  auto out = torch::empty({M, N}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  std::vector<float> xsum(M * G);  // each row's x summed over each block, in float32 (block_sums)
  block_sums(xs, M * G, xsum.data());
  const uint8_t* cs = codes.data_ptr<uint8_t>();
  auto walk = [&](const auto* sms, auto* os) {
    using S = std::remove_const_t<std::remove_pointer_t<decltype(sms)>>;
    using O = std::remove_pointer_t<decltype(os)>;
    at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {  // a tile's codes stay in cache across row groups
        for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
          const int64_t rows = std::min<int64_t>(kMaxRows, M - m0);
          kQ4Rows<S, O>[rows - 1](xs + m0 * K, xsum.data() + m0 * G, cs, sms, os + m0 * N, N, K, t);
        }
      }
    });
  };
  auto with_out = [&](const auto* sms) {
    if (bf16_out) {
      walk(sms, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
    } else {
      walk(sms, out.data_ptr<float>());
    }
  };
  if (half_pairs) {
    with_out(reinterpret_cast<const uint16_t*>(scale_min.data_ptr<at::Half>()));
  } else {
    with_out(static_cast<const float*>(scale_min.data_ptr<float>()));
  }
#endif
  return out;
}

// x bfloat16 [M, K] @ W^T for W's Q8_0 blocks in the tile layout above; returns float32 [M, N], or
// bfloat16 with bf16_out (as q4_linear).
inline torch::Tensor q8_0_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, bool bf16_out = false) {
  check_x(x);
  const int64_t M = x.size(0), K = x.size(1), G = K / 32;
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 4 && codes.size(1) == G && codes.size(2) == 16 &&
                  codes.size(3) == 32,
              "codes must be int8 [N / 16, K / 32, 16, 32]");
  const int64_t T = codes.size(0), N = T * kTile;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 3 && scales.size(0) == T &&
                  scales.size(1) == G && scales.size(2) == kTile,
              "scales must be float32 [N / 16, K / 32, 16]");
  codes = codes.contiguous();
  scales = scales.contiguous();
  x = x.contiguous();
  auto out = torch::empty({M, N}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const int8_t* cs = codes.data_ptr<int8_t>();
  const float* ss = scales.data_ptr<float>();
  auto walk = [&](auto* os) {
    using O = std::remove_pointer_t<decltype(os)>;
    at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
          const int64_t rows = std::min<int64_t>(kMaxRows, M - m0);
          kQ8Rows<O>[rows - 1](xs + m0 * K, cs, ss, os + m0 * N, N, K, t);
        }
      }
    });
  };
  if (bf16_out) {
    walk(reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  } else {
    walk(out.data_ptr<float>());
  }
#endif
  return out;
}

}  // namespace bf16_tiles
