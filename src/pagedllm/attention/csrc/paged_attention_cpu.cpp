// Paged attention for CPU: reads K/V straight through the block table (no gather copy).
//
// One work item = (query tile of one sequence, kv head). For each item, the G = H / KH query
// heads that share the kv head are processed together so each K/V row is converted once. Keys
// are visited block by block with an online softmax: per block, the running max m, normaliser l
// and unnormalised accumulator are rescaled by exp(m_old - m_new) -- the log-sum-exp merge.
// A query at absolute position p sees keys 0..p (causal within the new chunk, all of the cached
// prefix). Storage may be float32, bfloat16 or float16; maths is float32 (on AVX512-BF16, the
// scores of a bf16 cache are float32 sums of exact bf16 products: kBf16Dot, kPairDot).
//
// Two inner loops compute the same thing. Tiles of many rows (prefill: up to 16 tokens x G heads)
// run a block as two small GEMMs in registers: scores [rows x keys] = Q K^T from the block's keys
// transposed (8 rows x 16 keys per micro-tile, one FMA per key vector per row), then
// acc += P V (a few rows x the whole head dim per micro-tile); their sequences' blocks are
// converted to float32 (K transposed) once per call, before the tiles, not once per tile. Tiles of
// few rows (decode: G rows) take one dot product per (row, key), where transposing the block
// would cost more than it saves; on AVX2 and AVX-512, those of 1-3 rows per kv head (decode_tile)
// read K and V in their stored dtype, widened in registers, each row once for all the rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"
#include "kernel_abi.h"
#include "kv_codec.h"

namespace {

using namespace pagedllm_cpu;

constexpr int kQueryTile = 16;

// softmax arguments are <= 0
inline float exp_nonpositive(float x) { return exp_poly(x); }

template <typename T>
inline void to_float(const T* src, float* dst, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// bfloat16 is the top half of a float32: widen the bits directly (vectorises, unlike the class cast)
template <>
inline void to_float<c10::BFloat16>(const c10::BFloat16* src, float* dst, int n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

template <typename T>
inline void from_float(const float* src, T* dst, int n) {
  for (int i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

struct Tile {
  int64_t seq;
  int64_t q_begin;  // row in the flat batch
  int64_t q_end;
};

// Register tiles: AVX-512 has 32 16-float registers, AVX2 16 8-float ones (each 16-float vector
// takes two): there an 8-row x 32-key Q K^T tile (32 halves of accumulators) and a 4-row x D P V
// tile spilled to the stack on every FMA.
#ifdef __AVX512F__
constexpr int kScoreRows = 8;   // rows of one Q K^T micro-tile (x 16 keys)
constexpr bool kScorePairs = true;  // 32 keys per micro-tile (two accumulators per row)
constexpr int kPvRowsMax = 16;      // P V micro-tile rows: at most 16 / (D / 16)
#else
constexpr int kScoreRows = 4;
constexpr bool kScorePairs = false;
constexpr int kPvRowsMax = 1;
#endif
constexpr int kKeyChunk = 64;   // keys per online-softmax step of the tiled path

// AVX512-BF16 (Zen 4, Sapphire Rapids and later): the Q K^T of a bf16 cache takes its dot products
// on the stored bits (VDPBF16PS: pairs of bf16 products, exact in float32, summed in float32), so
// the decode paths never convert a block's keys, and the tiled path's Q K^T micro-tiles take half
// the instructions of float32 FMAs (its P V too: kPairDot). Not bit-equal to the float32 dot
// product of the other families (another summation order, denormals read as zero): within the
// tests' bf16 tolerance, and the scale is applied to the score instead of the query.
#ifdef __AVX512BF16__
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif
// Whether a cache of T at head dim kD runs on bf16 pairs: the decode paths' scores (attention_kernel),
// and the tiled path's Q K^T and P V micro-tiles (attend_tile_gemm, its probabilities rounded to bf16).
template <typename T, int kD>
constexpr bool kPairDot = kBf16Dot && std::is_same_v<T, c10::BFloat16> && kD > 0 && kD % 32 == 0;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The keys and values of the sequences that take the tiled path, converted to float32 once per
// call (not once per query tile) and laid out for it: per (sequence, kv head), K transposed in
// groups of 16 positions, [L16 / 16][D][16] (L16 = its length rounded up to 16, the tail zero: a
// micro-tile reads one contiguous 4 KiB run, not 64 rows 4 KiB apart), and V as [L16][D]. Key
// chunks then span block boundaries. Where the tiled path runs on bf16 pairs (kPairDot: a bf16
// cache, attend_tile_gemm), K and V stay in their stored bits instead: K transposed by pairs of
// dims, kp [L16 / 16][D / 2][16][2] (one 64-byte vector per pair of dims of 16 keys), V by pairs
// of positions, vp [L16 / 2][D][2] (16 dims of two keys per vector); kt and v are empty.
struct ConvertedSeqs {
  int64_t D;
  std::vector<int64_t> offset, len16;  // per sequence (offset -1: not converted)
  std::vector<float> kt, v;
  std::vector<uint16_t> kp, vp;
  const float* k_of(int64_t seq, int64_t kh) const { return &kt[offset[seq] + kh * D * len16[seq]]; }
  const uint16_t* kp_of(int64_t seq, int64_t kh) const { return &kp[offset[seq] + kh * D * len16[seq]]; }
  const float* v_of(int64_t seq, int64_t kh) const { return &v[offset[seq] + kh * len16[seq] * D]; }
  const uint16_t* vp_of(int64_t seq, int64_t kh) const { return &vp[offset[seq] + kh * len16[seq] * D]; }
};

template <typename T, bool kPairs = false>
ConvertedSeqs convert_sequences(const T* kc, const T* vc, const std::vector<char>& wanted, const int64_t* seq_lens,
                                const int64_t* tables, int64_t max_blocks, int64_t KH, int64_t D, int64_t B) {
  const int64_t S = static_cast<int64_t>(wanted.size());
  ConvertedSeqs c{D, std::vector<int64_t>(S, -1), std::vector<int64_t>(S, 0), {}, {}};
  std::vector<std::pair<int64_t, int64_t>> blocks;  // (sequence, logical block)
  int64_t total = 0;
  for (int64_t s = 0; s < S; ++s) {
    if (!wanted[s]) continue;
    c.offset[s] = total;
    c.len16[s] = round_up(seq_lens[s], 16);
    total += KH * c.len16[s] * D;
    for (int64_t b = 0; b * B < seq_lens[s]; ++b) blocks.push_back({s, b});
  }
  if (blocks.empty()) return c;
  if constexpr (kPairs) {
    c.kp.assign(total, 0);
    c.vp.assign(total, 0);
  } else {
    c.kt.assign(total, 0.f);
    c.v.assign(total, 0.f);
  }
  const int64_t n_items = static_cast<int64_t>(blocks.size()) * KH;
  const int64_t row_stride = KH * D, block_stride = B * KH * D;
  at::parallel_for(0, n_items, 16, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const auto [seq, b] = blocks[it / KH];
      const int64_t kh = it % KH, L16 = c.len16[seq];
      const int64_t n = std::min<int64_t>(B, seq_lens[seq] - b * B);  // the keys written so far
      const int64_t phys = tables[seq * max_blocks + b];
      const T* kb = kc + phys * block_stride + kh * D;
      const T* vb = vc + phys * block_stride + kh * D;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t pos = b * B + j;
        const T* kr = kb + j * row_stride;
        const T* vr = vb + j * row_stride;
        if constexpr (kPairs) {  // K: 32-bit words (two dims) transposed as kt's floats are
          uint16_t* kcol = &c.kp[c.offset[seq] + kh * D * L16 + (pos / 16) * D * 16 + (pos % 16) * 2];
          for (int64_t p = 0; p < D / 2; ++p) std::memcpy(kcol + p * 32, kr + 2 * p, 2 * sizeof(T));
          uint16_t* vpair = &c.vp[c.offset[seq] + kh * L16 * D + (pos / 2) * 2 * D + pos % 2];
          for (int64_t d = 0; d < D; ++d) std::memcpy(vpair + 2 * d, vr + d, sizeof(T));
        } else {
          float* kcol = &c.kt[c.offset[seq] + kh * D * L16 + (pos / 16) * D * 16 + pos % 16];
          for (int64_t d = 0; d < D; ++d) kcol[d * 16] = static_cast<float>(kr[d]);
          to_float(vr, &c.v[c.offset[seq] + kh * L16 * D + pos * D], static_cast<int>(D));
        }
      }
    }
  });
  return c;
}

// Per-thread buffers of the tiled path, sized for the largest tile.
struct TiledScratch {
  int64_t rows_pad;
  std::vector<float> qf, acc, m, l, alpha, scores;
  std::vector<uint32_t> qp;  // the rows' stored bf16 bits by pairs of dims (kPairDot)
  std::vector<uint16_t> pp;  // a chunk's p rounded to bf16, kKeyChunk per row (kPairDot)
  TiledScratch(int64_t max_rows, int64_t D)
      : rows_pad(round_up(max_rows, kScoreRows)), qf(rows_pad * D, 0.f), acc(rows_pad * D), m(rows_pad),
        l(rows_pad), alpha(rows_pad), scores(rows_pad * kKeyChunk), qp(rows_pad * D / 2, 0),
        pp(rows_pad * kKeyChunk, 0) {}
};

// The cache line at p fetched into L2 (prefetcht1). An asm statement, not __builtin_prefetch:
// GCC 12 dropped whole loops of the builtin once they moved into a helper (objdump showed no
// prefetcht1 left in the decode path, which then ran about as slowly as with no prefetch:
// docs/design.md, session 35).
inline void prefetch_l2(const char* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// The rows of kv head kh of the block at `next` (n rows of kRowBytes, row_stride bytes apart), fetched
// into L2 (prefetcht1). Nothing where next is null.
template <int64_t kRowBytes>
inline void prefetch_rows(const char* next, int64_t rows, int64_t stride) {
  if (next == nullptr) return;
  for (int64_t j = 0; j < rows; ++j) {
    for (int64_t o = 0; o < kRowBytes; o += 64) prefetch_l2(next + j * stride + o);
  }
}

// The K and V scales of a block's B slots from first_slot (bf16, KH per slot), fetched into L2.
inline void prefetch_scales(const c10::BFloat16* ks, const c10::BFloat16* vs, int64_t first_slot, int64_t B,
                            int64_t KH) {
  const int64_t bytes = B * KH * static_cast<int64_t>(sizeof(c10::BFloat16));
  const char* k = reinterpret_cast<const char*>(ks + first_slot * KH);
  const char* v = reinterpret_cast<const char*>(vs + first_slot * KH);
  for (int64_t o = 0; o < bytes + 63; o += 64) {
    const int64_t at = std::min<int64_t>(o, bytes - 1);  // the last line too, never past the block
    prefetch_l2(k + at);
    prefetch_l2(v + at);
  }
}

// One row's online-softmax step over a block's scores sr[0..n) of which the first `visible` count:
// they become p = exp(s - m_new) (0 for the rest); returns alpha = exp(m_old - m_new).
inline float softmax_step(float* sr, int64_t n, int64_t visible, float& m, float& l) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  // the same step on 8-float registers (cpu_vec.h: 16-float selects go through the stack on AVX2)
  const __m256 iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 limit = _mm256_set1_ps(static_cast<float>(visible));
  __m256 vmax = neg_inf;
  for (int64_t jc = 0; jc < n; jc += 8) {
    __m256 x = _mm256_loadu_ps(sr + jc);
    if (jc + 8 > visible) {
      x = _mm256_blendv_ps(neg_inf, x, _mm256_cmp_ps(_mm256_add_ps(iota, _mm256_set1_ps(static_cast<float>(jc))),
                                                     limit, _CMP_LT_OQ));
    }
    vmax = _mm256_max_ps(vmax, x);
  }
  const float m_new = std::max(m, hmax8(vmax));
  const float alpha = std::isinf(m) ? 0.f : exp_nonpositive(m - m_new);
  const __m256 shift = _mm256_set1_ps(m_new);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t jc = 0; jc < n; jc += 8) {
    __m256 p = exp_poly8(_mm256_sub_ps(_mm256_loadu_ps(sr + jc), shift));
    if (jc + 8 > visible) {
      p = _mm256_blendv_ps(_mm256_setzero_ps(), p, _mm256_cmp_ps(_mm256_add_ps(iota, _mm256_set1_ps(static_cast<float>(jc))),
                                                                limit, _CMP_LT_OQ));
    }
    _mm256_storeu_ps(sr + jc, p);
    sum = _mm256_add_ps(sum, p);
  }
  l = l * alpha + hsum8(sum);
  m = m_new;
  return alpha;
#else
  const v16 iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // lanes at or past `visible` are masked: only in the vector that holds it (a row's diagonal, or a
  // partial last vector), not in the fully visible ones before it
  v16 vmax = v16{} + neg_inf;
  for (int64_t jc = 0; jc < n; jc += 16) {
    const v16 x = *reinterpret_cast<const v16*>(sr + jc);
    const v16 y = jc + 16 > visible ? (iota + static_cast<float>(jc) < static_cast<float>(visible) ? x : neg_inf) : x;
    vmax = vmax > y ? vmax : y;
  }
  const float m_new = std::max(m, hmax(vmax));
  const float alpha = std::isinf(m) ? 0.f : exp_nonpositive(m - m_new);
  v16 sum = {};
  for (int64_t jc = 0; jc < n; jc += 16) {
    v16* x = reinterpret_cast<v16*>(sr + jc);
    const v16 p = exp_poly16(*x - m_new);
    *x = jc + 16 > visible ? (iota + static_cast<float>(jc) < static_cast<float>(visible) ? p : v16{}) : p;
    sum += *x;
  }
  l = l * alpha + hsum(sum);
  m = m_new;
  return alpha;
#endif
}

// The online-softmax step of R few rows over a block's scores (sc, R rows of KP): each row that
// sees a key of the block (visible[r] > 0) gets its p values and alpha[r]; the others p = 0 and
// alpha 1 (left as they are). Returns how many keys any row sees (the P V loop's length).
template <int R>
inline int64_t softmax_rows(float* sc, int64_t KP, int64_t n, const int64_t* visible, float* m, float* l,
                            float* alpha) {
  int64_t keys = 0;
  for (int r = 0; r < R; ++r) {
    if (visible[r] > 0) {
      alpha[r] = softmax_step(sc + r * KP, n, visible[r], m[r], l[r]);
      keys = std::max(keys, visible[r]);
    } else {
      alpha[r] = 1.f;
      std::fill(sc + r * KP, sc + r * KP + n, 0.f);
    }
  }
  return keys;
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// 8 stored K/V values -> 8 floats, in registers (float32, bfloat16 and float16 caches)
template <typename T>
constexpr bool kLoads8 = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>;
template <typename T>
inline __m256 load8(const T* p);
template <>
inline __m256 load8<float>(const float* p) { return _mm256_loadu_ps(p); }
template <>
inline __m256 load8<c10::BFloat16>(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
template <>
inline __m256 load8<c10::Half>(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// {sum of a's lanes, of b's, of c's, of d's}
inline __m128 hsum4x8(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// acc (R rows of kD) = alpha[r] * acc + sum over the first `keys` value rows j of weight(r, j) *
// value(j, c) for each 8-float chunk c of row j (widened in registers): register tiles of R rows x
// 4 chunks, each value row read once for all R rows, one FMA per key in key order.
template <int kD, int R, typename Value, typename Weight>
inline void pv_tiles_avx2(float* acc, const float* alpha, int64_t keys, Value value, Weight weight) {
  static_assert(kD % 32 == 0, "P V tiles of 32 dims");
  constexpr int NV = kD / 8, C = 4;  // 8-float registers per row in one P V tile
  for (int c0 = 0; c0 < NV; c0 += C) {
    __m256 a[R][C];
    for (int r = 0; r < R; ++r) {
      const __m256 scale_old = _mm256_set1_ps(alpha[r]);
      for (int i = 0; i < C; ++i) a[r][i] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * kD + 8 * (c0 + i)), scale_old);
    }
    for (int64_t jj = 0; jj < keys; ++jj) {
      __m256 p[R];
      for (int r = 0; r < R; ++r) p[r] = _mm256_set1_ps(weight(r, jj));
      for (int i = 0; i < C; ++i) {
        const __m256 vv = value(jj, c0 + i);
        for (int r = 0; r < R; ++r) a[r][i] = _mm256_fmadd_ps(p[r], vv, a[r][i]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int i = 0; i < C; ++i) _mm256_storeu_ps(acc + r * kD + 8 * (c0 + i), a[r][i]);
    }
  }
}

// The few-row (decode) path's block step on AVX2, for R = 1-3 rows of one kv head: K and V are
// read in their stored dtype and widened in registers, each key and value row once for all R rows
// (the generic body converts the block into a float32 copy first, and its 16-float vectors take
// two of AVX2's 16 registers each, so its Q K^T of 16 keys spilled to the stack). Scores 4 keys at
// a time (R x 4 accumulators, reduced by hadd), the online-softmax step per row, then P V on
// register tiles of R rows x 32 dims (kD % 32 == 0: the compiled head dims 32, 64 and 128). The P V sums run in the same order as the generic
// AVX2 body's (acc * alpha, then one FMA per key); the Q K^T sums in another (8 lanes, then a
// tree). A row with no visible key in the block is left as it is.
template <typename T, int kD, int R>
void decode_block_avx2(const T* kb, const T* vb, int64_t row_stride, int64_t n, const int64_t* visible,
                       const float* qf, const T*, float, float* sc, int64_t KP, float*, float* acc, float* m,
                       float* l, const char* v_next, int64_t B) {
  constexpr int NV = kD / 8;
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    __m256 s[R][4];
    for (int r = 0; r < R; ++r) {
      for (int jj = 0; jj < 4; ++jj) s[r][jj] = _mm256_setzero_ps();
    }
    for (int v = 0; v < NV; ++v) {
      __m256 qv[R];
      for (int r = 0; r < R; ++r) qv[r] = _mm256_loadu_ps(qf + r * kD + 8 * v);
      for (int jj = 0; jj < 4; ++jj) {
        const __m256 k = load8(kb + (j + jj) * row_stride + 8 * v);
        for (int r = 0; r < R; ++r) s[r][jj] = _mm256_fmadd_ps(qv[r], k, s[r][jj]);
      }
    }
    for (int r = 0; r < R; ++r) _mm_storeu_ps(sc + r * KP + j, hsum4x8(s[r][0], s[r][1], s[r][2], s[r][3]));
  }
  for (; j < n; ++j) {
    __m256 s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_ps();
    for (int v = 0; v < NV; ++v) {
      const __m256 k = load8(kb + j * row_stride + 8 * v);
      for (int r = 0; r < R; ++r) s[r] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + r * kD + 8 * v), k, s[r]);
    }
    for (int r = 0; r < R; ++r) sc[r * KP + j] = hsum8(s[r]);
  }
  prefetch_rows<kD * sizeof(T)>(v_next, B, row_stride * sizeof(T));
  float alpha[R];
  const int64_t keys = softmax_rows<R>(sc, KP, n, visible, m, l, alpha);
  pv_tiles_avx2<kD, R>(acc, alpha, keys, [&](int64_t j, int c) { return load8(vb + j * row_stride + 8 * c); },
                       [&](int r, int64_t j) { return sc[r * KP + j]; });
}
#endif

#ifdef __AVX512F__
// 16 stored K/V values -> 16 floats, in registers (float32, bfloat16 and float16 caches)
template <typename T>
constexpr bool kLoads16 = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>;
template <typename T>
inline __m512 load16(const T* p);
template <>
inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
template <>
inline __m512 load16<c10::Half>(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// pv_tiles_avx2 on AVX-512: 16-float chunks, up to 4 per tile.
template <int kD, int R, typename Value, typename Weight>
inline void pv_tiles_avx512(float* acc, const float* alpha, int64_t keys, Value value, Weight weight) {
  constexpr int NV = kD / 16;
  constexpr int C = NV < 4 ? NV : 4;  // 16-float registers per row in one P V tile
  static_assert(NV % C == 0, "P V tiles cover the head dim");
  for (int c0 = 0; c0 < NV; c0 += C) {
    __m512 a[R][C];
    for (int r = 0; r < R; ++r) {
      const __m512 scale_old = _mm512_set1_ps(alpha[r]);
      for (int i = 0; i < C; ++i) a[r][i] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * kD + 16 * (c0 + i)), scale_old);
    }
    for (int64_t jj = 0; jj < keys; ++jj) {
      __m512 p[R];
      for (int r = 0; r < R; ++r) p[r] = _mm512_set1_ps(weight(r, jj));
      for (int i = 0; i < C; ++i) {
        const __m512 vv = value(jj, c0 + i);
        for (int r = 0; r < R; ++r) a[r][i] = _mm512_fmadd_ps(p[r], vv, a[r][i]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int i = 0; i < C; ++i) _mm512_storeu_ps(acc + r * kD + 16 * (c0 + i), a[r][i]);
    }
  }
}

// Scores of R rows (qf: kD floats each) over n float32 keys key_stride apart, 16 keys at a time: one
// partial-product vector per key, summed across lanes together (reduce16), times the keys'
// scales where ks is given (KP entries). Row r's scores go to sc + r * KP.
template <int kD, int R>
inline void float_scores(const float* keys, int64_t key_stride, int64_t n, const float* qf, const float* ks,
                         float* sc, int64_t KP) {
  constexpr int NV = kD / 16;
  for (int r = 0; r < R; ++r) {
    v16 qv[NV];
    for (int v = 0; v < NV; ++v) qv[v] = *reinterpret_cast<const v16*>(qf + r * kD + 16 * v);
    for (int64_t jc = 0; jc < n; jc += 16) {
      v16 part[16];
      const int64_t count = std::min<int64_t>(16, n - jc);
      for (int jj = 0; jj < 16; ++jj) {
        if (jj < count) {
          const v16* kr = reinterpret_cast<const v16*>(keys + (jc + jj) * key_stride);
          v16 dot = qv[0] * kr[0];
          for (int v = 1; v < NV; ++v) dot += qv[v] * kr[v];
          part[jj] = dot;
        } else {
          part[jj] = v16{};
        }
      }
      const v16 sums = reduce16(part);
      *reinterpret_cast<v16*>(sc + r * KP + jc) = ks ? sums * *reinterpret_cast<const v16*>(ks + jc) : sums;
    }
  }
}

// The few-row (decode) path's block step on AVX-512, for R = 1-3 rows of one kv head. Q K^T: per
// row, 16 keys at a time, one partial-product vector per key summed across lanes together
// (reduce16): on the stored bf16 bits by VDPBF16PS where kBf16Dot (qraw, the unscaled query; the
// score times `scale`), else on float32 keys (a float32 cache's rows as stored, the others
// converted once per block into kf). Then the online-softmax step per row, and P V with V widened
// in registers, each value row read once for all R rows: R x C independent accumulators (where
// one row at a time chained 4 FMAs per key, latency-bound, over a float32 copy of the block).
// The sums run in the same order as the generic AVX-512 body's (acc * alpha, then one FMA per
// key). A row with no visible key in the block is left as it is.
template <typename T, int kD, int R>
void decode_block_avx512(const T* kb, const T* vb, int64_t row_stride, int64_t n, const int64_t* visible,
                         const float* qf, const T* qraw, float scale, float* sc, int64_t KP, float* kf, float* acc,
                         float* m, float* l, const char* v_next, int64_t B) {
  constexpr int NV = kD / 16;
  constexpr bool bf16_dot = kBf16Dot && std::is_same_v<T, c10::BFloat16>;
  if constexpr (bf16_dot) {
#ifdef __AVX512BF16__
    constexpr int NB = kD / 32;  // head dim in 32-bf16 vectors
    for (int r = 0; r < R; ++r) {
      __m512bh qv[NB];
      for (int v = 0; v < NB; ++v) qv[v] = (__m512bh)_mm512_loadu_si512(qraw + r * kD + 32 * v);
      for (int64_t jc = 0; jc < n; jc += 16) {
        v16 part[16];
        const int64_t count = std::min<int64_t>(16, n - jc);
        for (int jj = 0; jj < 16; ++jj) {
          if (jj < count) {
            const T* kr = kb + (jc + jj) * row_stride;
            __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(kr));
            for (int v = 1; v < NB; ++v) dot = _mm512_dpbf16_ps(dot, qv[v], (__m512bh)_mm512_loadu_si512(kr + 32 * v));
            part[jj] = (v16)dot;
          } else {
            part[jj] = v16{};
          }
        }
        *reinterpret_cast<v16*>(sc + r * KP + jc) = reduce16(part) * scale;
      }
    }
#endif
  } else {
    const float* keys = nullptr;
    int64_t key_stride = kD;
    if constexpr (std::is_same_v<T, float>) {
      keys = kb;
      key_stride = row_stride;
    } else {
      for (int64_t j = 0; j < n; ++j) {
        for (int v = 0; v < NV; ++v) _mm512_storeu_ps(kf + j * kD + 16 * v, load16(kb + j * row_stride + 16 * v));
      }
      keys = kf;
    }
    float_scores<kD, R>(keys, key_stride, n, qf, nullptr, sc, KP);
  }
  prefetch_rows<kD * sizeof(T)>(v_next, B, row_stride * sizeof(T));
  float alpha[R];
  const int64_t keys_seen = softmax_rows<R>(sc, KP, n, visible, m, l, alpha);
  pv_tiles_avx512<kD, R>(acc, alpha, keys_seen,
                         [&](int64_t j, int c) { return load16(vb + j * row_stride + 16 * c); },
                         [&](int r, int64_t j) { return sc[r * KP + j]; });
}
#endif

