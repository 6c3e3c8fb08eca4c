// Per-token layer ops for CPU that torch would run as several kernels (and several Python calls)
// each: RMSNorm (optionally fused with the residual add), SiLU-and-multiply, and matrix products
// over GGUF Q8_0 weights (int8 codes, one float scale per 32 weights) and Q4_0/Q4_1 weights (4-bit
// codes, a scale and a minimum per 32 weights) for small batches.
// Bound to Python by models/csrc/layer_ops_cpu.cpp and called layer by layer by the decoder stack
// (models/csrc/decoder_stack_cpu.cpp); each extension includes this header in its one source.
//
// Numerics follow the unfused torch path of models/layers.py: reductions and activations in
// float32, results rounded to the storage dtype exactly where torch rounds them (no FMA
// contraction), so bfloat16/float16 outputs round identically and float32 ones differ from torch
// only by the order of the RMS sum.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"

namespace {

using namespace pagedllm_cpu;

template <typename T>
inline float f32(T x) { return static_cast<float>(x); }

// exp(x) by range reduction x = n ln2 + r and a degree-6 polynomial (~1 ulp). Below -87 it
// returns exp(-87) (1 + that is 1, as for the true value); above float's range it is +inf, as
// torch's exp is, so silu's far negative tail is -0 exactly like F.silu.
constexpr float kExpOverflow = 88.72283935546875f;

inline float exp_clamped(float x) {
  return x > kExpOverflow ? std::numeric_limits<float>::infinity() : exp_poly(x);
}

// v rounded to T's precision, as a float: an input that a float32 GEMM left unrounded is rounded
// here, where torch would have rounded the GEMM's output (identity where In is T).
template <typename T, typename In>
inline float rounded(In v) {
  if constexpr (std::is_same_v<In, T>) {
    return f32(v);
  } else {
    return f32(static_cast<T>(f32(v)));
  }
}

// Float conversions that vectorise: T -> float, and float rounded to T's precision (nearest even,
// as c10's casts round) kept as a float, for the storage types.
template <typename T>
struct Cvt {  // float16 (and float32): plain casts
  static float load(T x) { return static_cast<float>(x); }
  static float round(float x) { return static_cast<float>(static_cast<T>(x)); }
  static T store(float x) { return static_cast<T>(x); }
};

template <>
struct Cvt<c10::BFloat16> {
  static float load(c10::BFloat16 x) {
    uint16_t h;
    std::memcpy(&h, &x, 2);
    const uint32_t b = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &b, 4);
    return f;
  }
  static uint32_t round_bits(float x) {
    uint32_t b;
    std::memcpy(&b, &x, 4);
    const bool nan = (b & 0x7fffffffu) > 0x7f800000u;
    return nan ? 0x7fc00000u : (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
  }
  static float round(float x) {
    const uint32_t b = round_bits(x);
    float f;
    std::memcpy(&f, &b, 4);
    return f;
  }
  static c10::BFloat16 store(float x) {
    const uint16_t h = static_cast<uint16_t>(round_bits(x) >> 16);
    c10::BFloat16 out;
    std::memcpy(&out, &h, 2);
    return out;
  }
};

#ifdef __AVX512F__
// exp_clamped on 16 lanes (same reduction and polynomial).
inline __m512 exp16(__m512 x) {
  const __mmask16 overflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpOverflow), _CMP_GT_OQ);
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                                      _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_add_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  // p * 2^n in one vscalefps: with n in [-125, 127] (the clamp) and p in [0.7, 1.5] the product is
  // a normal float, exact, the same as the multiply by 2^n built from its exponent bits it replaces
  return _mm512_mask_blend_ps(overflow, _mm512_scalef_ps(p, n), _mm512_set1_ps(std::numeric_limits<float>::infinity()));
}

