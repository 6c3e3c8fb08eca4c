// Shared by the C++ extensions: 16-float vectors (GCC/Clang vector extensions: AVX-512 with
// -march=native, narrower ISAs split them), a horizontal sum, and a vectorisable exp.
#pragma once

#include <cstdint>

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

}  // namespace pagedllm_cpu