// The few-row block step of this ISA (decode_block_avx2 / decode_block_avx512), and whether a
// cache dtype T at head dim kD has one. Few-row tiles that have one take decode_tile below.
#if defined(__AVX512F__)
template <typename T, int kD>
constexpr bool kFewRowPath = kD > 0 && kD % 32 == 0 && kLoads16<T>;
template <typename T, int kD, int R>
constexpr auto kDecodeBlockOf = decode_block_avx512<T, kD, R>;
#elif defined(__AVX2__)
template <typename T, int kD>
constexpr bool kFewRowPath = kD > 0 && kD % 32 == 0 && kLoads8<T>;
template <typename T, int kD, int R>
constexpr auto kDecodeBlockOf = decode_block_avx2<T, kD, R>;
#else
template <typename T, int kD>
constexpr bool kFewRowPath = false;
#endif
constexpr int kFewRows = 3;  // the most rows per kv head that decode_tile takes

// A few-row tile's state for one kv head (decode_tile): up to kFewRows rows.
struct FewRowScratch {
  std::vector<float> qf, acc, m, l, scores, kf;
  std::vector<uint16_t> qraw;  // the unscaled query's bits where T is 16-bit (the bf16 dot product)
  int64_t KP;
  FewRowScratch(int64_t D, int64_t kp, int64_t B)
      : qf(kFewRows * D), acc(kFewRows * D), m(kFewRows), l(kFewRows), scores(kFewRows * kp), kf(B * D),
        qraw(kFewRows * D), KP(kp) {}
};