// 16 values of T <-> float32 lanes; round16 keeps a float rounded to T's precision (nearest even).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 round16(__m512 x, const float*) { return x; }
inline __m512 round16(__m512 x, const c10::BFloat16*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_pack(x)), 16));
}
inline __m512 round16(__m512 x, const c10::Half*) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(c10::BFloat16* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_pack(x));
}
inline void store16(c10::Half* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// y stored as T (Out = T), or as float32 lanes holding its T-rounded values (Out = float).
template <typename T, typename Out>
inline void store_as(Out* p, __m512 y) {
  if constexpr (std::is_same_v<Out, T>) {
    store16(p, y);
  } else {
    store16(p, round16(y, static_cast<const T*>(nullptr)));
  }
}

#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
// The same on 8 lanes, for AVX2 (16-float vectors go through the stack there, cpu_vec.h).
inline __m256 exp8(__m256 x) {
  const __m256 overflow = _mm256_cmp_ps(x, _mm256_set1_ps(kExpOverflow), _CMP_GT_OQ);
  return _mm256_blendv_ps(exp_poly8(x), _mm256_set1_ps(std::numeric_limits<float>::infinity()), overflow);
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 round8(__m256 x, const float*) { return x; }
inline __m256 round8(__m256 x, const c10::BFloat16*) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(x), 16)); }
inline __m256 round8(__m256 x, const c10::Half*) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void store8(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
inline void store8(c10::BFloat16* p, __m256 x) {
  const __m256i bits = bf16_bits8(x);  // 8 x 32-bit lanes holding 16-bit values -> 8 x 16 bits
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline void store8(c10::Half* p, __m256 x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

// In and Out are T, or float32 holding values to be rounded to T / already rounded to T (see norm_row).
template <typename T, typename In = T, typename Out = T>
void silu_mul_row(const In* gate, const In* up, Out* out, int64_t I) {
  int64_t i = 0;
#ifdef __AVX512F__
  if constexpr (!std::is_same_v<T, double>) {
    const T* tag = nullptr;  // round16's precision
    for (; i + 16 <= I; i += 16) {
      __m512 x = load16(gate + i), u = load16(up + i);
      if constexpr (!std::is_same_v<In, T>) {
        x = round16(x, tag);
        u = round16(u, tag);
      }
      const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
      const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
      store_as<T>(out + i, _mm512_mul_ps(round16(silu, tag), u));
    }
  }
#elif defined(__AVX2__)
  if constexpr (!std::is_same_v<T, double>) {
    const T* tag = nullptr;  // round8's precision
    for (; i + 8 <= I; i += 8) {
      __m256 x = load8(gate + i), u = load8(up + i);
      if constexpr (!std::is_same_v<In, T>) {
        x = round8(x, tag);
        u = round8(u, tag);
      }
      const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
      const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
      const __m256 product = _mm256_mul_ps(round8(silu, tag), u);
      if constexpr (std::is_same_v<Out, T>) {
        store8(out + i, product);
      } else {
        store8(out + i, round8(product, tag));
      }
    }
  }
#endif
  for (; i < I; ++i) {
    const float x = rounded<T>(gate[i]);
    const float s = Cvt<T>::round(x / (1.0f + exp_clamped(-x)));
    const float product = s * rounded<T>(up[i]);
    if constexpr (std::is_same_v<Out, T>) {
      out[i] = Cvt<T>::store(product);
    } else {
      out[i] = Cvt<T>::round(product);
    }
  }
}

// out = weight * (x * rsqrt(mean(x^2) + eps)).to(T), with x in float32: HF's LlamaRMSNorm. Out is T,
// or float32 holding the same T-rounded values (for a float32 GEMM next, without a conversion).
// The products are rounded one by one as torch rounds them, 16 lanes at a time on AVX-512.
template <typename T, typename Out = T>
__attribute__((optimize("fp-contract=off"))) void norm_row(const T* x, const T* w, Out* out, int64_t H, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < H; ++i) {
    const float v = f32(x[i]);
    ss += v * v;
  }
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
  int64_t i = 0;
#ifdef __AVX512F__
  if constexpr (!std::is_same_v<T, double>) {
    const T* tag = nullptr;  // round16's precision
    const __m512 scale = _mm512_set1_ps(inv);
    for (; i + 16 <= H; i += 16) {
      store_as<T>(out + i, _mm512_mul_ps(load16(w + i), round16(_mm512_mul_ps(load16(x + i), scale), tag)));
    }
  }
#endif
  for (; i < H; ++i) {
    out[i] = static_cast<Out>(static_cast<T>(f32(w[i]) * f32(static_cast<T>(f32(x[i]) * inv))));
  }
}

// r += a, rounded to T as torch's add rounds it; a is T, or float32 rounded to T first.
template <typename T, typename In>
void add_row(const In* a, T* r, int64_t H) {
  int64_t i = 0;
#ifdef __AVX512F__
  if constexpr (!std::is_same_v<T, double>) {
    const T* tag = nullptr;
    for (; i + 16 <= H; i += 16) {
      __m512 v = load16(a + i);
      if constexpr (!std::is_same_v<In, T>) v = round16(v, tag);
      store16(r + i, _mm512_add_ps(v, load16(r + i)));
    }
  }
#endif
  for (; i < H; ++i) r[i] = static_cast<T>(rounded<T>(a[i]) + f32(r[i]));
}

inline int64_t rows_per_task(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

inline void check_rows(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "expected contiguous [tokens, hidden] rows");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.dtype() == x.dtype(),
              "norm weight must be [hidden] in the activation dtype");
}

}  // namespace

