// Quantized KV rows in C++: the formats of kvstore/quant.py (KVCodec), byte for byte.
//
// A row is one token's K (or V) for one KV head: head_dim values, stored as codes with one
// bfloat16 scale, scale = bf16(absmax / qmax), codes from x * (1 / scale):
//   int8      round half to even, clamped to +-127;
//   fp8_e4m3  clamped to +-448, cast to float8_e4m3fn (c10's conversion, as torch's .to());
//   fp8_e5m2  clamped to +-57344, cast to float8_e5m2;
//   int4      the row first rotated (fwht), then each value's nearest of the 15 levels
//             kInt4Levels (-7..7, not evenly spaced: 8 plus or minus the count of
//             kInt4Thresholds that |x * inv| exceeds), two nibbles per byte, element 2i low.
// A static scale (kv_cache_scales) replaces absmax / qmax; the rest is the same.
// Decoding multiplies each value (int4: its level) by the row's scale (int4: the result is still
// rotated; the attention kernel rotates the query alike and its output back). Every step is the float32
// operation torch performs in KVCodec, in the same order, so the C++ store writes the bytes the
// reference writes (tests compare them).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>

namespace pagedllm_cpu {

enum class KVFormat { kInt8, kFp8E4M3, kFp8E5M2, kInt4 };

// The format a code tensor's dtype stores (int8, float8_e4m3fn, float8_e5m2, uint8 = packed int4).
inline KVFormat kv_format_of(const torch::Tensor& codes) {
  switch (codes.scalar_type()) {
    case at::kChar: return KVFormat::kInt8;
    case at::kFloat8_e4m3fn: return KVFormat::kFp8E4M3;
    case at::kFloat8_e5m2: return KVFormat::kFp8E5M2;
    case at::kByte: return KVFormat::kInt4;
    default: TORCH_CHECK(false, "no quantized KV format is stored as ", codes.scalar_type());
  }
  return KVFormat::kInt8;
}

template <KVFormat F>
constexpr float kQmax = F == KVFormat::kInt8 ? 127.f : F == KVFormat::kFp8E4M3 ? 448.f
                                                 : F == KVFormat::kFp8E5M2 ? 57344.f : 7.f;
template <KVFormat F>
constexpr bool kPacked = F == KVFormat::kInt4;
template <KVFormat F>
constexpr bool kRotated = F == KVFormat::kInt4;

// int4's levels by nibble and the midpoints between neighbouring positive levels: quant.py's
// INT4_LEVELS and INT4_THRESHOLDS, the same literals (tests/unit/test_kv_quant.py compares them).
alignas(64) inline constexpr float kInt4Levels[16] = {-8.f,     -7.f,     -5.3385f, -4.1274f, -3.1374f, -2.2712f,
                                                      -1.4789f, -0.7292f, 0.f,      0.7292f,  1.4789f,  2.2712f,
                                                      3.1374f,  4.1274f,  5.3385f,  7.f};
inline constexpr float kInt4Thresholds[7] = {0.3646f, 1.10405f, 1.87505f, 2.7043f, 3.6324f, 4.73295f, 6.16925f};

// One value over its row's scale -> its int4 nibble.
inline int int4_nibble(float y) {
  const float a = std::fabs(y);
  int magnitude = 0;
  for (float t : kInt4Thresholds) magnitude += a > t;
  return y < 0.f ? 8 - magnitude : 8 + magnitude;
}

// Bytes a row of head_dim values takes.
template <KVFormat F>
constexpr int64_t code_bytes(int64_t head_dim) { return kPacked<F> ? head_dim / 2 : head_dim; }

// x <- x H for the normalised Hadamard matrix H (n a power of two): butterflies (a, b) -> (a + b,
// a - b) at strides 1, 2, 4, ..., then one multiply by 1 / sqrt(n) (quant.py's fwht, same order).
// H is symmetric and orthogonal, so the same call rotates back.
inline void fwht(float* x, int64_t n) {
  for (int64_t h = 1; h < n; h *= 2) {
    for (int64_t i = 0; i < n; i += 2 * h) {
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
  const float s = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
  for (int64_t j = 0; j < n; ++j) x[j] *= s;
}

// One float32 row (already rotated for int4) -> its codes and scale: bf16(absmax / qmax), or
// bf16(fixed) where a static scale is given (fixed > 0: kv_cache_scales; values beyond saturate).
template <KVFormat F>
inline void encode_row(const float* x, int64_t n, uint8_t* codes, c10::BFloat16* scale, float fixed = 0.f) {
  float amax = 0.f;
  if (fixed <= 0.f) {
    for (int64_t d = 0; d < n; ++d) amax = std::max(amax, std::fabs(x[d]));
  }
  const c10::BFloat16 s(fixed > 0.f ? fixed : amax / kQmax<F>);
  *scale = s;
  const float sf = static_cast<float>(s);
  const float inv = sf > 0.f ? 1.f / sf : 0.f;
  constexpr float q = kQmax<F>;
  if constexpr (F == KVFormat::kInt8) {
    for (int64_t d = 0; d < n; ++d) {
      codes[d] = static_cast<uint8_t>(static_cast<int8_t>(std::clamp(std::nearbyint(x[d] * inv), -q, q)));
    }
  } else if constexpr (F == KVFormat::kFp8E4M3) {
    for (int64_t d = 0; d < n; ++d) codes[d] = c10::Float8_e4m3fn(std::clamp(x[d] * inv, -q, q)).x;
  } else if constexpr (F == KVFormat::kFp8E5M2) {
    for (int64_t d = 0; d < n; ++d) codes[d] = c10::Float8_e5m2(std::clamp(x[d] * inv, -q, q)).x;
  } else {
    for (int64_t d = 0; d < n; d += 2) {
      codes[d / 2] = static_cast<uint8_t>(int4_nibble(x[d] * inv) | (int4_nibble(x[d + 1] * inv) << 4));
    }
  }
}

// The 256 values an fp8 byte stands for (before the scale).
template <KVFormat F>
inline const std::array<float, 256>& fp8_values() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) {
      if constexpr (F == KVFormat::kFp8E4M3) {
        t[b] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(b), c10::Float8_e4m3fn::from_bits()));
      } else {
        t[b] = static_cast<float>(c10::Float8_e5m2(static_cast<uint8_t>(b), c10::Float8_e5m2::from_bits()));
      }
    }
    return t;
  }();
  return table;
}

// One row's codes -> n float32 values (times the row's scale), as KVCodec.decode.
template <KVFormat F>
inline void decode_row(const uint8_t* codes, float scale, float* out, int64_t n) {
  if constexpr (F == KVFormat::kInt8) {
    const int8_t* c = reinterpret_cast<const int8_t*>(codes);
    for (int64_t d = 0; d < n; ++d) out[d] = static_cast<float>(c[d]) * scale;
  } else if constexpr (F == KVFormat::kInt4) {
    for (int64_t d = 0; d < n; d += 2) {
      out[d] = kInt4Levels[codes[d / 2] & 0x0F] * scale;
      out[d + 1] = kInt4Levels[codes[d / 2] >> 4] * scale;
    }
  } else {
    const float* values = fp8_values<F>().data();
    for (int64_t d = 0; d < n; ++d) out[d] = values[codes[d]] * scale;
  }
}

}  // namespace pagedllm_cpu