// One few-row tile (1-3 rows of kv head kh: a decode token) block by block, the next block's rows
// of this kv head fetched into L2 meanwhile (prefetcht1): its keys at a block's start, its values
// once the block's scores are taken (the block step), so that half the misses are in flight at a
// time (64 at once stalled on the miss buffers: docs/design.md, session 35); the caller fetches
// an item's first block one item ahead. One item per (tile, kv head): on this
// EPYC (AVX-512 BF16) and in its AVX2 build, one item over all of a tile's kv heads, each block
// read whole (what session 15 measured best on AVX2 against the generic body), was slower than
// this at every batch, e.g. 1.93-2.03 against 1.38-1.60 ms per layer at 64 x 512 tokens and 0.13
// against 0.05-0.07 at 1 x 1,024 (scripts/decode_attention_time.py with L=30; docs/benchmarks.md,
// "AVX-512 BF16, session 17"), and a block fetched into L1 (prefetcht0) waited on the miss buffers.
#if defined(__AVX512F__) || defined(__AVX2__)
template <typename T, int kD>
void decode_tile(const T* q, const T* kc, const T* vc, T* out, const int64_t* table, int64_t q_begin, int64_t rows,
                 int64_t first_pos, int64_t H, int64_t KH, int64_t G, int64_t B, float scale, int64_t kh,
                 FewRowScratch& s) {
  const int64_t row_stride = KH * kD, block_stride = B * row_stride;
  for (int64_t r = 0; r < rows; ++r) {
    const T* qr_in = q + ((q_begin + r / G) * H + kh * G + r % G) * kD;
    float* qr = &s.qf[r * kD];
    to_float(qr_in, qr, kD);
    for (int d = 0; d < kD; ++d) qr[d] *= scale;
    if constexpr (sizeof(T) == 2) std::memcpy(&s.qraw[r * kD], qr_in, kD * sizeof(T));
    s.m[r] = -std::numeric_limits<float>::infinity();
    s.l[r] = 0.f;
    std::fill(&s.acc[r * kD], &s.acc[r * kD] + kD, 0.f);
  }
  const int64_t nq = rows / G;
  const int64_t last_key = first_pos + nq;  // keys 0..last_key-1 are visible to some row
  const int64_t nblocks = (last_key + B - 1) / B;
  constexpr void (*kDecodeBlock[])(const T*, const T*, int64_t, int64_t, const int64_t*, const float*, const T*,
                                   float, float*, int64_t, float*, float*, float*, float*, const char*, int64_t) = {
      kDecodeBlockOf<T, kD, 1>, kDecodeBlockOf<T, kD, 2>, kDecodeBlockOf<T, kD, 3>};
  constexpr int64_t kRowBytes = kD * static_cast<int64_t>(sizeof(T));
  const int64_t stride = row_stride * static_cast<int64_t>(sizeof(T));
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t n = std::min<int64_t>(B, last_key - b * B);
    // the next block's keys now, its values after this block's scores (in the block step): half
    // the misses in flight at a time, each a block step ahead of its use
    const char* vn = nullptr;
    if (b + 1 < nblocks) {
      prefetch_rows<kRowBytes>(reinterpret_cast<const char*>(kc + table[b + 1] * block_stride + kh * kD), B, stride);
      vn = reinterpret_cast<const char*>(vc + table[b + 1] * block_stride + kh * kD);
    }
    int64_t visible[kFewRows];
    for (int64_t r = 0; r < rows; ++r) visible[r] = std::min<int64_t>(n, first_pos + r / G - b * B + 1);
    kDecodeBlock[rows - 1](kc + table[b] * block_stride + kh * kD, vc + table[b] * block_stride + kh * kD, row_stride,
                           n, visible, s.qf.data(), reinterpret_cast<const T*>(s.qraw.data()), scale, s.scores.data(),
                           s.KP, s.kf.data(), s.acc.data(), s.m.data(), s.l.data(), vn, B);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* ar = &s.acc[r * kD];
    const float inv = 1.f / s.l[r];
    for (int d = 0; d < kD; ++d) ar[d] *= inv;
    from_float(ar, out + ((q_begin + r / G) * H + kh * G + r % G) * kD, kD);
  }
}
#endif

// One (query tile, kv head) item by small GEMMs over a converted sequence, kKeyChunk keys at a
// time: rows r = i * G + g (query token i, head g), the first token at absolute position first_pos.
// kD % 16 == 0.
template <typename T, int kD>
void attend_tile_gemm(const T* q, T* out, int64_t seq, int64_t q_begin, int64_t nq, int64_t first_pos, int64_t H,
                      int64_t G, int64_t kh, float scale, const ConvertedSeqs& keys, TiledScratch& s) {
  constexpr int NV = kD / 16;                     // head dim in 16-float vectors
  constexpr int kPvRows = NV >= 16 ? 1 : std::min(kPvRowsMax, 16 / NV);  // P V micro-tile: kPvRows x kD accumulators
  static_assert(kScoreRows % kPvRows == 0, "P V row groups must tile the score row groups");
  constexpr int64_t KP = kKeyChunk;
  constexpr bool pair_dot = kPairDot<T, kD>;
  const float* kt_all = pair_dot ? nullptr : keys.k_of(seq, kh);
  const float* v_all = pair_dot ? nullptr : keys.v_of(seq, kh);
  const int64_t rows = nq * G, rows_pad = round_up(rows, kScoreRows);
  float* qf = s.qf.data();
  float* acc = s.acc.data();
  float* sc = s.scores.data();
  for (int64_t r = 0; r < rows_pad; ++r) {
    const T* qsrc = q + ((q_begin + r / G) * H + kh * G + r % G) * kD;
    if constexpr (pair_dot) {  // the unscaled query's bits: the scale multiplies the scores
      uint32_t* qr = s.qp.data() + r * (kD / 2);
      if (r < rows) {
        std::memcpy(qr, qsrc, kD * sizeof(T));
      } else {
        std::fill(qr, qr + kD / 2, 0u);  // padding rows: finite, never stored
      }
    } else {
      float* qr = qf + r * kD;
      if (r < rows) {
        to_float(qsrc, qr, kD);
        for (int d = 0; d < kD; ++d) qr[d] *= scale;
      } else {
        std::fill(qr, qr + kD, 0.f);  // padding rows: finite, never stored
      }
    }
    s.m[r] = -std::numeric_limits<float>::infinity();
    s.l[r] = 0.f;
    std::fill(acc + r * kD, acc + (r + 1) * kD, 0.f);
  }
  const int64_t last_key = first_pos + nq;
  for (int64_t c0 = 0; c0 < last_key; c0 += kKeyChunk) {
    const int64_t n = std::min<int64_t>(kKeyChunk, last_key - c0);
    // rows before r0 see no key of this chunk (causal): they are skipped whole micro-tiles at a time
    const int64_t r0 = std::max<int64_t>(0, c0 - first_pos) * G / kScoreRows * kScoreRows;
    if constexpr (pair_dot) {  // c0 is a multiple of 16
#ifdef __AVX512BF16__
      // scores = scale * Q K^T by bf16 pairs: kScoreRows x 32 keys per micro-tile, one VDPBF16PS
      // per two dims (exact products, summed in float32), then a last 16 keys where n leaves them
      const uint16_t* kp = keys.kp_of(seq, kh) + c0 * kD;
      const __m512 vscale = _mm512_set1_ps(scale);
      for (int64_t r = r0; r < rows_pad; r += kScoreRows) {
        const uint32_t* qr = s.qp.data() + r * (kD / 2);
        for (int64_t jc = 0; jc < n; jc += jc + 32 <= n ? 32 : 16) {
          const bool two = jc + 32 <= n;  // 32 keys, else the last 16
          __m512 a[kScoreRows], b[kScoreRows];
          for (int rr = 0; rr < kScoreRows; ++rr) a[rr] = b[rr] = _mm512_setzero_ps();
          const uint16_t* k0 = kp + jc * kD;
          if (two) {
            for (int p = 0; p < kD / 2; ++p) {
              const __m512bh kv0 = (__m512bh)_mm512_loadu_si512(k0 + p * 32);
              const __m512bh kv1 = (__m512bh)_mm512_loadu_si512(k0 + 16 * kD + p * 32);
              for (int rr = 0; rr < kScoreRows; ++rr) {
                const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(qr[rr * (kD / 2) + p]));
                a[rr] = _mm512_dpbf16_ps(a[rr], x, kv0);
                b[rr] = _mm512_dpbf16_ps(b[rr], x, kv1);
              }
            }
          } else {
            for (int p = 0; p < kD / 2; ++p) {
              const __m512bh kv0 = (__m512bh)_mm512_loadu_si512(k0 + p * 32);
              for (int rr = 0; rr < kScoreRows; ++rr)
                a[rr] = _mm512_dpbf16_ps(a[rr], (__m512bh)_mm512_set1_epi32(static_cast<int>(qr[rr * (kD / 2) + p])),
                                         kv0);
            }
          }
          for (int rr = 0; rr < kScoreRows; ++rr) {
            _mm512_storeu_ps(sc + (r + rr) * KP + jc, _mm512_mul_ps(a[rr], vscale));
            if (two) _mm512_storeu_ps(sc + (r + rr) * KP + jc + 16, _mm512_mul_ps(b[rr], vscale));
          }
        }
      }
#endif
    } else {
      const float* kt = kt_all + c0 * kD;
      // scores = Q K^T: kScoreRows x 32 keys per micro-tile (16 accumulators: each broadcast q
      // element feeds two FMAs), then a last 16 keys where n leaves them
      for (int64_t r = r0; r < rows_pad; r += kScoreRows) {
        const float* qr = qf + r * kD;
        int64_t jc = 0;
        for (; kScorePairs && jc + 32 <= n; jc += 32) {
          v16 a[kScoreRows] = {}, b[kScoreRows] = {};
          const float* k0 = kt + jc * kD;
          for (int d = 0; d < kD; ++d) {
            const v16 kv0 = *reinterpret_cast<const v16*>(k0 + d * 16);
            const v16 kv1 = *reinterpret_cast<const v16*>(k0 + 16 * kD + d * 16);
            for (int rr = 0; rr < kScoreRows; ++rr) {
              const float x = qr[rr * kD + d];
              a[rr] += x * kv0;
              b[rr] += x * kv1;
            }
          }
          for (int rr = 0; rr < kScoreRows; ++rr) {
            *reinterpret_cast<v16*>(sc + (r + rr) * KP + jc) = a[rr];
            *reinterpret_cast<v16*>(sc + (r + rr) * KP + jc + 16) = b[rr];
          }
        }
        for (; jc < n; jc += 16) {
#if defined(__AVX2__) && !defined(__AVX512F__)
          // 8-float registers (cpu_vec.h): kScoreRows x 16 keys in 2 x kScoreRows accumulators
          __m256 lo[kScoreRows], hi[kScoreRows];
          for (int rr = 0; rr < kScoreRows; ++rr) lo[rr] = hi[rr] = _mm256_setzero_ps();
          const float* k0 = kt + jc * kD;
          for (int d = 0; d < kD; ++d) {
            const __m256 k_lo = _mm256_loadu_ps(k0 + d * 16), k_hi = _mm256_loadu_ps(k0 + d * 16 + 8);
            for (int rr = 0; rr < kScoreRows; ++rr) {
              const __m256 x = _mm256_broadcast_ss(qr + rr * kD + d);
              lo[rr] = _mm256_fmadd_ps(x, k_lo, lo[rr]);
              hi[rr] = _mm256_fmadd_ps(x, k_hi, hi[rr]);
            }
          }
          for (int rr = 0; rr < kScoreRows; ++rr) {
            _mm256_storeu_ps(sc + (r + rr) * KP + jc, lo[rr]);
            _mm256_storeu_ps(sc + (r + rr) * KP + jc + 8, hi[rr]);
          }
#else
          v16 a[kScoreRows] = {};
          for (int d = 0; d < kD; ++d) {
            const v16 kv = *reinterpret_cast<const v16*>(kt + jc * kD + d * 16);
            for (int rr = 0; rr < kScoreRows; ++rr) a[rr] += qr[rr * kD + d] * kv;
          }
          for (int rr = 0; rr < kScoreRows; ++rr) *reinterpret_cast<v16*>(sc + (r + rr) * KP + jc) = a[rr];
#endif
        }
      }
    }
    // online softmax per row; masked keys (and rows that see none) get p = 0, alpha = 1
    for (int64_t r = r0; r < rows_pad; ++r) {
      float* sr = sc + r * KP;
      const int64_t visible = r < rows ? std::min<int64_t>(n, first_pos + r / G - c0 + 1) : 0;
      if (visible <= 0) {
        std::fill(sr, sr + round_up(n, 16), 0.f);  // as the masked lanes: the pair path reads p[n] for odd n
        s.alpha[r] = 1.f;
        continue;
      }
      s.alpha[r] = softmax_step(sr, n, visible, s.m[r], s.l[r]);
    }
    // acc = alpha * acc + P V: kPvRows rows x kD, the accumulators stay in registers over the chunk
    if constexpr (pair_dot) {
#ifdef __AVX512BF16__
      // p rounded to bf16 (as torch's bf16 attention rounds its probabilities), then one VDPBF16PS
      // per two keys: ceil(n / 2) pairs, an odd n's last pair padded by p[n] = 0 (a masked lane)
      const int64_t pairs = (n + 1) / 2;
      const uint16_t* vp = keys.vp_of(seq, kh) + c0 * kD;
      for (int64_t r = r0; r < rows_pad; ++r)
        for (int64_t jc = 0; jc < pairs * 2; jc += 32)
          _mm512_storeu_si512(s.pp.data() + r * KP + jc,
                              (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(sc + r * KP + jc + 16),
                                                           _mm512_loadu_ps(sc + r * KP + jc)));
      for (int64_t r = r0; r < rows_pad; r += kPvRows) {
        __m512 a[kPvRows][NV];
        for (int rr = 0; rr < kPvRows; ++rr)
          for (int v = 0; v < NV; ++v)
            a[rr][v] = _mm512_mul_ps(_mm512_loadu_ps(acc + (r + rr) * kD + 16 * v), _mm512_set1_ps(s.alpha[r + rr]));
        for (int64_t j = 0; j < pairs; ++j) {
          __m512bh vv[NV];
          for (int v = 0; v < NV; ++v) vv[v] = (__m512bh)_mm512_loadu_si512(vp + j * 2 * kD + 32 * v);
          for (int rr = 0; rr < kPvRows; ++rr) {
            int32_t bits;
            std::memcpy(&bits, s.pp.data() + (r + rr) * KP + 2 * j, sizeof(bits));
            const __m512bh p = (__m512bh)_mm512_set1_epi32(bits);
            for (int v = 0; v < NV; ++v) a[rr][v] = _mm512_dpbf16_ps(a[rr][v], p, vv[v]);
          }
        }
        for (int rr = 0; rr < kPvRows; ++rr)
          for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + (r + rr) * kD + 16 * v, a[rr][v]);
      }
#endif
      continue;
    }
    const float* vf = v_all + c0 * kD;