// The ops below take an output dtype: the model's (as torch computes them), or float32 holding the
// same rounded values, for a float32 GEMM next (a CPU without native bf16: no conversion between).

// Calls f(In*, Out*) with In = T or float (x's dtype) and Out = T or float (out's dtype).
template <typename T, typename F>
inline void with_types(const torch::Tensor& x, torch::Tensor& out, F&& f) {
  const bool x_float = !std::is_same_v<T, float> && x.scalar_type() == at::kFloat;
  const bool out_float = !std::is_same_v<T, float> && out.scalar_type() == at::kFloat;
  if (x_float && out_float) f(x.data_ptr<float>(), out.data_ptr<float>());
  else if (x_float) f(x.data_ptr<float>(), out.data_ptr<T>());
  else if (out_float) f(x.data_ptr<T>(), out.data_ptr<float>());
  else f(x.data_ptr<T>(), out.data_ptr<T>());
}

inline void check_out_dtype(at::ScalarType out, at::ScalarType model) {
  TORCH_CHECK(out == model || out == at::kFloat, "the output dtype must be the model's or float32");
}

// RMSNorm of each row of x [T, H], into out_dtype.
inline torch::Tensor rms_norm_to(torch::Tensor x, torch::Tensor weight, double eps, at::ScalarType out_dtype) {
  x = x.contiguous();
  check_rows(x, weight);
  check_out_dtype(out_dtype, x.scalar_type());
  auto out = torch::empty(x.sizes(), x.options().dtype(out_dtype));
  const int64_t H = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    auto rows_into = [&](auto* dst) {
      at::parallel_for(0, x.size(0), rows_per_task(H), [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) norm_row(src + t * H, w, dst + t * H, H, static_cast<float>(eps));
      });
    };
    if (out_dtype == x.scalar_type()) {
      rows_into(out.data_ptr<scalar_t>());
    } else {
      rows_into(out.data_ptr<float>());
    }
  });
  return out;
}

inline torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  return rms_norm_to(x, weight, eps, x.scalar_type());
}

