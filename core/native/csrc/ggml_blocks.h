// GGML's quantized blocks as the ggml_linear kernels read them: the block types, a sub-block unpacked (portably,
// and in AVX2 registers), and x quantized per 32 values to int8. ggml_linear.cpp holds the tiles of a few rows and
// the op; ggml_gemm.cpp the batched paths (VPDPBUSD, VPMADDUBSW, AMX-INT8), which compute the same bits.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define CONVEYOR_AVX2 1
#endif

// TDPBSUD (AMX: a tile of signed bytes times a tile of unsigned ones, int32 sums): the batched path's products
// where the CPU has AMX-INT8.
#if defined(CONVEYOR_AVX512_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define CONVEYOR_AMX_INT8 1
#endif

namespace conveyor {
namespace ggml {

// The order conveyor.model.ggml.TYPE_IDS numbers them by.
// Q4_X2: Q4_0 and Q4_1 repacked at load (conveyor.model.ggml.repack), two blocks to a unit: their 32 bytes of
// nibbles, then their two float16 scales and two offsets; the same bits, read with fewer instructions.
enum Type : int64_t { Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, Q4_X2, kNumTypes };

constexpr int64_t kSub = 32;  // values of a sub-block: one scale (two for Q6_K), one offset
constexpr int64_t kBlockValues[kNumTypes] = {32, 32, 32, 32, 32, 256, 256, 256, 64};
constexpr int64_t kBlockBytes[kNumTypes] = {18, 20, 22, 24, 34, 144, 176, 210, 40};
// whether a type's unpacked values are signed (else unsigned with an offset)
constexpr bool kSigned[kNumTypes] = {false, false, false, false, true, false, false, true, false};
template <Type t>
constexpr int kHalves = t == Q6_K ? 2 : 1;  // scales a sub-block has (Q6_K: one per 16 values)

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  if (exponent == 0x1f) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
  return (sign ? -1.0f : 1.0f) * std::ldexp(float(mantissa), -24);  // subnormal
}

// Q4_K and Q5_K: the six-bit scale and offset of sub-block j (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, uint8_t* scale, uint8_t* min) {
  if (j < 4) {
    *scale = q[j] & 63;
    *min = q[j + 4] & 63;
  } else {
    *scale = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
    *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One row of the weight, unpacked: per sub-block s its 32 values as bytes (q), the scale of each of its eight
// groups of four values (scale[8 s + g]: the lanes VPMADDWD leaves) and the offset added per unit of x.
struct Unpacked {
  uint8_t* q;
  float* scale;
  float* offset;
};

inline void set_scale(float* scale, float lo, float hi) {
  for (int g = 0; g < 4; ++g) scale[g] = lo;
  for (int g = 4; g < 8; ++g) scale[g] = hi;
}

// Unpacks one block (sub-blocks first_sub ...) of type t.
template <Type t>
inline void unpack_block(const uint8_t* b, int64_t first_sub, const Unpacked& u) {
  uint8_t* q = u.q + first_sub * kSub;
  float* scale = u.scale + first_sub * 8;
  float* offset = u.offset + first_sub;
  switch (t) {  // (t is a constant: one case is compiled per type)
    case Q4_0:
    case Q4_1: {
      const float d = half_to_float(b);
      const uint8_t* qs = b + (t == Q4_0 ? 2 : 4);
      for (int i = 0; i < 16; ++i) q[i] = qs[i] & 0x0f, q[i + 16] = qs[i] >> 4;
      set_scale(scale, d, d);
      offset[0] = t == Q4_0 ? -8.0f * d : half_to_float(b + 2);
      break;
    }
    case Q5_0:
    case Q5_1: {
      const float d = half_to_float(b);
      const uint8_t* qh = b + (t == Q5_0 ? 2 : 4);
      const uint8_t* qs = qh + 4;
      uint32_t high;
      std::memcpy(&high, qh, 4);
      for (int i = 0; i < 16; ++i) {
        q[i] = (qs[i] & 0x0f) | (((high >> i) & 1) << 4);
        q[i + 16] = (qs[i] >> 4) | (((high >> (i + 16)) & 1) << 4);
      }
      set_scale(scale, d, d);
      offset[0] = t == Q5_0 ? -16.0f * d : half_to_float(b + 2);
      break;
    }
    case Q8_0: {
      std::memcpy(q, b + 2, 32);
      const float d = half_to_float(b);
      set_scale(scale, d, d);
      offset[0] = 0.0f;
      break;
    }
    case Q4_K:
    case Q5_K: {
      const float d = half_to_float(b), dmin = half_to_float(b + 2);
      const uint8_t* scales = b + 4;
      const uint8_t* qh = b + 16;  // Q5_K: bit j of byte l is the fifth bit of value l of sub-block j
      const uint8_t* qs = b + (t == Q4_K ? 16 : 48);
      for (int j = 0; j < 8; ++j) {
        uint8_t sc, m;
        scale_min_k4(j, scales, &sc, &m);
        const uint8_t* chunk = qs + 32 * (j / 2);
        const int shift = 4 * (j & 1);
        for (int l = 0; l < 32; ++l) {
          uint8_t value = (chunk[l] >> shift) & 0x0f;
          if (t == Q5_K) value |= ((qh[l] >> j) & 1) << 4;
          q[32 * j + l] = value;
        }
        set_scale(scale + 8 * j, d * sc, d * sc);
        offset[j] = -dmin * m;
      }
      break;
    }
    case Q6_K: {
      const float d = half_to_float(b + 208);
      const auto* scales = reinterpret_cast<const int8_t*>(b + 192);
      for (int half = 0; half < 2; ++half) {
        const uint8_t* ql = b + 64 * half;
        const uint8_t* qh = b + 128 + 32 * half;
        for (int j = 0; j < 4; ++j) {
          const int s = 4 * half + j;
          const uint8_t* low = ql + 32 * (j % 2);
          const int shift = 4 * (j / 2);
          for (int l = 0; l < 32; ++l) {
            const int value = (((low[l] >> shift) & 0x0f) | (((qh[l] >> (2 * j)) & 3) << 4)) - 32;
            q[32 * s + l] = static_cast<uint8_t>(static_cast<int8_t>(value));
          }
          const int8_t* sc = scales + 8 * half + 2 * j;
          set_scale(scale + 8 * s, d * sc[0], d * sc[1]);
          offset[s] = 0.0f;
        }
      }
      break;
    }
    case Q4_X2: {
      for (int j = 0; j < 2; ++j) {
        const uint8_t* qs = b + 16 * j;
        for (int i = 0; i < 16; ++i) q[32 * j + i] = qs[i] & 0x0f, q[32 * j + i + 16] = qs[i] >> 4;
        const float d = half_to_float(b + 32 + 2 * j);
        set_scale(scale + 8 * j, d, d);
        offset[j] = half_to_float(b + 36 + 2 * j);
      }
      break;
    }
    default: break;
  }
}

template <Type t>
void unpack_row(const uint8_t* row, int64_t K, const Unpacked& u) {
  constexpr int64_t values = kBlockValues[t], size = kBlockBytes[t];
  for (int64_t blk = 0; blk < K / values; ++blk) unpack_block<t>(row + blk * size, blk * values / kSub, u);
}


// x quantized per sub-block: q = round(x / d), d = max |x| / 127; sum = d * sum(q) (what an offset multiplies).
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> scale, sum;
  // d * the sum of each half (16 values) of a sub-block: Q6_K's offsets in the batched path
  std::vector<float> half_sum;
  // the sums of each half of a sub-block's q, exactly (the tiles' shifts of Q8_0 and Q6_K)
  std::vector<int32_t> half_isum;
  // q in Q4_X2's order (pair_rows), for its AVX2 tiles
  std::vector<int8_t> paired_q;
};

template <typename T>
float to_float(T v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    return bf16_to_float(v.x);
  } else {
    return static_cast<float>(v);
  }
}