#if defined(__AVX2__) && !defined(__AVX512F__)
    for (int64_t r = r0; r < rows_pad; ++r) {  // one row: kD / 8 accumulators
      constexpr int NA = kD / 8;
      __m256 a[NA];
      const __m256 alpha = _mm256_set1_ps(s.alpha[r]);
      float* ar = acc + r * kD;
      for (int v = 0; v < NA; ++v) a[v] = _mm256_mul_ps(_mm256_loadu_ps(ar + 8 * v), alpha);
      const float* pr = sc + r * KP;
      for (int64_t j = 0; j < n; ++j) {
        const __m256 p = _mm256_broadcast_ss(pr + j);
        const float* vr = vf + j * kD;
        for (int v = 0; v < NA; ++v) a[v] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 8 * v), a[v]);
      }
      for (int v = 0; v < NA; ++v) _mm256_storeu_ps(ar + 8 * v, a[v]);
    }
#else
    for (int64_t r = r0; r < rows_pad; r += kPvRows) {
      v16 a[kPvRows][NV];
      for (int rr = 0; rr < kPvRows; ++rr)
        for (int v = 0; v < NV; ++v)
          a[rr][v] = *reinterpret_cast<const v16*>(acc + (r + rr) * kD + 16 * v) * s.alpha[r + rr];
      for (int64_t j = 0; j < n; ++j) {
        const v16* vr = reinterpret_cast<const v16*>(vf + j * kD);
        for (int rr = 0; rr < kPvRows; ++rr) {
          const float p = sc[(r + rr) * KP + j];
          for (int v = 0; v < NV; ++v) a[rr][v] += p * vr[v];
        }
      }
      for (int rr = 0; rr < kPvRows; ++rr)
        for (int v = 0; v < NV; ++v) *reinterpret_cast<v16*>(acc + (r + rr) * kD + 16 * v) = a[rr][v];
    }
#endif
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.f / s.l[r];
    float* ar = acc + r * kD;
    for (int d = 0; d < kD; ++d) ar[d] *= inv;
    from_float(ar, out + ((q_begin + r / G) * H + kh * G + r % G) * kD, kD);
  }
}

// The order in which threads take the (tile, kv head) items: the costliest tiles (rows x keys
// they see) first, so that the last items handed out are the cheapest and the threads finish
// together. Many-row (prefill) tiles go kv head by kv head, so that threads working at the same
// time share one head's converted K/V in cache; few-row (decode) tiles keep a tile's kv heads
// together, as they read the same block rows (a head-major order cost decode ~10%).
inline std::vector<int64_t> schedule(const std::vector<Tile>& tiles, const std::vector<char>& tiled,
                                     const int64_t* qsl, const int64_t* seq_lens, int64_t KH) {
  const int64_t n_tiles = static_cast<int64_t>(tiles.size());
  std::vector<int64_t> cost(n_tiles), by_cost(n_tiles);
  for (int64_t i = 0; i < n_tiles; ++i) {
    const Tile& t = tiles[i];
    const int64_t nq = t.q_end - t.q_begin;
    const int64_t first_pos = seq_lens[t.seq] - (qsl[t.seq + 1] - qsl[t.seq]) + (t.q_begin - qsl[t.seq]);
    cost[i] = nq * (first_pos + nq);
    by_cost[i] = i;
  }
  std::stable_sort(by_cost.begin(), by_cost.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  std::vector<int64_t> order;
  order.reserve(n_tiles * KH);
  for (int64_t kh = 0; kh < KH; ++kh)
    for (int64_t i : by_cost)
      if (tiled[i]) order.push_back(i * KH + kh);
  for (int64_t i : by_cost)
    if (!tiled[i])
      for (int64_t kh = 0; kh < KH; ++kh) order.push_back(i * KH + kh);
  return order;
}

// kD > 0 fixes the head dim at compile time (fully unrolled dot products); kD = 0 reads it at run time.
template <typename T, int kD>
void attention_kernel(const T* q, const T* kc, const T* vc, T* out, const int64_t* qsl,
                      const int64_t* seq_lens, const int64_t* tables, int64_t num_seqs,
                      int64_t max_blocks, int64_t H, int64_t KH, int64_t head_dim, int64_t B, float scale,
                      const char* skip) {
  const int64_t D = kD > 0 ? kD : head_dim;
  const int64_t G = H / KH;
  // decode scores by bf16 dot products on the cache's bits (kBf16Dot above)
  constexpr bool bf16_dot = kPairDot<T, kD>;
  std::vector<Tile> tiles;
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (skip != nullptr && skip[s]) continue;  // attended elsewhere (dense_prefill)
    for (int64_t r = qsl[s]; r < qsl[s + 1]; r += kQueryTile) {
      tiles.push_back({s, r, std::min<int64_t>(r + kQueryTile, qsl[s + 1])});
    }
  }
  const int64_t row_stride = KH * D;      // between tokens in a block
  const int64_t block_stride = B * KH * D;
  // tiles of at least kScoreRows rows take the tiled path, over blocks converted once per call
  auto tiled_tile = [&](const Tile& t) { return kD > 0 && kD % 16 == 0 && (t.q_end - t.q_begin) * G >= kScoreRows; };
  // few-row (decode) tiles take decode_tile where this ISA has a block step for T and kD
  constexpr bool kFew = kFewRowPath<T, kD>;
  std::vector<char> wanted(num_seqs, 0), tiled(tiles.size(), 0), few(tiles.size(), 0);
  for (size_t i = 0; i < tiles.size(); ++i) {
    tiled[i] = tiled_tile(tiles[i]);
    few[i] = kFew && !tiled[i] && (tiles[i].q_end - tiles[i].q_begin) * G <= kFewRows;
    wanted[tiles[i].seq] = wanted[tiles[i].seq] || tiled[i];
  }
  const ConvertedSeqs converted =
      convert_sequences<T, bf16_dot>(kc, vc, wanted, seq_lens, tables, max_blocks, KH, D, B);
  const std::vector<int64_t> order = schedule(tiles, tiled, qsl, seq_lens, KH);
  const int64_t num_items = static_cast<int64_t>(order.size());

  // threads take items from a shared counter (not a static split of the range, which gave one
  // thread a causal prefill's late, costly tiles and left the other idle for up to half the call)
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    const int64_t max_rows = kQueryTile * G;
    std::vector<float> qf(max_rows * D), acc(max_rows * D), m(max_rows), l(max_rows);
    const int64_t KP = round_up(B, 16);  // a row of scores, whole 16-lane vectors
    std::vector<float> scores(max_rows * KP), kf(KP * D), vf(B * D);
    std::vector<int64_t> row_pos(max_rows);
    std::unique_ptr<TiledScratch> tiled;  // made on a thread's first many-row tile
    FewRowScratch few_scratch(kFew ? D : 0, KP, kFew ? B : 0);
    for (int64_t k = next.fetch_add(1, std::memory_order_relaxed); k < num_items;
         k = next.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t item = order[k];
      const Tile& tile = tiles[item / KH];
      const int64_t kh = item % KH;
      const int64_t nq = tile.q_end - tile.q_begin;
      const int64_t ctx = seq_lens[tile.seq];
      const int64_t first_pos = ctx - (qsl[tile.seq + 1] - qsl[tile.seq]) + (tile.q_begin - qsl[tile.seq]);
      const int64_t rows = nq * G;
#if defined(__AVX512F__) || defined(__AVX2__)
      if constexpr (kFew) {
        if (few[item / KH]) {
          // the first block of the item taken after the other threads' current ones: into this
          // core's L2 and the shared L3 (whichever thread takes it), since no block ahead fetches it
          if (k + workers < num_items && few[order[k + workers] / KH]) {
            const int64_t ahead = order[k + workers];
            const int64_t offset = tables[tiles[ahead / KH].seq * max_blocks] * block_stride + (ahead % KH) * kD;
            prefetch_rows<kD * sizeof(T)>(reinterpret_cast<const char*>(kc + offset), B, row_stride * sizeof(T));
            prefetch_rows<kD * sizeof(T)>(reinterpret_cast<const char*>(vc + offset), B, row_stride * sizeof(T));
          }
          decode_tile<T, kD>(q, kc, vc, out, tables + tile.seq * max_blocks, tile.q_begin, rows, first_pos, H, KH, G,
                             B, scale, kh, few_scratch);
          continue;
        }
      }
#endif
      if constexpr (kD > 0 && kD % 16 == 0) {
        if (tiled_tile(tile)) {
          if (!tiled) tiled = std::make_unique<TiledScratch>(max_rows, kD);
          attend_tile_gemm<T, kD>(q, out, tile.seq, tile.q_begin, nq, first_pos, H, G, kh, scale, converted, *tiled);
          continue;
        }
      }
      for (int64_t i = 0; i < nq; ++i) {
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = i * G + g;
          to_float(q + ((tile.q_begin + i) * H + kh * G + g) * D, &qf[r * D], D);
          for (int64_t d = 0; d < D; ++d) qf[r * D + d] *= scale;
          row_pos[r] = first_pos + i;
          m[r] = -std::numeric_limits<float>::infinity();
          l[r] = 0.f;
          std::fill(&acc[r * D], &acc[r * D] + D, 0.f);
        }
      }
      const int64_t last_key = first_pos + nq;  // keys 0..last_key-1 are visible to some row
      const int64_t nblocks = (last_key + B - 1) / B;
      const int64_t* table = tables + tile.seq * max_blocks;
      for (int64_t b = 0; b < nblocks; ++b) {
        const int64_t n = std::min<int64_t>(B, last_key - b * B);
        const T* kb = kc + table[b] * block_stride + kh * D;
        const T* vb = vc + table[b] * block_stride + kh * D;
        if (b + 1 < nblocks) {  // the next block sits elsewhere in the pool: fetch its rows meanwhile
          const char* kn = reinterpret_cast<const char*>(kc + table[b + 1] * block_stride + kh * D);
          const char* vn = reinterpret_cast<const char*>(vc + table[b + 1] * block_stride + kh * D);
          const int64_t bytes = D * static_cast<int64_t>(sizeof(T)), stride = row_stride * sizeof(T);
          for (int64_t j = 0; j < B; ++j) {
            for (int64_t o = 0; o < bytes; o += 64) {
              __builtin_prefetch(kn + j * stride + o);
              __builtin_prefetch(vn + j * stride + o);
            }
          }
        }
        for (int64_t j = 0; j < n; ++j) {
          if constexpr (!bf16_dot) to_float(kb + j * row_stride, &kf[j * D], D);
          to_float(vb + j * row_stride, &vf[j * D], D);
        }
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t visible = std::min<int64_t>(n, row_pos[r] - b * B + 1);
          if (visible <= 0) continue;
          float* sc = &scores[r * KP];
          const float* qr = &qf[r * D];
          float block_max = -std::numeric_limits<float>::infinity();
          if constexpr (kD > 0 && kD % 16 == 0) {
            // 16 keys at a time: one partial-product vector per key, summed across lanes together
            // (reduce16), then the online-softmax step and P V on 16-lane vectors
            constexpr int NV = kD / 16;  // head dim in 16-float vectors, kept in registers
#ifdef __AVX512BF16__
            if constexpr (bf16_dot) {
              constexpr int NB = kD / 32;  // head dim in 32-bf16 vectors
              const int64_t i = r / G, g = r % G;
              const T* qb = q + ((tile.q_begin + i) * H + kh * G + g) * kD;
              __m512bh qv[NB];
              for (int v = 0; v < NB; ++v) qv[v] = (__m512bh)_mm512_loadu_si512(qb + 32 * v);
              for (int64_t jc = 0; jc < visible; jc += 16) {
                v16 part[16];
                const int64_t count = std::min<int64_t>(16, visible - jc);
                for (int jj = 0; jj < 16; ++jj) {
                  if (jj < count) {
                    const T* kr = kb + (jc + jj) * row_stride;
                    __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(kr));
                    for (int v = 1; v < NB; ++v) {
                      dot = _mm512_dpbf16_ps(dot, qv[v], (__m512bh)_mm512_loadu_si512(kr + 32 * v));
                    }
                    part[jj] = (v16)dot;
                  } else {
                    part[jj] = v16{};
                  }
                }
                *reinterpret_cast<v16*>(sc + jc) = reduce16(part) * scale;
              }
            } else
#endif
            {
            v16 qv[NV];
            for (int v = 0; v < NV; ++v) qv[v] = *reinterpret_cast<const v16*>(qr + 16 * v);
            for (int64_t jc = 0; jc < visible; jc += 16) {
              v16 part[16];
              const int64_t count = std::min<int64_t>(16, visible - jc);
              for (int jj = 0; jj < 16; ++jj) {
                if (jj < count) {
                  const v16* kr = reinterpret_cast<const v16*>(&kf[(jc + jj) * kD]);
                  v16 dot = qv[0] * kr[0];
                  for (int v = 1; v < NV; ++v) dot += qv[v] * kr[v];
                  part[jj] = dot;
                } else {
                  part[jj] = v16{};
                }
              }
              *reinterpret_cast<v16*>(sc + jc) = reduce16(part);
            }
            }
            const float alpha = softmax_step(sc, visible, visible, m[r], l[r]);
            float* ar = &acc[r * kD];
#if defined(__AVX2__) && !defined(__AVX512F__)
            {  // P V on 8-float registers (cpu_vec.h): kD / 8 accumulators
              constexpr int NA = kD / 8;
              __m256 a8[NA];
              const __m256 alpha8 = _mm256_set1_ps(alpha);
              for (int v = 0; v < NA; ++v) a8[v] = _mm256_mul_ps(_mm256_loadu_ps(ar + 8 * v), alpha8);
              for (int64_t j = 0; j < visible; ++j) {
                const __m256 p = _mm256_broadcast_ss(sc + j);
                const float* vr = &vf[j * kD];
                for (int v = 0; v < NA; ++v) a8[v] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 8 * v), a8[v]);
              }
              for (int v = 0; v < NA; ++v) _mm256_storeu_ps(ar + 8 * v, a8[v]);
            }
#else
            v16 a[NV];
            for (int v = 0; v < NV; ++v) a[v] = *reinterpret_cast<const v16*>(ar + 16 * v) * alpha;
            for (int64_t j = 0; j < visible; ++j) {
              const v16* vr = reinterpret_cast<const v16*>(&vf[j * kD]);
              const float p = sc[j];
              for (int v = 0; v < NV; ++v) a[v] += p * vr[v];
            }
            for (int v = 0; v < NV; ++v) *reinterpret_cast<v16*>(ar + 16 * v) = a[v];