// residual += x (rounded to the dtype, as torch's add), then RMSNorm of the new residual into
// out_dtype. residual is updated in place; x is in residual's dtype or float32 (then rounded to it
// first, as torch rounds the float32 GEMM output it comes from); returns the normalised rows.
inline torch::Tensor add_rms_norm_to_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps,
                                      at::ScalarType out_dtype) {
  x = x.contiguous();
  check_rows(residual, weight);
  const at::ScalarType dtype = residual.scalar_type();
  TORCH_CHECK(x.sizes() == residual.sizes() && (x.scalar_type() == dtype || x.scalar_type() == at::kFloat),
              "x and residual differ");
  check_out_dtype(out_dtype, dtype);
  auto out = torch::empty(x.sizes(), x.options().dtype(out_dtype));
  const int64_t H = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "add_rms_norm", [&] {
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* res = residual.data_ptr<scalar_t>();
    with_types<scalar_t>(x, out, [&](auto* src, auto* dst) {
      at::parallel_for(0, x.size(0), rows_per_task(H), [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          scalar_t* r = res + t * H;
          const auto* a = src + t * H;
          add_row<scalar_t>(a, r, H);
          norm_row(r, w, dst + t * H, H, static_cast<float>(eps));
        }
      });
    });
  });
  return out;
}

inline torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dtype() == residual.dtype(), "x and residual differ");
  return add_rms_norm_to_(x, residual, weight, eps, residual.scalar_type());
}

// gate_up [T, 2I] (gate then up) -> silu(gate) * up [T, I]; silu(g) = g / (1 + exp(-g)) in float32,
// rounded to the dtype before the product, as F.silu(gate) * up computes it. gate_up is in dtype
// or float32 (rounded to dtype first); the result goes into out_dtype.
inline torch::Tensor silu_mul_to(torch::Tensor gate_up, at::ScalarType dtype, at::ScalarType out_dtype) {
  gate_up = gate_up.contiguous();
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "expected [tokens, 2 * intermediate]");
  TORCH_CHECK(gate_up.scalar_type() == dtype || gate_up.scalar_type() == at::kFloat,
              "gate_up must be in the model dtype or float32");
  check_out_dtype(out_dtype, dtype);
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({T, I}, gate_up.options().dtype(out_dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "silu_mul", [&] {
    with_types<scalar_t>(gate_up, out, [&](auto* src, auto* dst) {
      using In = std::remove_const_t<std::remove_pointer_t<decltype(src)>>;
      using Out = std::remove_pointer_t<decltype(dst)>;
      at::parallel_for(0, T, rows_per_task(2 * I), [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          silu_mul_row<scalar_t, In, Out>(src + t * 2 * I, src + t * 2 * I + I, dst + t * I, I);
        }
      });
    });
  });
  return out;
}

inline torch::Tensor silu_mul(torch::Tensor gate_up) { return silu_mul_to(gate_up, gate_up.scalar_type(), gate_up.scalar_type()); }