// One sub-block of x: its 32 values quantized into q; returns d (q * d approximates x) and the sums of q's halves.
template <typename T>
inline float quantize_sub(const T* src, int8_t* q, int* halves) {
#ifdef CONVEYOR_AVX2
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) {
      if constexpr (std::is_same_v<T, float>) {
        v[i] = _mm256_loadu_ps(src + 8 * i);
      } else {
        const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 8 * i));
        if constexpr (std::is_same_v<T, at::Half>)
          v[i] = _mm256_cvtph_ps(bits);
        else
          v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
      }
    }
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], magnitude), _mm256_and_ps(v[1], magnitude)),
                             _mm256_max_ps(_mm256_and_ps(v[2], magnitude), _mm256_and_ps(v[3], magnitude)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float d = amax / 127.0f, inverse = d > 0.0f ? 1.0f / d : 0.0f;
    __m256i qi[4];  // (rounded to nearest even, as std::nearbyint below)
    for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inverse)));
    for (int h = 0; h < 2; ++h) {
      const __m256i pair = _mm256_add_epi32(qi[2 * h], qi[2 * h + 1]);
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(pair), _mm256_extracti128_si256(pair, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
      halves[h] = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1)));
    }
    // packing works within 128-bit lanes: the permutation puts the four groups of eight back in order
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    return d;
  }