#endif
            continue;
          } else {
            for (int64_t j = 0; j < visible; ++j) {
              const float* kr = &kf[j * D];
              float dot = 0.f;
#pragma omp simd reduction(+ : dot)
              for (int64_t d = 0; d < D; ++d) dot += qr[d] * kr[d];
              sc[j] = dot;
              block_max = std::max(block_max, dot);
            }
          }
          const float m_new = std::max(m[r], block_max);
          // rescale what earlier blocks contributed (nothing yet when m[r] = -inf)
          const float alpha = std::isinf(m[r]) ? 0.f : exp_nonpositive(m[r] - m_new);
          float* ar = &acc[r * D];
          float block_sum = 0.f;
#pragma omp simd reduction(+ : block_sum)
          for (int64_t j = 0; j < visible; ++j) {
            sc[j] = exp_nonpositive(sc[j] - m_new);
            block_sum += sc[j];
          }
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ar[d] *= alpha;
          for (int64_t j = 0; j < visible; ++j) {
            const float p = sc[j];
            const float* vr = &vf[j * D];
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ar[d] += p * vr[d];
          }
          l[r] = l[r] * alpha + block_sum;
          m[r] = m_new;
        }
      }
      for (int64_t i = 0; i < nq; ++i) {
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = i * G + g;
          const float inv = 1.f / l[r];
          float* ar = &acc[r * D];
          for (int64_t d = 0; d < D; ++d) ar[d] *= inv;
          from_float(ar, out + ((tile.q_begin + i) * H + kh * G + g) * D, D);
        }
      }
    }
  });
}

#ifdef __AVX512F__
// 16 codes of a quantized row -> their 16 values before the row's scale, in registers (decode_row's
// values: fp8 through float16, whose bits hold e5m2's exactly and e4m3's shifted by 2^8; int4 from
// 8 bytes, element 2i the low nibble of byte i, each nibble's level looked up in kInt4Levels).
template <KVFormat F>
inline __m512 load16_codes(const uint8_t* p);
template <>
inline __m512 load16_codes<KVFormat::kInt8>(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
template <>
inline __m512 load16_codes<KVFormat::kFp8E5M2>(const uint8_t* p) {
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_slli_epi16(bytes, 8));
}
template <>
inline __m512 load16_codes<KVFormat::kFp8E4M3>(const uint8_t* p) {
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x80)), 8);
  const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x7F)), 7);
  return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(sign, rest)), _mm512_set1_ps(256.f));
}
template <>
inline __m512 load16_codes<KVFormat::kInt4>(const uint8_t* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i low = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
  return _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(low, high)), _mm512_load_ps(kInt4Levels));
}

// Scores of int8 keys on AVX512-VNNI: the query rows quantized to int16 once per tile
// (quantize_query_int16), the block's key codes widened to int16 once (k16), each (row, key)
// dot product taken by VPDPWSSD in int32, exact (|q| <= 32767, |code| <= 128: sums below 2^28),
// then one float32 conversion per 16 keys times the row's and the keys' scales. Against float32
// FMAs over the codes widened to float32: half the multiply instructions and no float copy of the
// block; the query's rounding to 16 bits (2^-16 of its largest value) is far below its bf16
// rounding (2^-9 of each value).
#ifdef __AVX512VNNI__
template <KVFormat F>
constexpr bool kInt16Dot = F == KVFormat::kInt8;

template <int kD, int R>
inline void int8_scores_int16(const uint8_t* kb, int64_t stride, int64_t n, const int16_t* q16,
                              const float* q16_scale, const float* ks, float* sc, int64_t KP, int16_t* k16) {
  constexpr int NW = kD / 32;  // head dim in 32-int16 vectors
  for (int64_t j = 0; j < n; ++j) {
    for (int w = 0; w < NW; ++w) {
      const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kb + j * stride + 32 * w));
      _mm512_storeu_si512(k16 + j * kD + 32 * w, _mm512_cvtepi8_epi16(codes));
    }
  }
  for (int r = 0; r < R; ++r) {
    __m512i qv[NW];
    for (int w = 0; w < NW; ++w) qv[w] = _mm512_loadu_si512(q16 + r * kD + 32 * w);
    for (int64_t jc = 0; jc < n; jc += 16) {
      v16i part[16];
      const int64_t count = std::min<int64_t>(16, n - jc);
      for (int jj = 0; jj < 16; ++jj) {
        if (jj < count) {
          const int16_t* kr = k16 + (jc + jj) * kD;
          __m512i dot = _mm512_dpwssd_epi32(_mm512_setzero_si512(), qv[0], _mm512_loadu_si512(kr));
          for (int w = 1; w < NW; ++w) dot = _mm512_dpwssd_epi32(dot, qv[w], _mm512_loadu_si512(kr + 32 * w));
          part[jj] = (v16i)dot;
        } else {
          part[jj] = v16i{};
        }
      }
      const v16 sums = __builtin_convertvector(reduce16(part), v16);
      *reinterpret_cast<v16*>(sc + r * KP + jc) = sums * q16_scale[r] * *reinterpret_cast<const v16*>(ks + jc);
    }
  }
}
#else
template <KVFormat F>
constexpr bool kInt16Dot = false;
#endif

// The few-row (decode) block step over quantized K/V, for R = 1-4 rows of one kv head: as
// decode_block_avx512 with the rows' scales folded in. Scores: int8 keys by int16 dot products
// where kInt16Dot and the tile's query rows are in q16 (int8_scores_int16); otherwise the block's
// K codes are widened to float32 once (kf), each row's 16 dot products summed (reduce16) and
// multiplied by the 16 keys' scales. P V reads the V codes widened in registers, each value row
// once for all R rows, with p times the row's V scale (taken once per row: the same products).
// ks, vs: the block's scales as float32, KP entries (0 past n for ks).
template <KVFormat F, int kD, int R>
void decode_block_quant(const uint8_t* kb, const uint8_t* vb, int64_t stride, const float* ks, const float* vs,
                        int64_t n, const int64_t* visible, const float* qf, const int16_t* q16,
                        const float* q16_scale, float* sc, int64_t KP, float* kf, float* acc, float* m, float* l,
                        const char* v_next, int64_t B) {
  constexpr int NV = kD / 16;
  constexpr int64_t kStep = kPacked<F> ? 8 : 16;  // code bytes per 16 values
  bool scored = false;
#ifdef __AVX512VNNI__
  if constexpr (kInt16Dot<F>) {
    if (q16 != nullptr) {
      int8_scores_int16<kD, R>(kb, stride, n, q16, q16_scale, ks, sc, KP, reinterpret_cast<int16_t*>(kf));
      scored = true;
    }
  }
#endif
  if (!scored) {
    for (int64_t j = 0; j < n; ++j) {
      for (int v = 0; v < NV; ++v) {
        _mm512_storeu_ps(kf + j * kD + 16 * v, load16_codes<F>(kb + j * stride + v * kStep));
      }
    }
    float_scores<kD, R>(kf, kD, n, qf, ks, sc, KP);
  }
  prefetch_rows<code_bytes<F>(kD)>(v_next, B, stride);
  float alpha[R];
  const int64_t keys_seen = softmax_rows<R>(sc, KP, n, visible, m, l, alpha);
  for (int r = 0; r < R; ++r) {
    for (int64_t jc = 0; jc < keys_seen; jc += 16) {
      *reinterpret_cast<v16*>(sc + r * KP + jc) *= *reinterpret_cast<const v16*>(vs + jc);
    }
  }
  pv_tiles_avx512<kD, R>(acc, alpha, keys_seen,
                         [&](int64_t j, int c) { return load16_codes<F>(vb + j * stride + c * kStep); },
                         [&](int r, int64_t j) { return sc[r * KP + j]; });
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
// 8 codes of a quantized row -> their 8 values before the row's scale (load16_codes' AVX2 twin).
template <KVFormat F>
inline __m256 load8_codes(const uint8_t* p);
template <>
inline __m256 load8_codes<KVFormat::kInt8>(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
template <>
inline __m256 load8_codes<KVFormat::kFp8E5M2>(const uint8_t* p) {
  const __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_slli_epi16(bytes, 8));
}
template <>
inline __m256 load8_codes<KVFormat::kFp8E4M3>(const uint8_t* p) {
  const __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(bytes, _mm_set1_epi16(0x80)), 8);
  const __m128i rest = _mm_slli_epi16(_mm_and_si128(bytes, _mm_set1_epi16(0x7F)), 7);
  return _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(sign, rest)), _mm256_set1_ps(256.f));
}
template <>
inline __m256 load8_codes<KVFormat::kInt4>(const uint8_t* p) {  // 4 bytes, two codes each
  int32_t word;
  std::memcpy(&word, p, sizeof(word));
  const __m128i bytes = _mm_cvtsi32_si128(word);
  const __m128i low = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
  const __m256i nibbles = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(low, high));
  const __m256 below = _mm256_permutevar8x32_ps(_mm256_load_ps(kInt4Levels), nibbles);  // levels 0-7
  const __m256 above = _mm256_permutevar8x32_ps(_mm256_load_ps(kInt4Levels + 8), nibbles);  // 8-15
  return _mm256_blendv_ps(below, above, _mm256_castsi256_ps(_mm256_cmpgt_epi32(nibbles, _mm256_set1_epi32(7))));
}

// decode_block_quant on AVX2, for R = 1-3 rows: decode_block_avx2's register tiles over the codes,
// widened in registers (no float32 copy of the block): scores 4 keys at a time times their K
// scales, P V with p times the V scale. kf is unused.
template <KVFormat F, int kD, int R>
void decode_block_quant(const uint8_t* kb, const uint8_t* vb, int64_t stride, const float* ks, const float* vs,
                        int64_t n, const int64_t* visible, const float* qf, const int16_t*, const float*, float* sc,
                        int64_t KP, float*, float* acc, float* m, float* l, const char* v_next, int64_t B) {
  constexpr int NV = kD / 8;
  constexpr int64_t kStep = kPacked<F> ? 4 : 8;  // code bytes per 8 values
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    __m256 s[R][4];
    for (int r = 0; r < R; ++r) {
      for (int jj = 0; jj < 4; ++jj) s[r][jj] = _mm256_setzero_ps();
    }
    for (int v = 0; v < NV; ++v) {
      __m256 qv[R];
      for (int r = 0; r < R; ++r) qv[r] = _mm256_loadu_ps(qf + r * kD + 8 * v);
      for (int jj = 0; jj < 4; ++jj) {
        const __m256 k = load8_codes<F>(kb + (j + jj) * stride + v * kStep);
        for (int r = 0; r < R; ++r) s[r][jj] = _mm256_fmadd_ps(qv[r], k, s[r][jj]);
      }
    }
    const __m128 k_scale = _mm_loadu_ps(ks + j);
    for (int r = 0; r < R; ++r) {
      _mm_storeu_ps(sc + r * KP + j, _mm_mul_ps(hsum4x8(s[r][0], s[r][1], s[r][2], s[r][3]), k_scale));
    }
  }
  for (; j < n; ++j) {
    __m256 s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_ps();
    for (int v = 0; v < NV; ++v) {
      const __m256 k = load8_codes<F>(kb + j * stride + v * kStep);
      for (int r = 0; r < R; ++r) s[r] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + r * kD + 8 * v), k, s[r]);
    }
    for (int r = 0; r < R; ++r) sc[r * KP + j] = hsum8(s[r]) * ks[j];
  }
  prefetch_rows<code_bytes<F>(kD)>(v_next, B, stride);
  float alpha[R];
  const int64_t keys = softmax_rows<R>(sc, KP, n, visible, m, l, alpha);
  pv_tiles_avx2<kD, R>(acc, alpha, keys, [&](int64_t j, int c) { return load8_codes<F>(vb + j * stride + c * kStep); },
                       [&](int r, int64_t j) { return sc[r * KP + j] * vs[j]; });
}
#endif

#if !defined(__AVX512F__) && !defined(__AVX2__)
constexpr int kQuantTiledAbove = kScoreRows - 1;  // tiles of kScoreRows rows or more take the tiled path
#endif

// -- quantized KV (csrc/kv_codec.h): int8, fp8_e4m3, fp8_e5m2, int4 ---------------------------------
// One work item = (query tile of one sequence, kv head), as above. A tile of at most 8 rows (a
// decode token's G <= 8 heads) takes decode_block_quant block by block on AVX-512 (head sizes 64
// and 128; rows in groups of up to 4, each group reading the blocks once), the next block's key
// codes and scales fetched into L2 at a block's start and its value codes after the scores, as
// decode_tile does. Any other tile: block by block, the
// item's kv head's K and V rows are decoded into a block-sized float32 scratch (the cache is never
// copied whole: one block of one head at a time, in L1), then every row of the tile takes the
// online-softmax step over it: scores by 16-key dot-product vectors (reduce16), P V by FMAs. int4
// rows are stored rotated (fwht): the query is rotated alike and the output rotated back.

// A query row (D floats) as int16 codes and one scale, row ~= q16 * scale: rounded to nearest,
// |q16| <= 32767. False where the row is not finite (the float32 scores take it then).
inline bool quantize_query_int16(const float* row, int64_t D, int16_t* q16, float& scale) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) {
    if (!std::isfinite(row[d])) return false;  // NaN and inf keep their float32 scores (NaN outputs)
    amax = std::max(amax, std::fabs(row[d]));
  }
  scale = amax / 32767.f;
  const float inv = amax > 0.f ? 32767.f / amax : 0.f;
  for (int64_t d = 0; d < D; ++d) {
    q16[d] = static_cast<int16_t>(std::clamp(std::nearbyint(row[d] * inv), -32767.f, 32767.f));
  }
  return true;
}

struct QuantScratch {
  std::vector<float> qf, acc, m, l, scores, kf, vf, ksf, vsf, q16_scale;
  std::vector<int16_t> q16;  // int8 K on AVX512-VNNI: the rows of qf as int16 (quantize_query_int16)
  int64_t KP;
  QuantScratch(int64_t rows, int64_t D, int64_t B)
      : qf(rows * D), acc(rows * D), m(rows), l(rows), scores(rows * round_up(B, 16)), kf(round_up(B, 16) * D, 0.f),
        vf(B * D), ksf(round_up(B, 16), 0.f), vsf(round_up(B, 16), 0.f), q16_scale(rows), q16(rows * D),
        KP(round_up(B, 16)) {}
};