// One row's first index of its largest value, a NaN counting as the largest (the first NaN wins), as
// torch.max(dim=-1) picks: lane k keeps the first index of its own largest value (a strict >), the
// lanes then give the smallest index holding the largest of them; a row with a NaN is scanned again.
template <typename T>
int64_t argmax_row(const T* p, int64_t n) {
  int64_t i = 0, best = 0;
  float top = -std::numeric_limits<float>::infinity();
  bool nan = false;
#ifdef __AVX512F__
  if (n >= 16) {
    const __m512i step = _mm512_set1_epi32(16);
    __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 lane_top = load16(p);
    __m512i lane_best = index;
    __mmask16 nans = _mm512_cmp_ps_mask(lane_top, lane_top, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= n; i += 16) {
      index = _mm512_add_epi32(index, step);
      const __m512 v = load16(p + i);
      const __mmask16 above = _mm512_cmp_ps_mask(v, lane_top, _CMP_GT_OQ);
      lane_top = _mm512_mask_mov_ps(lane_top, above, v);
      lane_best = _mm512_mask_mov_epi32(lane_best, above, index);
      nans |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    nan = nans != 0;
    top = _mm512_reduce_max_ps(lane_top);
    const __mmask16 at_top = _mm512_cmp_ps_mask(lane_top, _mm512_set1_ps(top), _CMP_EQ_OQ);
    best = _mm512_mask_reduce_min_epi32(at_top, lane_best);
  }
#elif defined(__AVX2__)
  if (n >= 8) {
    const __m256i step = _mm256_set1_epi32(8);
    __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 lane_top = load8(p);
    __m256i lane_best = index;
    __m256 nans = _mm256_cmp_ps(lane_top, lane_top, _CMP_UNORD_Q);
    for (i = 8; i + 8 <= n; i += 8) {
      index = _mm256_add_epi32(index, step);
      const __m256 v = load8(p + i);
      const __m256 above = _mm256_cmp_ps(v, lane_top, _CMP_GT_OQ);
      lane_top = _mm256_blendv_ps(lane_top, v, above);
      lane_best = _mm256_castps_si256(
          _mm256_blendv_ps(_mm256_castsi256_ps(lane_best), _mm256_castsi256_ps(index), above));
      nans = _mm256_or_ps(nans, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    nan = _mm256_movemask_ps(nans) != 0;
    alignas(32) float tops[8];
    alignas(32) int32_t bests[8];
    _mm256_store_ps(tops, lane_top);
    _mm256_store_si256(reinterpret_cast<__m256i*>(bests), lane_best);
    top = *std::max_element(tops, tops + 8);
    best = n;
    for (int k = 0; k < 8; ++k) {
      if (tops[k] == top) best = std::min<int64_t>(best, bests[k]);
    }
  }
#endif
  if (i == 0) {  // a row shorter than one vector
    top = static_cast<float>(p[0]);
    nan = std::isnan(top);
    i = 1;
  }
  for (; i < n && !nan; ++i) {  // the tail past the last whole vector: later indices, so a strict >
    const float v = static_cast<float>(p[i]);
    nan = std::isnan(v);
    if (v > top) {
      top = v;
      best = i;
    }
  }
  if (nan) {
    for (i = 0; i < n; ++i) {
      if (std::isnan(static_cast<float>(p[i]))) return i;
    }
  }
  return best;
}

// Each row's argmax_row: float32 or bfloat16 rows [M, V] -> int64 [M] (what torch.max(dim=-1).indices
// gives, without its slower reduction: docs/design.md).
inline torch::Tensor row_argmax(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "row_argmax takes [rows, n] with n >= 1");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "row_argmax takes float32 or bfloat16");
  x = x.contiguous();
  const int64_t M = x.size(0), n = x.size(1);
  auto out = torch::empty({M}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  auto rows = [&](const auto* p) {
    at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(p + r * n, n);
    });
  };
  if (x.scalar_type() == at::kFloat) {
    rows(x.data_ptr<float>());
  } else {
    rows(x.data_ptr<at::BFloat16>());
  }
  return out;
}

namespace {

// 16 signed bytes -> 16 floats (GCC scalarises __builtin_convertvector from int8, so use AVX-512 directly)
inline v16 int8_to_float(const int8_t* src) {
#ifdef __AVX512F__
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
  v16 out;
  std::memcpy(&out, &f, 64);
  return out;
#else
  v16 out;
  for (int i = 0; i < 16; ++i) out[i] = static_cast<float>(src[i]);
  return out;
#endif
}

// R rows of x (float32, row stride K) times rows [begin, end) of a Q8_0 weight; R is a compile-time
// constant so the accumulators stay in registers.
template <int R>
void q8_0_rows(const float* x, const int8_t* codes, const float* scales, float* out, int64_t out_stride,
               int64_t K, int64_t begin, int64_t end) {
  const int64_t G = K / 32;
#if defined(__AVX2__) && !defined(__AVX512F__)
  // 8-float registers: 16-float vectors would be split into pairs through memory (3.5x slower here)
  for (int64_t n = begin; n < end; ++n) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const int8_t* c = codes + n * K;
    const float* d = scales + n * G;
    for (int64_t g = 0; g < G; ++g) {
      const __m256 scale = _mm256_set1_ps(d[g]);
      for (int part = 0; part < 4; ++part) {
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + g * 32 + part * 8));
        const __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), scale);
        for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + r * K + g * 32 + part * 8), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
      const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
      out[r * out_stride + n] = _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
    }
  }
