// Shared by the C++ extensions: 16-float vectors (GCC/Clang vector extensions: AVX-512 with
// -march=native, narrower ISAs split them), a horizontal sum, a vectorisable exp, and float32 lanes
// rounded to bfloat16 bits as torch rounds them.
#pragma once

#include <cstdint>

#include <immintrin.h>

namespace pagedllm_cpu {

typedef float v16 __attribute__((vector_size(64), aligned(4)));  // unaligned loads allowed
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef float v4 __attribute__((vector_size(16), aligned(4)));

inline float hsum(v16 x) {  // pairwise tree: 4 shuffle + add steps
  v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// exp(x) for x clamped to [-87, 88]: Cephes-style range reduction x = n ln2 + r and a degree-6
// polynomial, ~1 ulp; branch-free so loops over it vectorise (std::exp does not; GCC needs
// -fno-trapping-math to vectorise the floorf).
inline float exp_poly(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));

// exp_poly on 16 lanes at once, lane for lane the same result (same clamp, floor and polynomial).
inline v16 exp_poly16(v16 x) {
  x = x < -87.0f ? v16{} - 87.0f : x;
  x = x > 88.0f ? v16{} + 88.0f : x;
  const v16 t = x * 1.44269504088896341f + 0.5f;
  const v16 truncated = __builtin_convertvector(__builtin_convertvector(t, v16i), v16);
  const v16 n = truncated > t ? truncated - 1.0f : truncated;  // floor
  const v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  v16 p = v16{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
  v16 scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2: 16-float vectors are split into 128-bit pieces through the stack wherever GCC lowers a
// select or a conversion on them (10x slower attention), so the hot loops use 8-float registers.
// exp_poly on 8 lanes: the same clamp, floor and polynomial as exp_poly16, and a NaN stays NaN as
// there (vmaxps/vminps return their second operand where either is NaN: x goes second).
inline __m256 exp_poly8(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-87.0f), x));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

inline float hsum8(__m256 x) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}

inline float hmax8(__m256 x) {
  const __m128 h = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(q, _mm_shuffle_ps(q, q, 1)));
}
#endif

inline float hmax(v16 x) {
  v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7);
  v8 b = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  a = a > b ? a : b;
  v4 c = __builtin_shufflevector(a, a, 0, 1, 2, 3), e = __builtin_shufflevector(a, a, 4, 5, 6, 7);
  c = c > e ? c : e;
  const float m01 = c[0] > c[1] ? c[0] : c[1], m23 = c[2] > c[3] ? c[2] : c[3];
  return m01 > m23 ? m01 : m23;
}

// x[k] -> lane k holds the sum of x[k]'s 16 lanes: 16 horizontal sums in 15 shuffle-add pairs
// (a transposing butterfly) instead of 16 separate ones. Lane k's sum is taken in a fixed order.
// V: 16 float32 lanes (v16) or 16 int32 lanes (v16i).
template <typename V>
inline V reduce16(const V* x) {
  V y[8], z[4], w[2];
  for (int i = 0; i < 8; ++i) {
    const V a = x[2 * i], b = x[2 * i + 1];
    y[i] = __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
           __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  }
  for (int i = 0; i < 4; ++i) {
    const V c = y[2 * i], d = y[2 * i + 1];
    z[i] = __builtin_shufflevector(c, d, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(c, d, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {
    const V e = z[2 * i], f = z[2 * i + 1];
    w[i] = __builtin_shufflevector(e, f, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(e, f, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  }
  return __builtin_shufflevector(w[0], w[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(w[0], w[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}

#ifdef __AVX512F__
// 16 float32 lanes -> their bfloat16 bits in the low half of each 32-bit lane: round to nearest even,
// NaN -> 0x7fc0, denormals kept, as c10::BFloat16 rounds (vcvtneps2bf16 reads denormals as zero).
inline __m512i bf16_bits(__m512 x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_blend_epi32(nan, _mm512_srli_epi32(rounded, 16), _mm512_set1_epi32(0x7fc0));
}

// 16 float32 lanes -> 16 bfloat16 values, the same bits as bf16_bits. With AVX512-BF16, by one
// vcvtneps2bf16 unless a lane is NaN or denormal (fpclass: QNaN 0x01, denormal 0x20, SNaN 0x80),
// the lanes it rounds otherwise (it keeps a NaN's sign and payload and reads a denormal as zero).
// The layer ops store through it; the tile kernels keep bf16_bits, whose integer ops run beside
// their VDPBF16PS where the conversion would compete with them for the FP pipes (the Q8_0 head
// 2-5% slower with it on AMD Zen 4: scripts/layer_ops_build_ab.py).
inline __m256i bf16_pack(__m512 x) {
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
  if (_mm512_fpclass_ps_mask(x, 0xA1) == 0) return (__m256i)_mm512_cvtneps_pbh(x);
#endif
  return _mm512_cvtepi32_epi16(bf16_bits(x));
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
inline __m256i bf16_bits8(__m256 x) {  // bf16_bits on 8 lanes
  const __m256i b = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
}
#endif

}  // namespace pagedllm_cpu