// K/V of the `wanted` sequences decoded (KVCodec's values: codes times their row's scale; int4 still
// rotated) into ConvertedSeqs, as convert_sequences converts a float cache: once per call, for the
// tiled path's many-row tiles.
template <KVFormat F>
ConvertedSeqs convert_sequences_quant(const uint8_t* kc, const uint8_t* vc, const c10::BFloat16* ks,
                                      const c10::BFloat16* vs, const std::vector<char>& wanted,
                                      const int64_t* seq_lens, const int64_t* tables, int64_t max_blocks, int64_t KH,
                                      int64_t D, int64_t B) {
  const int64_t S = static_cast<int64_t>(wanted.size()), CD = code_bytes<F>(D);
  ConvertedSeqs c{D, std::vector<int64_t>(S, -1), std::vector<int64_t>(S, 0), {}, {}};
  std::vector<std::pair<int64_t, int64_t>> blocks;  // (sequence, logical block)
  int64_t total = 0;
  for (int64_t s = 0; s < S; ++s) {
    if (!wanted[s]) continue;
    c.offset[s] = total;
    c.len16[s] = round_up(seq_lens[s], 16);
    total += KH * c.len16[s] * D;
    for (int64_t b = 0; b * B < seq_lens[s]; ++b) blocks.push_back({s, b});
  }
  if (blocks.empty()) return c;
  c.kt.assign(total, 0.f);
  c.v.assign(total, 0.f);
  const int64_t n_items = static_cast<int64_t>(blocks.size()) * KH;
  at::parallel_for(0, n_items, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(D);
    for (int64_t it = begin; it < end; ++it) {
      const auto [seq, b] = blocks[it / KH];
      const int64_t kh = it % KH, L16 = c.len16[seq];
      const int64_t n = std::min<int64_t>(B, seq_lens[seq] - b * B);
      const int64_t first_slot = tables[seq * max_blocks + b] * B;
      float* kt = &c.kt[c.offset[seq] + kh * D * L16];
      float* v = &c.v[c.offset[seq] + kh * L16 * D];
      for (int64_t j = 0; j < n; ++j) {
        const int64_t pos = b * B + j, i = (first_slot + j) * KH + kh;
        decode_row<F>(kc + i * CD, static_cast<float>(ks[i]), row.data(), D);
        float* kcol = kt + (pos / 16) * D * 16 + pos % 16;
        for (int64_t d = 0; d < D; ++d) kcol[d * 16] = row[d];
        decode_row<F>(vc + i * CD, static_cast<float>(vs[i]), v + pos * D, D);
      }
    }
  });
  return c;
}

#if defined(__AVX512F__) || defined(__AVX2__)
constexpr int kQuantTiledAbove = 8;  // tiles of more rows take the tiled path (at most: decode_tile_quant)
constexpr int kQuantFewRows = 8;  // tiles of at most this many rows take decode_tile_quant
#ifdef __AVX512F__
constexpr int kQuantRowGroup = 4;  // rows per decode_block_quant call (R x 4 accumulators + R + 1 of 32 registers)
#else
constexpr int kQuantRowGroup = 3;  // (R x 4 accumulators + R + 1 of AVX2's 16 registers)
#endif

// Rows r0..r0+count-1 (count <= kQuantRowGroup) of a few-row tile of kv head kh over quantized K/V,
// the tile's rows r at absolute position first_pos + r / G: set up by the caller (qf scaled and, for
// int4, rotated; m, l, acc reset); leaves their unnormalised acc, m and l. int16_query: the scores
// of int8 keys may round the query to 16 bits (int8_scores_int16), for a bf16 or fp16 query only.
template <KVFormat F, int kD>
void decode_tile_quant(const uint8_t* kc, const uint8_t* vc, const c10::BFloat16* ks, const c10::BFloat16* vs,
                       const int64_t* table, int64_t r0, int64_t count, int64_t first_pos, int64_t KH, int64_t G,
                       int64_t B, int64_t kh, bool int16_query, QuantScratch& s) {
  constexpr int64_t CD = code_bytes<F>(kD);
  constexpr void (*kBlock[])(const uint8_t*, const uint8_t*, int64_t, const float*, const float*, int64_t,
                             const int64_t*, const float*, const int16_t*, const float*, float*, int64_t, float*,
                             float*, float*, float*, const char*, int64_t) = {
#ifdef __AVX512F__
      decode_block_quant<F, kD, 1>, decode_block_quant<F, kD, 2>, decode_block_quant<F, kD, 3>,
      decode_block_quant<F, kD, 4>};
#else
      decode_block_quant<F, kD, 1>, decode_block_quant<F, kD, 2>, decode_block_quant<F, kD, 3>};
#endif
  const int64_t stride = KH * CD, block_stride = B * stride;
  const int64_t last_key = first_pos + (r0 + count - 1) / G + 1;  // keys 0..last_key-1: visible to some row
  const int64_t nblocks = (last_key + B - 1) / B;
  const int16_t* q16 = nullptr;  // int16 query rows where the int8 scores take them (kInt16Dot)
#if defined(__AVX512F__)
  if (kInt16Dot<F> && int16_query) {
    bool finite = true;
    for (int64_t r = r0; r < r0 + count; ++r) {
      finite = finite && quantize_query_int16(&s.qf[r * kD], kD, &s.q16[r * kD], s.q16_scale[r]);
    }
    if (finite) q16 = &s.q16[r0 * kD];
  }
#endif
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t n = std::min<int64_t>(B, last_key - b * B);
    // as decode_tile: the next block's key codes and both scales now, its value codes after this
    // block's scores (in the block step)
    const char* vn = nullptr;
    if (b + 1 < nblocks) {
      prefetch_rows<CD>(reinterpret_cast<const char*>(kc + table[b + 1] * block_stride + kh * CD), B, stride);
      prefetch_scales(ks, vs, table[b + 1] * B, B, KH);
      vn = reinterpret_cast<const char*>(vc + table[b + 1] * block_stride + kh * CD);
    }
    const int64_t first_slot = table[b] * B;
    for (int64_t j = 0; j < n; ++j) {
      s.ksf[j] = static_cast<float>(ks[(first_slot + j) * KH + kh]);
      s.vsf[j] = static_cast<float>(vs[(first_slot + j) * KH + kh]);
    }
    std::fill(s.ksf.begin() + n, s.ksf.end(), 0.f);
    int64_t visible[kQuantRowGroup];
    for (int64_t r = 0; r < count; ++r) visible[r] = std::min<int64_t>(n, first_pos + (r0 + r) / G - b * B + 1);
    kBlock[count - 1](kc + table[b] * block_stride + kh * CD, vc + table[b] * block_stride + kh * CD, stride,
                      s.ksf.data(), s.vsf.data(), n, visible, &s.qf[r0 * kD], q16, &s.q16_scale[r0],
                      &s.scores[r0 * s.KP], s.KP, s.kf.data(), &s.acc[r0 * kD], &s.m[r0], &s.l[r0], vn, B);
  }
}
#endif

template <KVFormat F, typename T>
void attention_quant(const T* q, const uint8_t* kc, const uint8_t* vc, const c10::BFloat16* ks,
                     const c10::BFloat16* vs, T* out, const int64_t* qsl, const int64_t* seq_lens,
                     const int64_t* tables, int64_t num_seqs, int64_t max_blocks, int64_t H, int64_t KH, int64_t D,
                     int64_t B, float scale, const char* skip) {
  const int64_t G = H / KH, CD = code_bytes<F>(D), NV = D / 16;
  // a 16-bit query loses nothing the output keeps when rounded to int16 (int8_scores_int16); a
  // float32 one does (the float32 tests' tolerance, 2e-5, is below that rounding)
  constexpr bool kInt16Query = sizeof(T) == 2;
  std::vector<Tile> tiles;
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (skip != nullptr && skip[s]) continue;  // attended elsewhere (dense_prefill_quant)
    for (int64_t r = qsl[s]; r < qsl[s + 1]; r += kQueryTile) {
      tiles.push_back({s, r, std::min<int64_t>(r + kQueryTile, qsl[s + 1])});
    }
  }
  // many-row (prefill) tiles take the tiled GEMMs over their sequences' K/V decoded once per call
  const bool gemm_dims = D == 64 || D == 128;
  auto tiled_tile = [&](const Tile& t) { return gemm_dims && (t.q_end - t.q_begin) * G > kQuantTiledAbove; };
  std::vector<char> wanted(num_seqs, 0);
  bool any_tiled = false;
  for (const Tile& t : tiles) {
    if (tiled_tile(t)) wanted[t.seq] = any_tiled = true;
  }
  const ConvertedSeqs converted =
      any_tiled ? convert_sequences_quant<F>(kc, vc, ks, vs, wanted, seq_lens, tables, max_blocks, KH, D, B)
                : ConvertedSeqs{D, {}, {}, {}, {}};
  // their queries as float32 (rotated for int4: the cache holds rotated rows) and float32 outputs
  std::vector<float> q32, out32;
  if (any_tiled) {
    const int64_t rows_total = qsl[num_seqs] * H;
    q32.resize(rows_total * D);
    out32.resize(rows_total * D);
    at::parallel_for(0, rows_total, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        to_float(q + r * D, &q32[r * D], static_cast<int>(D));
        if constexpr (kRotated<F>) fwht(&q32[r * D], D);
      }
    });
  }
  const int64_t num_items = static_cast<int64_t>(tiles.size()) * KH;
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    QuantScratch s(kQueryTile * G, D, B);
    std::unique_ptr<TiledScratch> tiled;  // made on a thread's first many-row tile
    for (int64_t it = begin; it < end; ++it) {
      const Tile& tile = tiles[it / KH];
      const int64_t kh = it % KH, seq = tile.seq;
      const int64_t nq = tile.q_end - tile.q_begin, rows = nq * G;
      const int64_t first_pos = seq_lens[seq] - (qsl[seq + 1] - qsl[seq]) + (tile.q_begin - qsl[seq]);
      if (tiled_tile(tile)) {
        if (!tiled) tiled = std::make_unique<TiledScratch>(kQueryTile * G, D);
        if (D == 64) {
          attend_tile_gemm<float, 64>(q32.data(), out32.data(), seq, tile.q_begin, nq, first_pos, H, G, kh, scale,
                                      converted, *tiled);
        } else {
          attend_tile_gemm<float, 128>(q32.data(), out32.data(), seq, tile.q_begin, nq, first_pos, H, G, kh, scale,
                                       converted, *tiled);
        }
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t row = (tile.q_begin + r / G) * H + kh * G + r % G;
          if constexpr (kRotated<F>) fwht(&out32[row * D], D);
          from_float(&out32[row * D], out + row * D, static_cast<int>(D));
        }
        continue;
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* qr = &s.qf[r * D];
        to_float(q + ((tile.q_begin + r / G) * H + kh * G + r % G) * D, qr, static_cast<int>(D));
        for (int64_t d = 0; d < D; ++d) qr[d] *= scale;
        if constexpr (kRotated<F>) fwht(qr, D);
        s.m[r] = -std::numeric_limits<float>::infinity();
        s.l[r] = 0.f;
        std::fill(&s.acc[r * D], &s.acc[r * D] + D, 0.f);
      }
      const int64_t last_key = first_pos + nq;  // keys 0..last_key-1 are visible to some row
      const int64_t* table = tables + seq * max_blocks;
#if defined(__AVX512F__) || defined(__AVX2__)
      if (rows <= kQuantFewRows && (D == 64 || D == 128)) {
        if (it + 1 < end) {  // this thread's next item's first block, which no block ahead fetches
          const Tile& ahead = tiles[(it + 1) / KH];
          const int64_t slot = tables[ahead.seq * max_blocks] * B, offset = (slot * KH + (it + 1) % KH) * CD;
          if (D == 64) {
            prefetch_rows<code_bytes<F>(64)>(reinterpret_cast<const char*>(kc + offset), B, KH * CD);
            prefetch_rows<code_bytes<F>(64)>(reinterpret_cast<const char*>(vc + offset), B, KH * CD);
          } else {
            prefetch_rows<code_bytes<F>(128)>(reinterpret_cast<const char*>(kc + offset), B, KH * CD);
            prefetch_rows<code_bytes<F>(128)>(reinterpret_cast<const char*>(vc + offset), B, KH * CD);
          }
          prefetch_scales(ks, vs, slot, B, KH);
        }
        for (int64_t r0 = 0; r0 < rows; r0 += kQuantRowGroup) {
          const int64_t count = std::min<int64_t>(kQuantRowGroup, rows - r0);
          if (D == 64) {
            decode_tile_quant<F, 64>(kc, vc, ks, vs, table, r0, count, first_pos, KH, G, B, kh, kInt16Query, s);
          } else {
            decode_tile_quant<F, 128>(kc, vc, ks, vs, table, r0, count, first_pos, KH, G, B, kh, kInt16Query, s);
          }
        }
      } else
#endif
      for (int64_t b = 0; b * B < last_key; ++b) {
        const int64_t n = std::min<int64_t>(B, last_key - b * B);
        for (int64_t j = 0; j < n; ++j) {
          const int64_t slot = table[b] * B + j;
          decode_row<F>(kc + (slot * KH + kh) * CD, static_cast<float>(ks[slot * KH + kh]), &s.kf[j * D], D);
          decode_row<F>(vc + (slot * KH + kh) * CD, static_cast<float>(vs[slot * KH + kh]), &s.vf[j * D], D);
        }
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t visible = std::min<int64_t>(n, first_pos + r / G - b * B + 1);
          if (visible <= 0) continue;
          float* sr = &s.scores[r * s.KP];
          const v16* qv = reinterpret_cast<const v16*>(&s.qf[r * D]);
          for (int64_t jc = 0; jc < n; jc += 16) {
            v16 part[16];
            for (int jj = 0; jj < 16; ++jj) {
              if (jc + jj < n) {
                const v16* kr = reinterpret_cast<const v16*>(&s.kf[(jc + jj) * D]);
                v16 dot = qv[0] * kr[0];
                for (int64_t v = 1; v < NV; ++v) dot += qv[v] * kr[v];
                part[jj] = dot;
              } else {
                part[jj] = v16{};
              }
            }
            *reinterpret_cast<v16*>(sr + jc) = reduce16(part);
          }
          const float alpha = softmax_step(sr, n, visible, s.m[r], s.l[r]);
          v16* acc = reinterpret_cast<v16*>(&s.acc[r * D]);
          for (int64_t v = 0; v < NV; ++v) acc[v] *= alpha;
          for (int64_t j = 0; j < visible; ++j) {
            const float p = sr[j];
            const v16* vr = reinterpret_cast<const v16*>(&s.vf[j * D]);
            for (int64_t v = 0; v < NV; ++v) acc[v] += p * vr[v];
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* ar = &s.acc[r * D];
        const float inv = 1.f / s.l[r];
        for (int64_t d = 0; d < D; ++d) ar[d] *= inv;
        if constexpr (kRotated<F>) fwht(ar, D);
        from_float(ar, out + ((tile.q_begin + r / G) * H + kh * G + r % G) * D, static_cast<int>(D));
      }
    }
  });
}