#else
  for (int64_t n = begin; n < end; ++n) {
    v16 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = v16{};
    const int8_t* c = codes + n * K;
    const float* d = scales + n * G;
    for (int64_t g = 0; g < G; ++g) {
      const v16 w0 = int8_to_float(c + g * 32) * d[g];
      const v16 w1 = int8_to_float(c + g * 32 + 16) * d[g];
      for (int r = 0; r < R; ++r) {
        v16 a, b;
        std::memcpy(&a, x + r * K + g * 32, 64);
        std::memcpy(&b, x + r * K + g * 32 + 16, 64);
        acc[r] += w0 * a + w1 * b;
      }
    }
    for (int r = 0; r < R; ++r) out[r * out_stride + n] = hsum(acc[r]);
  }
#endif
}

using Q8Rows = void (*)(const float*, const int8_t*, const float*, float*, int64_t, int64_t, int64_t, int64_t);
constexpr Q8Rows kQ8Rows[] = {q8_0_rows<1>, q8_0_rows<2>, q8_0_rows<3>, q8_0_rows<4>};

#if defined(__AVX2__) && !defined(__AVX512F__)
// A 4-bit block's scale or minimum as float32: S is at::Half (GGUF's own pairs) or float (AWQ's,
// whose minimum -scale * zero float16 cannot hold).
inline float scale_f32(const at::Half* p) { return _cvtsh_ss(*reinterpret_cast<const uint16_t*>(p)); }
inline float scale_f32(const float* p) { return *p; }
// 8 (scale, minimum) pairs from p: lo = d0 m0 d1 m1 d2 m2 d3 m3, hi = d4 m4 ... d7 m7
inline void scale_pairs8(const at::Half* p, __m256& lo, __m256& hi) {
  const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(pairs));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(pairs, 1));
}
inline void scale_pairs8(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}
#endif