#endif
  float values[kSub];
  float amax = 0.0f;
  for (int k = 0; k < kSub; ++k) values[k] = to_float(src[k]), amax = std::max(amax, std::fabs(values[k]));
  const float d = amax / 127.0f, inverse = d > 0.0f ? 1.0f / d : 0.0f;
  halves[0] = halves[1] = 0;
  for (int k = 0; k < kSub; ++k) {
    q[k] = static_cast<int8_t>(std::nearbyint(values[k] * inverse));
    halves[k / 16] += q[k];
  }
  return d;
}

template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, QuantizedRows& out) {
  const int64_t subs = K / kSub;
  out.q.resize(M * K);
  out.scale.resize(M * subs);
  out.sum.resize(M * subs);
  out.half_sum.resize(2 * M * subs);
  out.half_isum.resize(2 * M * subs);
  at::parallel_for(0, M * subs, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t offset = (i / subs) * K + (i % subs) * kSub;
      int halves[2];
      const float d = quantize_sub(x + offset, out.q.data() + offset, halves);
      out.scale[i] = d;
      out.sum[i] = d * (halves[0] + halves[1]);
      out.half_sum[2 * i] = d * halves[0];
      out.half_sum[2 * i + 1] = d * halves[1];
      out.half_isum[2 * i] = halves[0];
      out.half_isum[2 * i + 1] = halves[1];
    }
  });
}

template <typename T>
void store(T* out, float value) {
  if constexpr (std::is_same_v<T, float>) {
    *out = value;
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    out->x = float_to_bf16(value);
  } else {
    *out = static_cast<T>(value);
  }
}

// The kernel paths, fastest last: each includes the ones before it.
enum Path { kScalar, kAvx2, kVnni, kAmx };

#ifdef CONVEYOR_AVX2
// Sub-block j of one block of type t, unpacked in registers: its 32 values as bytes (signed for kSigned
// types), its scale (Q6_K: the scale of each group of four values, the lanes VPMADDWD leaves, as two scales
// of 16 differ) and its offset per unit of x.
struct SubBlock {
  __m256i q;
  float scale;
  float offset;
  __m256 lane_scales;  // (Q6_K only)
};

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// 16 bytes -> their low nibbles (values 0-15), then their high ones (16-31).
inline __m256i nibbles(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0f);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), _mm_and_si128(bytes, mask));
}

// 32 bits -> 32 bytes, 16 where the bit is set (the fifth bit of Q5_0 / Q5_1 values).
inline __m256i fifth_bits(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(int(bits)),
                                             _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                               0x0101010101010101, 0x0000000000000000));
  const __m256i select = _mm256_set1_epi64x(0x8040201008040201);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select), _mm256_set1_epi8(16));
}