// New K/V rows [T, KH, D] (any float dtype) -> codes and scales in their slots (slot < 0: skipped).
template <KVFormat F, typename T>
void store_quant(const T* key, const T* value, uint8_t* kc, uint8_t* vc, c10::BFloat16* ks, c10::BFloat16* vs,
                 const int64_t* slots, int64_t num_tokens, int64_t KH, int64_t D, const float* fixed) {
  // fixed: static scales [2, KH] (K's, then V's), or nullptr (each row's computed)
  const int64_t CD = code_bytes<F>(D);
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(D);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      for (int64_t h = 0; h < KH; ++h) {
        const int64_t i = slot * KH + h;
        to_float(key + (t * KH + h) * D, row.data(), static_cast<int>(D));
        if constexpr (kRotated<F>) fwht(row.data(), D);
        encode_row<F>(row.data(), D, kc + i * CD, ks + i, fixed ? fixed[h] : 0.f);
        to_float(value + (t * KH + h) * D, row.data(), static_cast<int>(D));
        if constexpr (kRotated<F>) fwht(row.data(), D);
        encode_row<F>(row.data(), D, vc + i * CD, vs + i, fixed ? fixed[KH + h] : 0.f);
      }
    }
  });
}

// Calls fn(std::integral_constant<KVFormat, F>) for the format `codes` stores.
template <typename Fn>
void with_kv_format(const torch::Tensor& codes, Fn&& fn) {
  switch (kv_format_of(codes)) {
    case KVFormat::kInt8: fn(std::integral_constant<KVFormat, KVFormat::kInt8>{}); break;
    case KVFormat::kFp8E4M3: fn(std::integral_constant<KVFormat, KVFormat::kFp8E4M3>{}); break;
    case KVFormat::kFp8E5M2: fn(std::integral_constant<KVFormat, KVFormat::kFp8E5M2>{}); break;
    case KVFormat::kInt4: fn(std::integral_constant<KVFormat, KVFormat::kInt4>{}); break;
  }
}

template <typename T>
void store_kernel(const T* key, const T* value, T* kc, T* vc, const int64_t* slots, int64_t num_tokens,
                  int64_t row) {
  at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // padding: never written
      std::copy(key + t * row, key + (t + 1) * row, kc + slot * row);
      std::copy(value + t * row, value + (t + 1) * row, vc + slot * row);
    }
  });
}

void check_cache(const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches must be contiguous [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.dtype() == v_cache.dtype(), "K/V caches differ");
}

// Every index the kernels follow is checked (serially, before the parallel work) so that a bad
// slot mapping or block table raises instead of reading or writing outside the pool.
void check_slots(const torch::Tensor& slots, int64_t num_slots) {
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < slots.numel(); ++i) {
    TORCH_CHECK(s[i] < num_slots, "slot ", s[i], " is outside the KV pool of ", num_slots, " slots");
  }
}

void check_layout(const torch::Tensor& qsl, const torch::Tensor& lens, const torch::Tensor& tables, int64_t T,
                  int64_t num_blocks, int64_t B) {
  const int64_t S = lens.size(0);
  TORCH_CHECK(qsl.numel() == S + 1 && tables.dim() == 2 && tables.size(0) == S, "metadata shapes do not match");
  const int64_t* q = qsl.data_ptr<int64_t>();
  const int64_t* l = lens.data_ptr<int64_t>();
  const int64_t* t = tables.data_ptr<int64_t>();
  TORCH_CHECK(q[0] == 0 && q[S] == T, "query_start_loc must run from 0 to the number of query rows");
  for (int64_t s = 0; s < S; ++s) {
    const int64_t rows = q[s + 1] - q[s];
    TORCH_CHECK(rows >= 0 && l[s] >= rows, "sequence ", s, " has more new tokens than its length");
    const int64_t used = (l[s] + B - 1) / B;
    TORCH_CHECK(used <= tables.size(1), "sequence ", s, " needs ", used, " blocks, its table has ", tables.size(1));
    for (int64_t b = 0; b < used; ++b) {
      const int64_t id = t[s * tables.size(1) + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block id ", id, " is outside the pool of ", num_blocks, " blocks");
    }
  }
}

// Fresh prefills (every row of the sequence new, no cached prefix) of at least this many rows, in
// bf16, go to torch's scaled_dot_product_attention over their K/V gathered from the pool: its
// flash-attention CPU kernel runs Q K^T and P V as bf16 GEMMs (AMX tiles where the CPU has them).
// 0: never. A per-process setting, chosen once from the CPU's features (cpu_kernel.py), not state.
std::atomic<int64_t> dense_prefill_min_rows{0};

// One fresh prefill: rows [q0, q0 + L) of `query` attend causally to the sequence's own L keys.
void dense_prefill(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                   torch::Tensor& out, int64_t q0, int64_t L, const int64_t* table, double scale) {
  const int64_t B = k_cache.size(1), KH = k_cache.size(2), D = k_cache.size(3);
  auto slots = torch::empty({L}, torch::kLong);
  int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < L; ++i) sp[i] = table[i / B] * B + i % B;
  auto k = k_cache.view({-1, KH, D}).index_select(0, slots).permute({1, 0, 2}).unsqueeze(0);
  auto v = v_cache.view({-1, KH, D}).index_select(0, slots).permute({1, 0, 2}).unsqueeze(0);
  auto q = query.narrow(0, q0, L).permute({1, 0, 2}).unsqueeze(0);
  auto o = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true, scale, /*enable_gqa=*/true);
  out.narrow(0, q0, L).copy_(o.squeeze(0).permute({1, 0, 2}));
}

// dense_prefill over a quantized layer: the sequence's L stored rows decoded (KVCodec's values; int4
// rotated back, so the query is not rotated) and rounded to the query's dtype, then SDPA.
template <KVFormat F>
void dense_prefill_quant(const torch::Tensor& query, const pagedllm_cpu::LayerKV& kv, torch::Tensor& out, int64_t q0,
                         int64_t L, const int64_t* table, double scale) {
  const int64_t B = kv.k.size(1), KH = kv.k.size(2), D = query.size(2), CD = code_bytes<F>(D);
  auto k = torch::empty({L, KH, D}, torch::kFloat), v = torch::empty({L, KH, D}, torch::kFloat);
  const auto* kc = static_cast<const uint8_t*>(kv.k.data_ptr());
  const auto* vc = static_cast<const uint8_t*>(kv.v.data_ptr());
  const auto* ks = static_cast<const c10::BFloat16*>(kv.k_scale.data_ptr());
  const auto* vs = static_cast<const c10::BFloat16*>(kv.v_scale.data_ptr());
  float* kp = k.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  at::parallel_for(0, L * KH, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / KH, h = i % KH, idx = (table[t / B] * B + t % B) * KH + h;
      decode_row<F>(kc + idx * CD, static_cast<float>(ks[idx]), kp + i * D, D);
      decode_row<F>(vc + idx * CD, static_cast<float>(vs[idx]), vp + i * D, D);
      if constexpr (kRotated<F>) {
        fwht(kp + i * D, D);
        fwht(vp + i * D, D);
      }
    }
  });
  auto kq = k.to(query.scalar_type()).permute({1, 0, 2}).unsqueeze(0);
  auto vq = v.to(query.scalar_type()).permute({1, 0, 2}).unsqueeze(0);
  auto q = query.narrow(0, q0, L).permute({1, 0, 2}).unsqueeze(0);
  auto o = at::scaled_dot_product_attention(q, kq, vq, {}, 0.0, /*is_causal=*/true, scale, /*enable_gqa=*/true);
  out.narrow(0, q0, L).copy_(o.squeeze(0).permute({1, 0, 2}));
}

// Which sequences a call attends by dense_prefill: fresh prefills of at least dense_prefill_min_rows
// rows with bf16 queries (set where SDPA's bf16 GEMMs beat the tiled kernel: AMX); none if empty.
std::vector<char> dense_prefills(const torch::Tensor& query, const torch::Tensor& qsl, const torch::Tensor& lens) {
  const int64_t S = lens.size(0), min_rows = dense_prefill_min_rows.load();
  std::vector<char> dense(S, 0);
  bool any_dense = false;
  if (min_rows > 0 && query.scalar_type() == at::kBFloat16) {
    const int64_t* q = qsl.data_ptr<int64_t>();
    const int64_t* l = lens.data_ptr<int64_t>();
    for (int64_t s = 0; s < S; ++s) {
      dense[s] = q[s + 1] - q[s] >= min_rows && q[s + 1] - q[s] == l[s];
      any_dense = any_dense || dense[s];
    }
  }
  return any_dense ? dense : std::vector<char>{};
}

}  // namespace

void set_dense_prefill_min_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0, "dense_prefill_min_rows must be >= 0");
  dense_prefill_min_rows.store(rows);
}

// query [T, H, D]; caches [NB, B, KH, D]; query_start_loc [S+1], seq_lens [S], block_tables [S, MB] (int64)
torch::Tensor attend(torch::Tensor query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                     torch::Tensor query_start_loc, torch::Tensor seq_lens, torch::Tensor block_tables, double scale) {
  check_cache(k_cache, v_cache);
  TORCH_CHECK(query.dim() == 3 && query.dtype() == k_cache.dtype(), "query must be [T, H, D] in the cache dtype");
  query = query.contiguous();
  auto qsl = query_start_loc.to(torch::kLong).contiguous();
  auto lens = seq_lens.to(torch::kLong).contiguous();
  auto tables = block_tables.to(torch::kLong).contiguous();
  auto out = torch::empty_like(query);
  const int64_t H = query.size(1), D = query.size(2), B = k_cache.size(1), KH = k_cache.size(2);
  TORCH_CHECK(H % KH == 0 && D == k_cache.size(3), "head shapes do not match the cache");
  check_layout(qsl, lens, tables, query.size(0), k_cache.size(0), B);
  const int64_t S = lens.size(0);
  const std::vector<char> dense = dense_prefills(query, qsl, lens);
  const bool any_dense = !dense.empty();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention", [&] {
    auto run = [&](auto kernel) {
      kernel(query.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
             out.data_ptr<scalar_t>(), qsl.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
             tables.data_ptr<int64_t>(), lens.size(0), tables.size(1), H, KH, D, B, static_cast<float>(scale),
             any_dense ? dense.data() : nullptr);
    };
    switch (D) {
      case 32: run(attention_kernel<scalar_t, 32>); break;
      case 64: run(attention_kernel<scalar_t, 64>); break;
      case 128: run(attention_kernel<scalar_t, 128>); break;
      default: run(attention_kernel<scalar_t, 0>); break;
    }
  });
  for (int64_t s = 0; any_dense && s < S; ++s) {
    if (dense[s]) {
      const int64_t q0 = qsl.data_ptr<int64_t>()[s];
      dense_prefill(query, k_cache, v_cache, out, q0, qsl.data_ptr<int64_t>()[s + 1] - q0,
                    tables.data_ptr<int64_t>() + s * tables.size(1), scale);
    }
  }
  return out;
}

// Store new K/V rows [T, KH, D] into their slots; slot < 0 is padding and is skipped.
void store(torch::Tensor key, torch::Tensor value, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
           torch::Tensor slot_mapping) {
  check_cache(k_cache, v_cache);
  key = key.to(k_cache.dtype()).contiguous();
  value = value.to(v_cache.dtype()).contiguous();
  auto slots = slot_mapping.to(torch::kLong).contiguous();
  const int64_t row = k_cache.size(2) * k_cache.size(3);
  TORCH_CHECK(key.numel() == slots.numel() * row, "key rows do not match the slot mapping");
  check_slots(slots, k_cache.size(0) * k_cache.size(1));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "store_kv", [&] {
    store_kernel<scalar_t>(key.data_ptr<scalar_t>(), value.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                           v_cache.data_ptr<scalar_t>(), slots.data_ptr<int64_t>(), slots.numel(), row);
  });
}

// A quantized layer: codes [NB, B, KH, code bytes] and per-token bfloat16 scales [NB, B, KH].
void check_quantized(const pagedllm_cpu::LayerKV& kv, int64_t head_dim) {
  const auto& k = kv.k;
  TORCH_CHECK(kv.k_scale.dim() == 3 && kv.k_scale.scalar_type() == at::kBFloat16 &&
                  kv.v_scale.sizes() == kv.k_scale.sizes() && kv.v_scale.scalar_type() == at::kBFloat16,
              "the C++ paged-attention kernel reads K/V without scales or with per-token bfloat16 scales "
              "[num_blocks, block_size, kv_heads] (kv_cache_dtype int8, fp8_e4m3, fp8_e5m2, int4); this KV format "
              "has other scales");
  TORCH_CHECK(k.dim() == 4 && k.is_contiguous() && kv.v.is_contiguous() && kv.k_scale.is_contiguous() &&
                  kv.v_scale.is_contiguous() && k.sizes() == kv.v.sizes() && k.dtype() == kv.v.dtype(),
              "quantized K/V must be contiguous [num_blocks, block_size, kv_heads, code bytes], K and V alike");
  TORCH_CHECK(kv.k_scale.size(0) == k.size(0) && kv.k_scale.size(1) == k.size(1) && kv.k_scale.size(2) == k.size(2),
              "the scales do not match the codes' blocks");
  const KVFormat f = kv_format_of(k);
  TORCH_CHECK(head_dim % 16 == 0, "quantized KV needs a head size divisible by 16, got ", head_dim);
  TORCH_CHECK(f != KVFormat::kInt4 || (head_dim & (head_dim - 1)) == 0,
              "int4 KV (Hadamard-rotated) needs a power-of-two head size here, got ", head_dim);
  TORCH_CHECK(k.size(3) == (f == KVFormat::kInt4 ? head_dim / 2 : head_dim), "the codes do not match head size ",
              head_dim);
}