// R rows of x (float32, row stride K) times rows [begin, end) of a 4-bit weight in GGUF's Q4_0/Q4_1
// block layout: 16 bytes per 32 weights, byte j holding weight j in its low nibble and weight j + 16
// in its high one, and per block a (scale, minimum) pair of type S: float16 (GGUF's own, exact) or
// float32 (AWQ's minimum -scale * zero needs more bits than float16 has), w = scale * q + minimum.
// Per row and block: the codes' products with x summed (4 FMAs), times the scale (1 FMA); the
// minimums' share, sum over blocks of minimum * sum(x over the block), is one more
// dot product per row over xsum (the block's x summed, once per call), 8 blocks per FMA. Every
// row takes this same arithmetic whatever R is, so a row's result is the same bit for bit
// whatever rows are beside it (speculative decoding's exactness needs it: a guess's row is
// computed as its decode step would be, docs/speculative.md). R is a compile-time constant so the
// accumulators stay in registers (R <= 8: 8 accumulators, the 4 unpacked code vectors, a
// product and the scale fit AVX2's 16).
template <int R, typename S>
void q4_rows(const float* x, const float* xsum, const uint8_t* codes, const S* scale_min, float* out,
             int64_t out_stride, int64_t K, int64_t begin, int64_t end) {
  const int64_t G = K / 32;
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* c = codes + n * (K / 2);
    const S* sm = scale_min + n * 2 * G;
    float dot[R];
#if defined(__AVX2__) && !defined(__AVX512F__)
    // Bytes 0-7 zero-extended to 8 int32 lanes hold weights 0-7 in their low nibbles and 16-23 in
    // their high ones (bytes 8-15: 8-15 and 24-31), so one widening gives two vectors of codes.
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi32(0x0F);
    for (int64_t g = 0; g < G; ++g) {
      const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + g * 16)));
      const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + g * 16 + 8)));
      const __m256 d = _mm256_set1_ps(scale_f32(sm + 2 * g));
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_and_si256(b0, low4));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_and_si256(b1, low4));
      const __m256 w2 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
      const __m256 w3 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * K + g * 32;
        __m256 t = _mm256_mul_ps(w0, _mm256_loadu_ps(xr));
        t = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), t);
        t = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 16), t);
        t = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), t);
        acc[r] = _mm256_fmadd_ps(t, d, acc[r]);
      }
    }
    // the minimums' share: 8 blocks' minimums (the odd halves of 8 (scale, minimum) pairs) at once
    __m256 macc[R];
    for (int r = 0; r < R; ++r) macc[r] = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= G; g += 8) {
      __m256 lo, hi;  // d0 m0 d1 m1 d2 m2 d3 m3 and d4 m4 ... d7 m7
      scale_pairs8(sm + 2 * g, lo, hi);
      const __m256 odd = _mm256_shuffle_ps(lo, hi, 0xDD);                     // m0 m1 m4 m5 m2 m3 m6 m7
      const __m256 mins = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(odd), 0xD8));  // m0 .. m7
      for (int r = 0; r < R; ++r) macc[r] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(xsum + r * G + g), macc[r]);
    }
    for (int r = 0; r < R; ++r) {
      float tail = 0.f;
      for (int64_t t = g; t < G; ++t) tail += scale_f32(sm + 2 * t + 1) * xsum[r * G + t];
      dot[r] = hsum8(acc[r]) + (hsum8(macc[r]) + tail);
    }
#else
    v16 acc[R];
    float shift[R] = {};
    for (int r = 0; r < R; ++r) acc[r] = v16{};
    for (int64_t g = 0; g < G; ++g) {
      const float d = static_cast<float>(sm[2 * g]), m = static_cast<float>(sm[2 * g + 1]);
      float w[32];
      for (int j = 0; j < 16; ++j) {
        w[j] = d * static_cast<float>(c[g * 16 + j] & 0x0F);
        w[j + 16] = d * static_cast<float>(c[g * 16 + j] >> 4);
      }
      v16 a, b;
      std::memcpy(&a, w, 64);
      std::memcpy(&b, w + 16, 64);
      for (int r = 0; r < R; ++r) {
        v16 xa, xb;
        std::memcpy(&xa, x + r * K + g * 32, 64);
        std::memcpy(&xb, x + r * K + g * 32 + 16, 64);
        acc[r] += a * xa + b * xb;
        shift[r] += m * xsum[r * G + g];
      }
    }
    for (int r = 0; r < R; ++r) dot[r] = hsum(acc[r]) + shift[r];
#endif
    for (int r = 0; r < R; ++r) out[r * out_stride + n] = dot[r];
  }
}

template <typename S>
using Q4Rows = void (*)(const float*, const float*, const uint8_t*, const S*, float*, int64_t, int64_t, int64_t,
                        int64_t);
template <typename S>
constexpr Q4Rows<S> kQ4Rows[] = {q4_rows<1, S>, q4_rows<2, S>, q4_rows<3, S>, q4_rows<4, S>,
                                 q4_rows<5, S>, q4_rows<6, S>, q4_rows<7, S>, q4_rows<8, S>};

}  // namespace