template <Type t>
inline SubBlock unpack_sub(const uint8_t* b, int j) {
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  if constexpr (t == Q4_0 || t == Q4_1) {
    const float d = half(b);
    return {nibbles(b + (t == Q4_0 ? 2 : 4)), d, t == Q4_0 ? -8.0f * d : half(b + 2), _mm256_setzero_ps()};
  } else if constexpr (t == Q5_0 || t == Q5_1) {
    const float d = half(b);
    const uint8_t* qh = b + (t == Q5_0 ? 2 : 4);
    return {_mm256_or_si256(nibbles(qh + 4), fifth_bits(qh)), d, t == Q5_0 ? -16.0f * d : half(b + 2),
            _mm256_setzero_ps()};
  } else if constexpr (t == Q8_0) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)), half(b), 0.0f, _mm256_setzero_ps()};
  } else if constexpr (t == Q4_K || t == Q5_K) {
    uint8_t sc, m;
    scale_min_k4(j, b + 4, &sc, &m);
    const uint8_t* chunk = b + (t == Q4_K ? 16 : 48) + 32 * (j / 2);
    __m256i q = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk)),
                                                   4 * (j & 1)), low4);
    if constexpr (t == Q5_K) {
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
      q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, j), _mm256_set1_epi8(1)), 4));
    }
    return {q, half(b) * sc, -half(b + 2) * m, _mm256_setzero_ps()};
  } else if constexpr (t == Q4_X2) {  // (the batched path's; its tiles read whole units)
    return {nibbles(b + 16 * j), half(b + 32 + 2 * j), half(b + 36 + 2 * j), _mm256_setzero_ps()};
  } else {  // Q6_K: sub-block j = 4 * half + i of 32 values, two scales of 16
    const int h = j / 4, i = j % 4;
    const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32 * (i % 2)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    const __m256i q = _mm256_or_si256(
        _mm256_and_si256(_mm256_srli_epi16(low, 4 * (i / 2)), low4),
        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * i), _mm256_set1_epi8(3)), 4));
    const auto* sc = reinterpret_cast<const int8_t*>(b + 192 + 8 * h + 2 * i);
    const float d = half(b + 208);
    return {_mm256_sub_epi8(q, _mm256_set1_epi8(32)), 0.0f, 0.0f,
            _mm256_set_m128(_mm_set1_ps(d * sc[1]), _mm_set1_ps(d * sc[0]))};
  }
}

// The scale and offset of each half (kHalves) of a sub-block as the vector paths multiply it: Q8_0's and Q6_K's
// values shifted up to unsigned, their offsets taking the shift back. One function, so that the tiles and the
// batched path use the same bits.
template <Type t>
inline void vector_scales(const SubBlock& sub, float* scale, float* offset) {
  if constexpr (t == Q6_K) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, sub.lane_scales);
    for (int h = 0; h < 2; ++h) scale[h] = lanes[4 * h], offset[h] = -32.0f * lanes[4 * h];
  } else {
    scale[0] = sub.scale;
    offset[0] = t == Q8_0 ? -128.0f * sub.scale : sub.offset;
  }
}
#endif

// ggml_gemm.cpp: out = x w^T (+ bias) for a step of many rows on `path`'s batched GEMM, where the path and the
// number of rows call for one (true); else false, and the caller's tiles take the step.
template <typename T>
bool run_gemm(const uint8_t* weight, Type t, int64_t M, int64_t N, int64_t K, QuantizedRows& x, const T* bias, T* out,
              Path path);

// The type number (conveyor.model.ggml.TYPE_IDS) of Q8_0R: Q8_0 blocks whose scales are one a row (the int8
// method's per-channel weights). Every path reads them as Q8_0 but AMX's, which may then quantize x per 64 values
// (run_rows_gemm).
constexpr int64_t kQ8_0Rows = kNumTypes;

// ggml_gemm.cpp: out = x w^T (+ bias) for Q8_0R weights on the AMX path, for steps of kAmxRowsMin rows or more with K
// a multiple of 64 (true); else false, and the caller takes the step as Q8_0.
template <typename T>
bool run_rows_gemm(const T* x, const uint8_t* weight, int64_t M, int64_t N, int64_t K, const T* bias, T* out,
                   Path path);

// ggml_gemm.cpp: the fewest rows a step needs to take the AMX panels on the kAmx path (fewer: the VNNI panels or
// the tiles). Chosen by timing both at load (conveyor.native.gemm_choice); 32 until then.
int64_t amx_min_rows();
void set_amx_min_rows(int64_t rows);

}  // namespace ggml
}  // namespace conveyor