torch::Tensor attend_quant(torch::Tensor query, const pagedllm_cpu::LayerKV& kv, torch::Tensor query_start_loc,
                           torch::Tensor seq_lens, torch::Tensor block_tables, double scale) {
  TORCH_CHECK(query.dim() == 3, "query must be [T, H, D]");
  const int64_t H = query.size(1), D = query.size(2), B = kv.k.size(1), KH = kv.k.size(2);
  check_quantized(kv, D);
  TORCH_CHECK(H % KH == 0, "head shapes do not match the cache");
  query = query.contiguous();
  auto qsl = query_start_loc.to(torch::kLong).contiguous();
  auto lens = seq_lens.to(torch::kLong).contiguous();
  auto tables = block_tables.to(torch::kLong).contiguous();
  check_layout(qsl, lens, tables, query.size(0), kv.k.size(0), B);
  auto out = torch::empty_like(query);
  const std::vector<char> dense = dense_prefills(query, qsl, lens);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention_quant", [&] {
    with_kv_format(kv.k, [&](auto format) {
      attention_quant<decltype(format)::value, scalar_t>(
          query.data_ptr<scalar_t>(), static_cast<const uint8_t*>(kv.k.data_ptr()),
          static_cast<const uint8_t*>(kv.v.data_ptr()), static_cast<const c10::BFloat16*>(kv.k_scale.data_ptr()),
          static_cast<const c10::BFloat16*>(kv.v_scale.data_ptr()), out.data_ptr<scalar_t>(), qsl.data_ptr<int64_t>(),
          lens.data_ptr<int64_t>(), tables.data_ptr<int64_t>(), lens.size(0), tables.size(1), H, KH, D, B,
          static_cast<float>(scale), dense.empty() ? nullptr : dense.data());
    });
  });
  for (int64_t s = 0; s < static_cast<int64_t>(dense.size()); ++s) {
    if (dense[s]) {
      const int64_t q0 = qsl.data_ptr<int64_t>()[s];
      with_kv_format(kv.k, [&](auto format) {
        dense_prefill_quant<decltype(format)::value>(query, kv, out, q0, qsl.data_ptr<int64_t>()[s + 1] - q0,
                                                     tables.data_ptr<int64_t>() + s * tables.size(1), scale);
      });
    }
  }
  return out;
}

// Quantize new K/V rows [T, KH, D] (any float dtype) into their slots; slot < 0 is skipped.
void store_quant_layer(torch::Tensor key, torch::Tensor value, const pagedllm_cpu::LayerKV& kv,
                       torch::Tensor slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.dtype() == value.dtype(),
              "key and value must be [T, kv_heads, head_dim] alike");
  const int64_t KH = kv.k.size(2), D = key.size(2);
  check_quantized(kv, D);
  TORCH_CHECK(key.size(1) == KH, "key rows do not match the cache's kv heads");
  key = key.contiguous();
  value = value.contiguous();
  auto slots = slot_mapping.to(torch::kLong).contiguous();
  TORCH_CHECK(slots.numel() == key.size(0), "key rows do not match the slot mapping");
  check_slots(slots, kv.k.size(0) * kv.k.size(1));
  const float* fixed = nullptr;
  if (kv.static_scales.defined()) {
    TORCH_CHECK(kv.static_scales.scalar_type() == at::kFloat && kv.static_scales.is_contiguous() &&
                    kv.static_scales.dim() == 2 && kv.static_scales.size(0) == 2 && kv.static_scales.size(1) == KH,
                "static KV scales must be contiguous float32 [2, kv_heads]");
    fixed = kv.static_scales.data_ptr<float>();
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "store_kv_quant", [&] {
    with_kv_format(kv.k, [&](auto format) {
      store_quant<decltype(format)::value, scalar_t>(
          key.data_ptr<scalar_t>(), value.data_ptr<scalar_t>(), static_cast<uint8_t*>(kv.k.data_ptr()),
          static_cast<uint8_t*>(kv.v.data_ptr()), static_cast<c10::BFloat16*>(kv.k_scale.data_ptr()),
          static_cast<c10::BFloat16*>(kv.v_scale.data_ptr()), slots.data_ptr<int64_t>(), slots.numel(), KH, D,
          fixed);
    });
  });
}

// Either format: without scales, the model dtype's kernels; with them, the quantized ones.
torch::Tensor attend_layer(torch::Tensor query, const pagedllm_cpu::LayerKV& kv, torch::Tensor query_start_loc,
                           torch::Tensor seq_lens, torch::Tensor block_tables, double scale) {
  if (kv.has_scales()) return attend_quant(query, kv, query_start_loc, seq_lens, block_tables, scale);
  return attend(query, kv.k, kv.v, query_start_loc, seq_lens, block_tables, scale);
}

void store_layer(torch::Tensor key, torch::Tensor value, const pagedllm_cpu::LayerKV& kv, torch::Tensor slots) {
  if (kv.has_scales()) return store_quant_layer(key, value, kv, slots);
  store(key, value, kv.k, kv.v, slots);
}

// RoPE (rotate-half convention) on one row of `heads` heads: out = x * cos + rotate_half(x) * sin,
// each product rounded before the sum, as torch computes it (no FMA contraction), so float32
// results equal the unfused path bit for bit; a bf16/fp16 row is computed in float32 and rounded
// once. A bf16 row runs 16 (AVX-512) or 8 (AVX2) dims at a time, rounded as c10::BFloat16 rounds
// (bf16_bits): the same bits as the scalar loop, which takes the dims past the last whole vector.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rope_row(const T* x, const T* cos, const T* sin, T* out,
                                                           int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const T* xh = x + h * D;
    T* oh = out + h * D;
    int64_t d = 0;
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
#if defined(__AVX512F__)
      auto widen = [](const T* p) {
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
      };
      auto put = [](T* p, __m512 v) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(v)));
      };
      for (; d + 16 <= half; d += 16) {
        const __m512 x1 = widen(xh + d), x2 = widen(xh + d + half);
        put(oh + d, _mm512_sub_ps(_mm512_mul_ps(x1, widen(cos + d)), _mm512_mul_ps(x2, widen(sin + d))));
        put(oh + d + half,
            _mm512_add_ps(_mm512_mul_ps(x2, widen(cos + d + half)), _mm512_mul_ps(x1, widen(sin + d + half))));
      }
#elif defined(__AVX2__)
      auto widen = [](const T* p) {
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
      };
      auto put = [](T* p, __m256 v) {
        const __m256i bits = bf16_bits8(v);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                         _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
      };
      for (; d + 8 <= half; d += 8) {
        const __m256 x1 = widen(xh + d), x2 = widen(xh + d + half);
        put(oh + d, _mm256_sub_ps(_mm256_mul_ps(x1, widen(cos + d)), _mm256_mul_ps(x2, widen(sin + d))));
        put(oh + d + half,
            _mm256_add_ps(_mm256_mul_ps(x2, widen(cos + d + half)), _mm256_mul_ps(x1, widen(sin + d + half))));
      }
#endif
    }
    for (; d < half; ++d) {
      const float x1 = static_cast<float>(xh[d]), x2 = static_cast<float>(xh[d + half]);
      const float a = x1 * static_cast<float>(cos[d]), b = x2 * static_cast<float>(sin[d]);
      const float c = x2 * static_cast<float>(cos[d + half]), e = x1 * static_cast<float>(sin[d + half]);
      oh[d] = static_cast<T>(a - b);
      oh[d + half] = static_cast<T>(c + e);
    }
  }
}

// The whole attention block after the QKV projection, in one call per layer: RoPE on q and k
// (from the fused qkv rows [T, (H + 2 KH) * D]), k and v stored into their slots (padding skipped;
// a quantized format's rows encoded on the way, from the roped k in the model dtype), then paged
// attention of the rotated q. Returns [T, H, D].
torch::Tensor rope_store_attend_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor positions,
                                   const pagedllm_cpu::LayerKV& kv, torch::Tensor slot_mapping,
                                   torch::Tensor query_start_loc, torch::Tensor seq_lens, torch::Tensor block_tables,
                                   double scale, int64_t H) {
  const bool quantized = kv.has_scales();
  const torch::Tensor& k_cache = kv.k;
  const torch::Tensor& v_cache = kv.v;
  qkv = qkv.contiguous();
  TORCH_CHECK(cos.dim() == 2 && cos.dtype() == qkv.dtype() && sin.dtype() == qkv.dtype(),
              "qkv and cos/sin must share a dtype");
  const int64_t T = qkv.size(0), KH = k_cache.size(2), D = cos.size(1), row = KH * D;
  if (quantized) {
    check_quantized(kv, D);
  } else {
    check_cache(k_cache, v_cache);
    TORCH_CHECK(qkv.dtype() == k_cache.dtype() && D == k_cache.size(3), "qkv and the cache must share a dtype");
  }
  TORCH_CHECK(qkv.size(1) == (H + 2 * KH) * D, "qkv rows do not match the head layout");
  auto pos = positions.to(torch::kLong).contiguous();
  auto slots = slot_mapping.to(torch::kLong).contiguous();
  TORCH_CHECK(pos.numel() == T && slots.numel() == T, "positions and slots must have one entry per row");
  check_slots(slots, k_cache.size(0) * k_cache.size(1));
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pp[t] >= 0 && pp[t] < cos.size(0), "position ", pp[t], " is outside the RoPE table");
  }
  auto query = torch::empty({T, H, D}, qkv.options());
  auto key = quantized ? torch::empty({T, KH, D}, qkv.options()) : torch::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_store", [&] {
    const scalar_t* src = qkv.data_ptr<scalar_t>();
    const scalar_t* cs = cos.data_ptr<scalar_t>();
    const scalar_t* sn = sin.data_ptr<scalar_t>();
    scalar_t* q = query.data_ptr<scalar_t>();
    scalar_t* kc = quantized ? key.data_ptr<scalar_t>() : k_cache.data_ptr<scalar_t>();
    scalar_t* vc = quantized ? nullptr : v_cache.data_ptr<scalar_t>();
    const int64_t* p = pos.data_ptr<int64_t>();
    const int64_t* sl = slots.data_ptr<int64_t>();
    const int64_t stride = (H + 2 * KH) * D;
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* r = src + t * stride;
        const scalar_t* c = cs + p[t] * D;
        const scalar_t* s = sn + p[t] * D;
        rope_row(r, c, s, q + t * H * D, H, D);
        if (quantized) {
          rope_row(r + H * D, c, s, kc + t * row, KH, D);  // encoded below with the value rows
          continue;
        }
        if (sl[t] < 0) continue;
        rope_row(r + H * D, c, s, kc + sl[t] * row, KH, D);
        std::copy(r + (H + KH) * D, r + (H + 2 * KH) * D, vc + sl[t] * row);
      }
    });
  });
  if (quantized) {
    store_quant_layer(key, qkv.narrow(1, (H + KH) * D, KH * D).reshape({T, KH, D}), kv, slots);
    return attend_quant(query, kv, query_start_loc, seq_lens, block_tables, scale);
  }
  return attend(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale);
}

// The Python entry points: a layer's KV as LayerKV.tensors, (k, v) or (k, v, k_scale, v_scale).
// query [T, H, D]; k/v [NB, B, KH, D]; query_start_loc [S+1], seq_lens [S], block_tables [S, MB]
torch::Tensor paged_attention(torch::Tensor query, const std::vector<torch::Tensor>& kv,
                              torch::Tensor query_start_loc, torch::Tensor seq_lens, torch::Tensor block_tables,
                              double scale) {
  return attend_layer(query, pagedllm_cpu::LayerKV::from_tensors(kv), query_start_loc, seq_lens, block_tables, scale);
}

// Store new K/V rows [T, KH, D] into their slots; slot < 0 is padding and is skipped.
void store_kv(torch::Tensor key, torch::Tensor value, const std::vector<torch::Tensor>& kv,
              torch::Tensor slot_mapping) {
  store_layer(key, value, pagedllm_cpu::LayerKV::from_tensors(kv), slot_mapping);
}

// The fused path: store the step's new K/V rows, then attend, in one call per layer.
torch::Tensor store_and_attend(torch::Tensor query, torch::Tensor key, torch::Tensor value,
                               const std::vector<torch::Tensor>& kv, torch::Tensor slot_mapping,
                               torch::Tensor query_start_loc, torch::Tensor seq_lens, torch::Tensor block_tables,
                               double scale) {
  const auto layer = pagedllm_cpu::LayerKV::from_tensors(kv);
  store_layer(key, value, layer, slot_mapping);
  return attend_layer(query, layer, query_start_loc, seq_lens, block_tables, scale);
}

torch::Tensor rope_store_attend(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor positions,
                                const std::vector<torch::Tensor>& kv, torch::Tensor slot_mapping,
                                torch::Tensor query_start_loc, torch::Tensor seq_lens, torch::Tensor block_tables,
                                double scale, int64_t H) {
  return rope_store_attend_kv(qkv, cos, sin, positions, pagedllm_cpu::LayerKV::from_tensors(kv), slot_mapping,
                              query_start_loc, seq_lens, block_tables, scale, H);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention over a block table (CPU)");
  m.def("set_dense_prefill_min_rows", &set_dense_prefill_min_rows,
        "fresh bf16 prefills of at least this many rows attend through torch's SDPA (0: never)");
  m.def("store_kv", &store_kv, "store K/V rows into their slots (CPU)");
  m.def("store_and_attend", &store_and_attend, "store K/V rows, then paged attention (CPU)");
  m.def("rope_store_attend", &rope_store_attend, "RoPE on q/k, store K/V, paged attention (CPU)");
  // the same function for the decoder stack's C++ layer loop (csrc/kernel_abi.h)
  static_assert(std::is_same_v<decltype(&rope_store_attend_kv), pagedllm_cpu::RopeStoreAttendFn>);
  m.attr("rope_store_attend_fn") = pybind11::capsule(reinterpret_cast<void*>(&rope_store_attend_kv),
                                                     pagedllm_cpu::kRopeStoreAttendCapsule);
}