// x [M, K] @ W^T for W given as 4-bit GGUF blocks (Q4_0 / Q4_1): codes uint8 [N, K / 2] in GGUF's
// nibble order (see q4_rows), scale_min float16 or float32 [N, K / 32, 2] (w = scale * q + minimum;
// Q4_0 is scale * (q - 8): minimum = -8 scale; float32 for AWQ's minimums, which float16 rounds).
// Float32 maths on the exact weights; each weight block is unpacked once per group of up to 8 rows of x, and the weight is walked in chunks of 32 rows so a
// chunk stays in cache across row groups. Returns float32 [M, N]. Meant for small M (decode steps).
inline torch::Tensor q4_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scale_min) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && codes.scalar_type() == at::kByte, "expected x [M, K], codes uint8");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), G = K / 32;
  TORCH_CHECK(K % 32 == 0 && codes.size(1) == K / 2, "codes must be [N, K / 2] with K a multiple of 32");
  const bool half_pairs = scale_min.scalar_type() == at::kHalf;
  TORCH_CHECK((half_pairs || scale_min.scalar_type() == at::kFloat) && scale_min.dim() == 3 &&
                  scale_min.size(0) == N && scale_min.size(1) == G && scale_min.size(2) == 2,
              "scale_min must be float16 or float32 [N, K / 32, 2]");
  codes = codes.contiguous();
  scale_min = scale_min.contiguous();
  auto xf = x.to(at::kFloat).contiguous();
  auto out = torch::empty({M, N}, x.options().dtype(at::kFloat));
  const float* xs = xf.data_ptr<float>();
  std::vector<float> xsum(M * G);  // each row's x summed over each block (q4_rows: the minimums' share)
  for (int64_t i = 0; i < M * G; ++i) {
    float part[8];
    for (int j = 0; j < 8; ++j) {
      part[j] = (xs[i * 32 + j] + xs[i * 32 + j + 8]) + (xs[i * 32 + j + 16] + xs[i * 32 + j + 24]);
    }
    xsum[i] = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
  }
  float* os = out.data_ptr<float>();
  const uint8_t* cs = codes.data_ptr<uint8_t>();
  auto walk = [&](const auto* sms) {
    using S = std::remove_const_t<std::remove_pointer_t<decltype(sms)>>;
    at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
      for (int64_t n0 = begin; n0 < end; n0 += 32) {
        const int64_t n1 = std::min<int64_t>(n0 + 32, end);
        for (int64_t m0 = 0; m0 < M; m0 += 8) {
          const int64_t rows = std::min<int64_t>(8, M - m0);
          kQ4Rows<S>[rows - 1](xs + m0 * K, xsum.data() + m0 * G, cs, sms, os + m0 * N, N, K, n0, n1);
        }
      }
    });
  };
  if (half_pairs) {
    walk(scale_min.data_ptr<at::Half>());
  } else {
    walk(scale_min.data_ptr<float>());
  }
  return out;
}

// x [M, K] @ W^T for W given as GGUF Q8_0: codes int8 [N, K], scales float32 [N, K / 32]
// (w = scale * code). Each weight block is converted once per group of up to 4 rows of x;
// float32 accumulation. Returns float32 [M, N]. Meant for small M (decode steps).
inline torch::Tensor q8_0_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && codes.scalar_type() == at::kChar, "expected x [M, K], codes int8");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(codes.size(1) == K && K % 32 == 0, "codes must be [N, K] with K a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.size(0) == N && scales.size(1) == K / 32,
              "scales must be float32 [N, K / 32]");
  codes = codes.contiguous();
  scales = scales.contiguous();
  auto xf = x.to(at::kFloat).contiguous();
  auto out = torch::empty({M, N}, x.options().dtype(at::kFloat));
  const float* xs = xf.data_ptr<float>();
  float* os = out.data_ptr<float>();
  at::parallel_for(0, N, 256, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int64_t rows = std::min<int64_t>(4, M - m0);
      kQ8Rows[rows - 1](xs + m0 * K, codes.data_ptr<int8_t>(), scales.data_ptr<float>(), os + m0 * N, N, K, begin,
                        end);
    }
  });
  return out;
}
