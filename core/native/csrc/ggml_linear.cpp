// A linear layer over llama.cpp's quantized blocks, read as the GGUF file stores them:
// y[M, N] = x[M, K] w[N, K]^T (+ bias), w as N rows of GGML blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
// Q6_K), never expanded in memory.
//
// Why integer dot products: a decode step reads each weight once, so its time is the bytes it reads, and a
// 4-bit block is 5 bits a weight against bf16's 16. Unpacking each block to floats and multiplying in float32
// costs more instructions per weight than the bytes take to arrive; instead each row of x is quantized per
// 32 values to int8 with one scale (llama.cpp's Q8 activations: a relative error of at most 1/254 per value),
// and each 32-value sub-block of the weight, unpacked to bytes once, is multiplied with every row of the step
// by VPMADDUBSW (unsigned x signed bytes, pairs summed) and VPMADDWD: 32 multiply-adds in two instructions.
// So batched decodes and prompt chunks reuse each unpacked block for all their rows rather than unpacking it
// again per row. Formats whose values are unsigned with an offset (Q4_0's -8, Q4_1's min, the K-quants' mins)
// are kept unsigned and their offset applied once per sub-block through the sum of x's quantized values;
// signed ones (Q8_0, Q6_K) move their sign onto x (VPSIGNB).
//
// Steps of a few rows take tiles that unpack each sub-block in registers and multiply it with up to four rows
// at once (their AVX2 path runs on any x86-64 CPU of the last decade). Steps of more rows (batched decodes,
// prompt chunks) take a GEMM: a thread unpacks a panel of 32 output columns once into its cache and multiplies
// every row with it, with VPDPBUSD where the CPU has AVX-512 VNNI (AMD Zen 4, Intel since Ice Lake), else
// VPMADDUBSW; from 32 rows with AMX-INT8 tiles where the CPU has them (Intel since Sapphire Rapids). Weights
// unpacked to bfloat16 in registers (AVX-512 BF16) were the other choice, decided by count rather than by a
// second kernel: VPDPBF16PS does 32 multiply-adds an instruction against VPDPBUSD's 64, with the
// same unpacking, and the kernel is bound by its instructions, not by the bytes it reads.
//
// Threads take output columns from a shared counter, so a thread on a core that another process also wants
// does less of the work rather than holding the step back (a static split waits for its slowest share). A
// portable scalar path computes the same integer products (other CPUs; its float sums may differ in their last
// bits from the vector paths, which agree bit for bit); the tests force every path built.
//
// NOTE: 2-core AMD EPYC (Zen 4), SmolLM2's 30 layers of Q4_1 linear weights (as Q4_X2), 2 threads, one run of
// `python benchmarks/quant.py --kernels` (ms a step; VNNI / AVX2 alone / bf16 F.linear over the dequantized
// weights): 1 row 7.7 / 8.5 / 31.0; 16 rows 21.9 / 29.4 / 36.3; 64 rows 67.8 / 92.6 / 59.6; 256 rows
// 147.1 / 283.1 / 175.0; 512 rows 284.7 / 558.6 / 312.5. (This machine's timings vary by up to 2x from run to
// run: compare within a run.) One thread, 512 x 1536 x 576: 118 GMAC/s against bf16's 94. With the tiles'
// prefetch (kPrefetchTiles), another run: 1 row 5.0 / 5.1 / 19.3; 4 rows 9.0 / 8.9 / 22.6; 16 rows 22.4 / 29.5 /
// 33.9.
// NOTE: 2-core Xeon with AMX, the same command, one run (VNNI / AMX / bf16 F.linear, oneDNN's AMX): 64 rows
// 46.6 / 45.1 / 27.4 ms; 256 rows 157.2 / 147.9 / 76.2; 512 rows 253.3 / 226.6 / 68.4. AMX gains little here:
// every 32 values have their own scales, so each TDPBSUD (16 rows x 16 columns x 32) is followed by a store of
// its sums and their scaling in AVX-512, where bf16 tiles sum a whole row of K in the tile.
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "common.h"
#include "kernels.h"

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
namespace {

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

float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  if (exponent == 0x1f) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
  return (sign ? -1.0f : 1.0f) * std::ldexp(float(mantissa), -24);  // subnormal
}

// Q4_K and Q5_K: the six-bit scale and offset of sub-block j (ggml's get_scale_min_k4).
void scale_min_k4(int j, const uint8_t* q, uint8_t* scale, uint8_t* min) {
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

void set_scale(float* scale, float lo, float hi) {
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

constexpr int64_t kRowTile = 4;  // rows of x multiplied with each unpacked sub-block
constexpr int64_t kColumns = 4;  // the most output columns unpacked and multiplied together (one row: 4; more: 2)

// Columns a tile of `rows` rows takes: its accumulators (rows x columns) and unpacked weights fit in registers.
inline int64_t tile_columns(int64_t rows) { return rows == 1 ? 4 : 2; }
constexpr int64_t kMinChunk = 16;  // the fewest output columns a thread takes at a time

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

// Output columns [n, n + columns) for rows [m0, m0 + rows): sums[r * kColumns + c], offsets included.
using Tile = void (*)(const uint8_t* weight, int64_t row_bytes, int64_t n, int64_t columns, const QuantizedRows& x,
                      int64_t m0, int64_t rows, int64_t K, float* sums, float* scratch);

// The portable path: each weight row unpacked into scratch, then plain integer dot products.
template <Type t>
void scalar_tile(const uint8_t* weight, int64_t row_bytes, int64_t n, int64_t columns, const QuantizedRows& x,
                 int64_t m0, int64_t rows, int64_t K, float* sums, float* scratch) {
  const int64_t subs = K / kSub;
  const Unpacked w{reinterpret_cast<uint8_t*>(scratch), scratch + K / 4, scratch + K / 4 + 8 * subs};
  for (int c = 0; c < columns; ++c) {
    unpack_row<t>(weight + (n + c) * row_bytes, K, w);
    for (int r = 0; r < rows; ++r) {
      const int8_t* xq = x.q.data() + (m0 + r) * K;
      float total = 0.0f;
      for (int64_t s = 0; s < subs; ++s) {
        float sub = 0.0f;
        for (int g = 0; g < 8; ++g) {
          int32_t dot = 0;
          for (int k = 32 * s + 4 * g; k < 32 * s + 4 * g + 4; ++k)
            dot += (kSigned[t] ? int32_t(int8_t(w.q[k])) : int32_t(w.q[k])) * xq[k];
          sub += w.scale[8 * s + g] * float(dot);
        }
        total += x.scale[(m0 + r) * subs + s] * sub + w.offset[s] * x.sum[(m0 + r) * subs + s];
      }
      sums[r * kColumns + c] = total;
    }
  }
}

#ifdef CONVEYOR_AVX2
// The tiles prefetch the weights of the next tile while they multiply these. NOTE: without it a step of one row
// read the default model's packed layers from memory at 9.9 GB/s and its Q8_0 head at 11.8 (6.7 and 2.5 ms,
// 2-core Zen 4, where the same core streams 21 GB/s and two 28): each tile's four rows are only 1.4-3.8 KB of
// memory, too short a run for the hardware's prefetcher to get ahead. With it, 15-16 GB/s and 21-24 GB/s (4.1-4.5
// and 1.3-1.4 ms); one tile ahead and two measured alike, four and eight slower for the layers.
constexpr int64_t kPrefetchTiles = 1;

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
    return {_mm256_or_si256(nibbles(qh + 4), fifth_bits(qh)), d, t == Q5_0 ? -16.0f * d : half(b + 2), _mm256_setzero_ps()};
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

// The int32 dot products of up to four columns (C of them; lanes: groups of four values) summed per half of
// the register, column c in lane c: low, the first 16 values (lanes 0-3), high, the second 16.
template <int C>
inline void column_sums(const __m256i* d, __m128i* low, __m128i* high) {
  const __m256i zero = _mm256_setzero_si256();
  const __m256i ab = _mm256_hadd_epi32(d[0], C > 1 ? d[1] : zero);
  const __m256i cd = C > 2 ? _mm256_hadd_epi32(d[2], C > 3 ? d[3] : zero) : zero;
  const __m256i sums = _mm256_hadd_epi32(ab, cd);
  *low = _mm256_castsi256_si128(sums);
  *high = _mm256_extracti128_si256(sums, 1);
}

// acc += dots * scale * x's scale, then offset * x's sum: the float arithmetic of every vector path, in this
// order, so that a row's outputs are the same bits in the tiles and in the batched path (panel_tile).
inline __m128 accumulate(__m128 acc, __m128i dots, __m128 scale, __m128 offset, float xd, float xo) {
  acc = _mm_fmadd_ps(_mm_mul_ps(_mm_cvtepi32_ps(dots), scale), _mm_set1_ps(xd), acc);
  return _mm_fmadd_ps(offset, _mm_set1_ps(xo), acc);
}

// R rows x C columns, sizes fixed at compile time so that the accumulators stay in registers. The values are
// multiplied as the batched path stores them (Q8_0's up by 128, Q6_K's by 32: the shift is added to the
// integer sums exactly and taken back by the offset).
template <Type t, int R, int C>
void avx2_tile_fixed(const uint8_t* weight, int64_t row_bytes, int64_t n, const QuantizedRows& x, int64_t m0,
                     int64_t K, float* sums) {
  constexpr int64_t values = kBlockValues[t], size = kBlockBytes[t], per_block = values / kSub;
  constexpr int H = kHalves<t>;
  const int64_t subs = K / kSub;
  const __m256i ones = _mm256_set1_epi16(1);
  __m128 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm_setzero_ps();
  const int8_t* xq = x.q.data() + m0 * K;
  for (int64_t blk = 0; blk < K / values; ++blk) {
    const uint8_t* block[C];
    for (int c = 0; c < C; ++c) block[c] = weight + (n + c) * row_bytes + blk * size;
    const char* ahead =
        reinterpret_cast<const char*>(weight + (n + kPrefetchTiles * C) * row_bytes + C * blk * size);
    for (int64_t line = 0; line < C * size; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    for (int j = 0; j < per_block; ++j) {
      const int64_t s = blk * per_block + j;
      SubBlock w[C];
      __m256i wabs[C];
      float lanes[2][H][4] = {};  // (scales, offsets)
      for (int c = 0; c < C; ++c) {
        w[c] = unpack_sub<t>(block[c], j);
        wabs[c] = kSigned[t] ? _mm256_sign_epi8(w[c].q, w[c].q) : w[c].q;
        float sc[H], of[H];
        vector_scales<t>(w[c], sc, of);
        for (int h = 0; h < H; ++h) lanes[0][h][c] = sc[h], lanes[1][h][c] = of[h];
      }
      // (put together in registers. NOTE: written to memory lane by lane and read back as one vector, they stalled
      // each load, which the CPU cannot forward from four stores. One row of 8192 x 1536 on two threads, 2-core AMD
      // EPYC (AVX2), best of three runs interleaved with the old build's, us: Q4_K 1104 -> 550, Q5_K 873 -> 651,
      // Q5_0 693 -> 580, Q4_1 658 -> 446, Q8_0 641 -> 534, Q6_K 924 -> 960; the default model's Q8_0 head
      // (49152 x 576) 1550 -> 1110.)
      __m128 scale[H], offset[H];
      for (int h = 0; h < H; ++h) {
        scale[h] = _mm_setr_ps(lanes[0][h][0], lanes[0][h][1], lanes[0][h][2], lanes[0][h][3]);
        offset[h] = _mm_setr_ps(lanes[1][h][0], lanes[1][h][1], lanes[1][h][2], lanes[1][h][3]);
      }
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + s * kSub));
        __m256i d[C];
        for (int c = 0; c < C; ++c)
          d[c] = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs[c], kSigned[t] ? _mm256_sign_epi8(xv, w[c].q) : xv), ones);
        __m128i low, high;
        column_sums<C>(d, &low, &high);
        const int64_t i = (m0 + r) * subs + s;
        if constexpr (t == Q6_K) {
          low = _mm_add_epi32(low, _mm_set1_epi32(32 * x.half_isum[2 * i]));
          high = _mm_add_epi32(high, _mm_set1_epi32(32 * x.half_isum[2 * i + 1]));
          acc[r] = accumulate(acc[r], low, scale[0], offset[0], x.scale[i], x.half_sum[2 * i]);
          acc[r] = accumulate(acc[r], high, scale[H - 1], offset[H - 1], x.scale[i], x.half_sum[2 * i + 1]);
        } else {
          __m128i total = _mm_add_epi32(low, high);
          if constexpr (t == Q8_0)
            total = _mm_add_epi32(total, _mm_set1_epi32(128 * (x.half_isum[2 * i] + x.half_isum[2 * i + 1])));
          acc[r] = accumulate(acc[r], total, scale[0], offset[0], x.scale[i], x.sum[i]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(16) float lanes[4];
    _mm_store_ps(lanes, acc[r]);
    for (int c = 0; c < C; ++c) sums[r * kColumns + c] = lanes[c];
  }
}

// x in Q4_X2's order: per row and pair of sub-blocks, their first halves then their second halves (the lanes the
// unit's low and high nibbles fill).
void pair_rows(QuantizedRows& x, int64_t M, int64_t K) {
  const int64_t subs = K / kSub;
  x.paired_q.resize(M * K);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t p = 0; p < subs / 2; ++p) {
      const int8_t* src = x.q.data() + r * K + 64 * p;
      int8_t* dst = x.paired_q.data() + r * K + 64 * p;
      for (int half = 0; half < 2; ++half)
        for (int j = 0; j < 2; ++j) std::memcpy(dst + 32 * half + 16 * j, src + 32 * j + 16 * half, 16);
    }
}

// Q4_X2: a unit's 64 nibbles unpacked with three instructions, its two sub-blocks' sums in the low and high
// halves of one register.
template <int R, int C>
void avx2_tile_q4x2(const uint8_t* weight, int64_t row_bytes, int64_t n, const QuantizedRows& x, int64_t m0,
                    int64_t K, float* sums) {
  const int64_t pairs = K / 64, subs = K / kSub;
  const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0f);
  __m128 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m256i lo[C], hi[C];
    // per column [d0, d1, m0, m1], transposed: d0 of each column, d1, m0, m1
    __m128 halves[4] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
    // the weights of the tile kPrefetchTiles ahead, as far into their run of memory as this tile has come
    const char* ahead = reinterpret_cast<const char*>(weight + (n + kPrefetchTiles * C) * row_bytes + C * 40 * p);
    for (int line = 0; line < C * 40; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    for (int c = 0; c < C; ++c) {
      const uint8_t* unit = weight + (n + c) * row_bytes + 40 * p;
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit));
      lo[c] = _mm256_and_si256(bytes, low4);
      hi[c] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
      halves[c] = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(unit + 32)));
    }
    _MM_TRANSPOSE4_PS(halves[0], halves[1], halves[2], halves[3]);
    for (int r = 0; r < R; ++r) {
      const int64_t row = (m0 + r) * K + 64 * p;
      const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.paired_q.data() + row));
      const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.paired_q.data() + row + 32));
      __m256i d[C];
      for (int c = 0; c < C; ++c)
        d[c] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo[c], xa), _mm256_maddubs_epi16(hi[c], xb)),
                                 ones);
      __m128i first, second;
      column_sums<C>(d, &first, &second);
      const int64_t i = (m0 + r) * subs + 2 * p;
      acc[r] = accumulate(acc[r], first, halves[0], halves[2], x.scale[i], x.sum[i]);
      acc[r] = accumulate(acc[r], second, halves[1], halves[3], x.scale[i + 1], x.sum[i + 1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(16) float lanes[4];
    _mm_store_ps(lanes, acc[r]);
    for (int c = 0; c < C; ++c) sums[r * kColumns + c] = lanes[c];
  }
}

template <Type t>
void avx2_tile(const uint8_t* weight, int64_t row_bytes, int64_t n, int64_t columns, const QuantizedRows& x,
               int64_t m0, int64_t rows, int64_t K, float* sums, float*) {
  static_assert(kRowTile == 4 && kColumns == 4, "the table below covers 1-4 rows and tile_columns");
  using Fixed = void (*)(const uint8_t*, int64_t, int64_t, const QuantizedRows&, int64_t, int64_t, float*);
  if constexpr (t == Q4_X2) {
    static constexpr Fixed tiles[kRowTile][kColumns] = {
        {avx2_tile_q4x2<1, 1>, avx2_tile_q4x2<1, 2>, avx2_tile_q4x2<1, 3>, avx2_tile_q4x2<1, 4>},
        {avx2_tile_q4x2<2, 1>, avx2_tile_q4x2<2, 2>, nullptr, nullptr},
        {avx2_tile_q4x2<3, 1>, avx2_tile_q4x2<3, 2>, nullptr, nullptr},
        {avx2_tile_q4x2<4, 1>, avx2_tile_q4x2<4, 2>, nullptr, nullptr}};
    tiles[rows - 1][columns - 1](weight, row_bytes, n, x, m0, K, sums);
  } else {
    static constexpr Fixed tiles[kRowTile][kColumns] = {
        {avx2_tile_fixed<t, 1, 1>, avx2_tile_fixed<t, 1, 2>, avx2_tile_fixed<t, 1, 3>, avx2_tile_fixed<t, 1, 4>},
        {avx2_tile_fixed<t, 2, 1>, avx2_tile_fixed<t, 2, 2>, nullptr, nullptr},
        {avx2_tile_fixed<t, 3, 1>, avx2_tile_fixed<t, 3, 2>, nullptr, nullptr},
        {avx2_tile_fixed<t, 4, 1>, avx2_tile_fixed<t, 4, 2>, nullptr, nullptr}};
    tiles[rows - 1][columns - 1](weight, row_bytes, n, x, m0, K, sums);
  }
}

// The batched path: steps of kGemmRows rows or more. Each thread unpacks a panel of kPanel output columns once
// into its scratch, bytes in the order the integer dot products read them (per sub-block and group of four
// values, the panel's columns side by side, four bytes each), then multiplies every row of the step with it:
// one register of weights serves 16 columns (AVX-512 VNNI: VPDPBUSD) or 8 (AVX2: VPMADDUBSW + VPMADDWD) of a
// tile of rows, x's four bytes broadcast. Unsigned values throughout: Q8_0's bytes move up by 128 and Q6_K's
// by 32, their offsets taking the difference back, so one code path serves every type. (AVX2's VPMADDUBSW
// saturates sums of two products past 32,767: Q8_0's bytes up to 255 do, so Q8_0 keeps the tiles there.)
constexpr int64_t kPanel = 32;     // output columns a panel holds
// the fewest rows the batched path takes (below them the tiles, which unpack the weights again for every four
// rows, measured faster: Zen 4, SmolLM2's layers, 8 rows 11.6 ms batched against 12.8 in tiles with VNNI; with
// AVX2 alone 14.7 against 12.8 at 8 rows, 21.2 against 25 at 16); AMX from 32 rows (below them VPDPBUSD was the
// faster: Xeon with AMX, one Q4_0 layer of 3072 x 576, 24 rows 187 us against 212, 32 rows 229 against 210)
constexpr int64_t kGemmRows = 8, kGemmRowsAvx2 = 16, kGemmRowsAmx = 32;

// The scratch a panel takes, in floats: its bytes, then per sub-block (half) and column a scale and an offset.
inline int64_t panel_floats(int64_t K) { return kPanel * K / 4 + 2 * 2 * (K / kSub) * kPanel; }

// Eight registers of eight 32-bit lanes transposed in place: lane g of register c goes to lane c of register g.
inline void transpose_8x8(__m256i* r) {
  __m256i a[8], b[8];
  for (int i = 0; i < 8; i += 2) {
    a[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    a[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4)
    for (int j = 0; j < 2; ++j) {
      b[i + j] = _mm256_unpacklo_epi64(a[i + j], a[i + j + 2]);
      b[i + j + 2] = _mm256_unpackhi_epi64(a[i + j], a[i + j + 2]);
    }
  // b[0..3]: lanes 0-1 / 4-5 of registers 0-3 (128-bit halves: lanes 0-3, 4-7); b[4..7] the same for 4-7
  const int order[4] = {0, 2, 1, 3};  // (b[0] holds lanes 0 and 4, b[2] lanes 1 and 5, b[1] 2 and 6, b[3] 3 and 7)
  for (int g = 0; g < 4; ++g) {
    r[g] = _mm256_permute2x128_si256(b[order[g]], b[4 + order[g]], 0x20);
    r[g + 4] = _mm256_permute2x128_si256(b[order[g]], b[4 + order[g]], 0x31);
  }
}

// Columns [n, n + kPanel) unpacked into scratch (those past N repeat column N - 1): per sub-block, eight rows of
// four values, each the panel's columns side by side (eight columns' sub-blocks transposed in registers at once).
// NOTE: one four-byte copy per group instead took 40% of a step of 16 rows (perf, Q8_0 blocks, Xeon with AMX):
// SmolLM2's 210 layers at 16 rows went from 21.5-23.6 to 14.8-16.7 ms (Q4_X2) and 23.3-23.9 to 19.6-20.8 (Q8_0).
template <Type t>
void unpack_panel(const uint8_t* weight, int64_t row_bytes, int64_t n, int64_t N, int64_t K, float* scratch) {
  constexpr int64_t values = kBlockValues[t], size = kBlockBytes[t], per_block = values / kSub;
  constexpr int H = kHalves<t>;
  const int64_t subs = K / kSub;
  uint8_t* q = reinterpret_cast<uint8_t*>(scratch);
  float* scale = scratch + kPanel * K / 4;
  float* offset = scale + H * subs * kPanel;
  const uint8_t* rows[kPanel];
  for (int64_t c = 0; c < kPanel; ++c) rows[c] = weight + std::min(n + c, N - 1) * row_bytes;
  for (int64_t blk = 0; blk < K / values; ++blk)
    for (int j = 0; j < per_block; ++j) {
      const int64_t s = blk * per_block + j;
      for (int64_t c0 = 0; c0 < kPanel; c0 += 8) {
        __m256i v[8];
        for (int c = 0; c < 8; ++c) {
          const SubBlock sub = unpack_sub<t>(rows[c0 + c] + blk * size, j);
          v[c] = sub.q;
          if constexpr (t == Q8_0) v[c] = _mm256_xor_si256(v[c], _mm256_set1_epi8(char(0x80)));  // w + 128
          if constexpr (t == Q6_K) v[c] = _mm256_add_epi8(v[c], _mm256_set1_epi8(32));           // 0-63
          float sc[H], of[H];
          vector_scales<t>(sub, sc, of);
          for (int h = 0; h < H; ++h)
            scale[(H * s + h) * kPanel + c0 + c] = sc[h], offset[(H * s + h) * kPanel + c0 + c] = of[h];
        }
        transpose_8x8(v);
        for (int g = 0; g < 8; ++g)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + ((s * 8 + g) * kPanel + c0) * 4), v[g]);
      }
    }
}

// The vector operations of the batched path: L columns a register, tiles of R rows x C registers.
struct Avx2Lanes {
  static constexpr int L = 8, R = 4, C = 1;
  using I = __m256i;
  using F = __m256;
  static I izero() { return _mm256_setzero_si256(); }
  static F fzero() { return _mm256_setzero_ps(); }
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I broadcast(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }
  static I dot(I acc, I w, I x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
  }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static void storef(float* p, F v) { _mm256_storeu_ps(p, v); }
};

#ifdef CONVEYOR_AVX512_VNNI
struct VnniLanes {
  static constexpr int L = 16, R = 6, C = 2;
  using I = __m512i;
  using F = __m512;
  static I izero() { return _mm512_setzero_si512(); }
  static F fzero() { return _mm512_setzero_ps(); }
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I broadcast(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  static I dot(I acc, I w, I x) { return _mm512_dpbusd_epi32(acc, w, x); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static void storef(float* p, F v) { _mm512_storeu_ps(p, v); }
};
#endif

// Rows [m0, m0 + R) x the panel's columns [col0, col0 + L * C) into sums[r * kPanel + column].
template <Type t, typename V, int R>
void panel_tile(const float* scratch, int64_t col0, int64_t K, const QuantizedRows& x, int64_t m0, float* sums) {
  constexpr int C = V::C, L = V::L, H = kHalves<t>;
  const int64_t subs = K / kSub;
  const uint8_t* q = reinterpret_cast<const uint8_t*>(scratch) + col0 * 4;
  const float* scale = scratch + kPanel * K / 4 + col0;
  const float* offset = scale + H * subs * kPanel;
  const int8_t* xq = x.q.data() + m0 * K;
  typename V::F acc[R][C];
  typename V::I dots[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = V::fzero(), dots[r][c] = V::izero();
  for (int64_t s = 0; s < subs; ++s)
    for (int h = 0; h < H; ++h) {
      for (int g = 8 / H * h; g < 8 / H * (h + 1); ++g) {
        typename V::I w[C];
        for (int c = 0; c < C; ++c) w[c] = V::load(q + ((s * 8 + g) * kPanel + c * L) * 4);
        for (int r = 0; r < R; ++r) {
          const typename V::I xv = V::broadcast(xq + r * K + s * kSub + 4 * g);
          for (int c = 0; c < C; ++c) dots[r][c] = V::dot(dots[r][c], w[c], xv);
        }
      }
      typename V::F ws[C], wo[C];
      for (int c = 0; c < C; ++c)
        ws[c] = V::loadf(scale + (s * H + h) * kPanel + c * L), wo[c] = V::loadf(offset + (s * H + h) * kPanel + c * L);
      for (int r = 0; r < R; ++r) {
        const int64_t i = (m0 + r) * subs + s;
        const typename V::F xd = V::set1(x.scale[i]), xo = V::set1(H == 1 ? x.sum[i] : x.half_sum[2 * i + h]);
        for (int c = 0; c < C; ++c) {
          acc[r][c] = V::fma(V::mul(V::cvt(dots[r][c]), ws[c]), xd, acc[r][c]);
          acc[r][c] = V::fma(wo[c], xo, acc[r][c]);
          dots[r][c] = V::izero();
        }
      }
    }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) V::storef(sums + r * kPanel + col0 + c * L, acc[r][c]);
}

// sums[r * kPanel + c] of a panel's columns [n, n + kPanel), rows out[r * N ...]: those below N, bias added.
template <typename T>
void store_panel(const float* sums, int64_t rows, int64_t n, int64_t N, const T* bias, T* out) {
  const int64_t columns = std::min(kPanel, N - n);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < columns; ++c)
      store(out + r * N + n + c, sums[r * kPanel + c] + (bias ? to_float(bias[n + c]) : 0.0f));
}

// Every row of x times columns [n, n + kPanel) (those below N stored, bias added).
template <typename T, Type t, typename V>
void panel_columns(const uint8_t* weight, int64_t row_bytes, int64_t n, int64_t N, int64_t K, const QuantizedRows& x,
                   int64_t M, const T* bias, T* out, float* scratch) {
  using Tile = void (*)(const float*, int64_t, int64_t, const QuantizedRows&, int64_t, float*);
  static_assert(V::R <= 6, "the table below covers tiles of up to six rows");
  static constexpr Tile tiles[6] = {panel_tile<t, V, 1>, panel_tile<t, V, std::min(2, V::R)>,
                                    panel_tile<t, V, std::min(3, V::R)>, panel_tile<t, V, std::min(4, V::R)>,
                                    panel_tile<t, V, std::min(5, V::R)>, panel_tile<t, V, std::min(6, V::R)>};
  unpack_panel<t>(weight, row_bytes, n, N, K, scratch);
  float sums[V::R * kPanel];
  for (int64_t m0 = 0; m0 < M; m0 += V::R) {
    const int64_t rows = std::min<int64_t>(V::R, M - m0);
    for (int64_t col0 = 0; col0 < kPanel; col0 += V::L * V::C) tiles[rows - 1](scratch, col0, K, x, m0, sums);
    store_panel(sums, rows, n, N, bias, out + m0 * N);
  }
}

template <typename T, typename V>
using PanelColumns = void (*)(const uint8_t*, int64_t, int64_t, int64_t, int64_t, const QuantizedRows&, int64_t,
                              const T*, T*, float*);

template <typename T, typename V>
PanelColumns<T, V> pick_panel(Type t) {
  static constexpr PanelColumns<T, V> table[kNumTypes] = {
      panel_columns<T, Q4_0, V>, panel_columns<T, Q4_1, V>, panel_columns<T, Q5_0, V>,
      panel_columns<T, Q5_1, V>, panel_columns<T, Q8_0, V>, panel_columns<T, Q4_K, V>,
      panel_columns<T, Q5_K, V>, panel_columns<T, Q6_K, V>, panel_columns<T, Q4_X2, V>};
  return table[t];
}

template <typename T, typename V>
void run_panels(const uint8_t* weight, Type t, int64_t M, int64_t N, int64_t K, const QuantizedRows& x, const T* bias,
                T* out) {
  const int64_t row_bytes = K / kBlockValues[t] * kBlockBytes[t];
  const PanelColumns<T, V> columns = pick_panel<T, V>(t);
  run_work_queue((N + kPanel - 1) / kPanel, panel_floats(K), [&](int64_t panel, float* scratch) {
    columns(weight, row_bytes, panel * kPanel, N, K, x, M, bias, out, scratch);
  });
}

#ifdef CONVEYOR_AMX_INT8
// The batched path with AMX: the same panel, its bytes already in the layout of a TDPBSUD B tile (per sub-block
// eight rows of four values, 16 columns a tile), and x's bytes as A tiles of 16 rows (x padded with zero rows to
// a multiple of 16). One TDPBSUD gives a sub-block's integer sums for 16 rows x 16 columns (VPDPBUSD: one row x
// 16 columns a group of four values); then the sub-block's scales are applied in the same order as panel_tile
// applies them, so a row's outputs are the same bits on every path. Types of one scale a sub-block (all but
// Q6_K). The products of the next sub-block run while the scales of this one are applied: tiles 0, 2, 3 (x, the
// panel, the sums) for even sub-blocks and 1, 4, 5 for odd ones (a tile's number is part of the instruction).
void amx_configure() {
  TileConfig config;
  config.rows[0] = config.rows[1] = 16;
  config.colsb[0] = config.colsb[1] = kSub;
  config.rows[2] = config.rows[4] = kSub / 4;
  config.colsb[2] = config.colsb[4] = 64;
  config.rows[3] = config.rows[5] = 16;
  config.colsb[3] = config.colsb[5] = 64;
  load_tile_config(config);
}

#define CONVEYOR_AMX_PRODUCT(xt, wt, st, xp, wp, stride)  \
  do {                                                    \
    _tile_loadd(xt, xp, stride);                          \
    _tile_loadd(wt, wp, kPanel * 4);                      \
    _tile_zero(st);                                       \
    _tile_dpbsud(st, xt, wt);                             \
  } while (0)

// Sub-block s's integer sums (dots[16 r + column]) times its scales, added to acc[r].
inline void amx_scale(const int32_t* dots, const float* scale, const float* offset, const QuantizedRows& x,
                      int64_t m0, int64_t subs, int64_t s, __m512* acc) {
  const __m512 ws = _mm512_loadu_ps(scale + s * kPanel), wo = _mm512_loadu_ps(offset + s * kPanel);
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    const int64_t i = (m0 + r) * subs + s;
    const __m512 d = _mm512_cvtepi32_ps(_mm512_load_si512(dots + 16 * r));
    acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, ws), _mm512_set1_ps(x.scale[i]), acc[r]);
    acc[r] = _mm512_fmadd_ps(wo, _mm512_set1_ps(x.sum[i]), acc[r]);
  }
}

// Rows [m0, m0 + 16) x the panel's columns [col0, col0 + 16) into sums[r * kPanel + column].
void amx_tile(const float* scratch, int64_t col0, int64_t K, const QuantizedRows& x, int64_t m0, float* sums) {
  const int64_t subs = K / kSub;
  const uint8_t* q = reinterpret_cast<const uint8_t*>(scratch) + col0 * 4;
  const float* scale = scratch + kPanel * K / 4 + col0;
  const float* offset = scale + subs * kPanel;
  const int8_t* xq = x.q.data() + m0 * K;
  alignas(64) int32_t even[16 * 16], odd[16 * 16];
  __m512 acc[16];
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t step = 8 * kPanel * 4;  // a sub-block's bytes in the panel
  CONVEYOR_AMX_PRODUCT(0, 2, 3, xq, q, K);
  for (int64_t s = 0; s < subs; s += 2) {
    if (s + 1 < subs) CONVEYOR_AMX_PRODUCT(1, 4, 5, xq + (s + 1) * kSub, q + (s + 1) * step, K);
    _tile_stored(3, even, 64);
    if (s + 2 < subs) CONVEYOR_AMX_PRODUCT(0, 2, 3, xq + (s + 2) * kSub, q + (s + 2) * step, K);
    amx_scale(even, scale, offset, x, m0, subs, s, acc);
    if (s + 1 < subs) {
      _tile_stored(5, odd, 64);
      amx_scale(odd, scale, offset, x, m0, subs, s + 1, acc);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) _mm512_storeu_ps(sums + r * kPanel + col0, acc[r]);
}

template <typename T, Type t>
void amx_panel_columns(const uint8_t* weight, int64_t row_bytes, int64_t n, int64_t N, int64_t K,
                       const QuantizedRows& x, int64_t M, const T* bias, T* out, float* scratch) {
  static_assert(kHalves<t> == 1, "one scale a sub-block");
  unpack_panel<t>(weight, row_bytes, n, N, K, scratch);
  amx_configure();
  alignas(64) float sums[16 * kPanel];
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    for (int64_t col0 = 0; col0 < kPanel; col0 += 16) amx_tile(scratch, col0, K, x, m0, sums);
    store_panel(sums, std::min<int64_t>(16, M - m0), n, N, bias, out + m0 * N);
  }
  _tile_release();
}

// Whether type t takes the AMX path (one scale a sub-block).
constexpr bool amx_type(Type t) { return t != Q6_K; }

template <typename T>
void run_amx_panels(const uint8_t* weight, Type t, int64_t M, int64_t N, int64_t K, QuantizedRows& x,
                    const T* bias, T* out) {
  const int64_t padded = (M + 15) / 16 * 16, subs = K / kSub;  // (zero rows: whole tiles of x)
  x.q.resize(padded * K, 0);
  x.scale.resize(padded * subs, 0.0f);
  x.sum.resize(padded * subs, 0.0f);
  using Columns = void (*)(const uint8_t*, int64_t, int64_t, int64_t, int64_t, const QuantizedRows&, int64_t,
                           const T*, T*, float*);
  static constexpr Columns table[kNumTypes] = {
      amx_panel_columns<T, Q4_0>, amx_panel_columns<T, Q4_1>, amx_panel_columns<T, Q5_0>,
      amx_panel_columns<T, Q5_1>, amx_panel_columns<T, Q8_0>, amx_panel_columns<T, Q4_K>,
      amx_panel_columns<T, Q5_K>, nullptr, amx_panel_columns<T, Q4_X2>};
  const int64_t row_bytes = K / kBlockValues[t] * kBlockBytes[t];
  run_work_queue((N + kPanel - 1) / kPanel, panel_floats(K), [&](int64_t panel, float* scratch) {
    table[t](weight, row_bytes, panel * kPanel, N, K, x, M, bias, out, scratch);
  });
}
#endif
#endif

Tile pick_tile(Type t, bool vector) {
  static constexpr Tile scalar[kNumTypes] = {scalar_tile<Q4_0>, scalar_tile<Q4_1>, scalar_tile<Q5_0>,
                                             scalar_tile<Q5_1>, scalar_tile<Q8_0>, scalar_tile<Q4_K>,
                                             scalar_tile<Q5_K>, scalar_tile<Q6_K>, scalar_tile<Q4_X2>};
#ifdef CONVEYOR_AVX2
  static constexpr Tile avx2[kNumTypes] = {avx2_tile<Q4_0>, avx2_tile<Q4_1>, avx2_tile<Q5_0>, avx2_tile<Q5_1>,
                                           avx2_tile<Q8_0>, avx2_tile<Q4_K>, avx2_tile<Q5_K>, avx2_tile<Q6_K>,
                                           avx2_tile<Q4_X2>};
  if (vector) return avx2[t];
#endif
  return scalar[t];
}

// The kernel paths, fastest last: each includes the ones before it.
enum Path { kScalar, kAvx2, kVnni, kAmx };

template <typename T>
void run(const T* x, const uint8_t* weight, Type t, int64_t M, int64_t N, int64_t K, const T* bias, T* out,
         Path path) {
  QuantizedRows xq;
  quantize_rows(x, M, K, xq);
#ifdef CONVEYOR_AVX2
#ifdef CONVEYOR_AMX_INT8
  if (M >= kGemmRowsAmx && path == kAmx && amx_type(t)) return run_amx_panels<T>(weight, t, M, N, K, xq, bias, out);
#endif
#ifdef CONVEYOR_AVX512_VNNI
  if (M >= kGemmRows && path >= kVnni) return run_panels<T, VnniLanes>(weight, t, M, N, K, xq, bias, out);
#endif
  if (M >= kGemmRowsAvx2 && path == kAvx2 && t != Q8_0)
    return run_panels<T, Avx2Lanes>(weight, t, M, N, K, xq, bias, out);
  if (t == Q4_X2 && path >= kAvx2) pair_rows(xq, M, K);
#endif
  const bool vector = path >= kAvx2;
  const int64_t row_bytes = K / kBlockValues[t] * kBlockBytes[t], subs = K / kSub;
  const Tile tile = pick_tile(t, vector);
  // the scalar path's scratch: one unpacked row (bytes, then 8 scales and an offset per sub-block)
  const int64_t scratch_floats = vector ? 0 : K / 4 + subs * 9;
  // About eight chunks a thread: enough to even out a slow thread, long enough runs of memory for the
  // hardware's prefetcher (16-column chunks of SmolLM2's 49,152-row head read 2.6 ms with one thread and 2.2
  // with two; whole eighths, 1.4). Each row tile walks its chunk's weights again, so with more rows than one
  // tile a chunk is also kept small enough (128 KB) to stay in the core's cache from one tile to the next.
  int64_t chunk_columns = (N / (8 * num_threads()) + 3) / 4 * 4;
  if (M > kRowTile) chunk_columns = std::min(chunk_columns, (int64_t(128) << 10) / row_bytes / 4 * 4);
  chunk_columns = std::max(kMinChunk, chunk_columns);
  const int64_t chunks = (N + chunk_columns - 1) / chunk_columns;
  auto visit = [&](int64_t chunk, float* scratch) {
    float sums[kRowTile * kColumns];
    const int64_t n_end = std::min(N, (chunk + 1) * chunk_columns);
    for (int64_t m0 = 0; m0 < M; m0 += kRowTile) {
      const int64_t rows = std::min<int64_t>(kRowTile, M - m0);
      for (int64_t n = chunk * chunk_columns; n < n_end; n += tile_columns(rows)) {
        const int64_t columns = std::min<int64_t>(tile_columns(rows), n_end - n);
        tile(weight, row_bytes, n, columns, xq, m0, rows, K, sums, scratch);
        for (int r = 0; r < rows; ++r)
          for (int c = 0; c < columns; ++c) {
            const float b = bias ? to_float(bias[n + c]) : 0.0f;
            store(out + (m0 + r) * N + n + c, sums[r * kColumns + c] + b);
          }
      }
    }
  };
  // a step of a few rows streams the weights once: a small layer is one thread's work (common.h, kSoloBytes)
  run_work_queue(chunks, scratch_floats, visit, M <= kRowTile ? N * row_bytes : -1);
}

// The fastest path built here: "amx", "avx512_vnni", "avx2" or "scalar".
std::string ggml_linear_path() {
#if defined(CONVEYOR_AMX_INT8) && defined(CONVEYOR_AVX2)
  if (amx_permitted()) return "amx";
#endif
#if defined(CONVEYOR_AVX512_VNNI) && defined(CONVEYOR_AVX2)
  return "avx512_vnni";
#elif defined(CONVEYOR_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

void ggml_linear(const at::Tensor& x, const at::Tensor& weight, int64_t type, const c10::optional<at::Tensor>& bias,
                 at::Tensor& out, const std::string& path) {
  TORCH_CHECK(type >= 0 && type < kNumTypes, "ggml_linear: unknown type ", type);
  const Type t = static_cast<Type>(type);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "ggml_linear: x must be a contiguous [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(K % kBlockValues[t] == 0, "ggml_linear: K = ", K, " is not a multiple of the type's ",
              kBlockValues[t], " values a block");
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.is_contiguous() &&
                  weight.size(1) == K / kBlockValues[t] * kBlockBytes[t],
              "ggml_linear: weight must be a contiguous uint8 [N, ", K / kBlockValues[t] * kBlockBytes[t], "]");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.dim() == 2 && out.size(0) == M && out.size(1) == N &&
                  out.is_contiguous(), "ggml_linear: out must be a contiguous [", M, ", ", N, "] of x's dtype");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->numel() == N && bias->is_contiguous(),
                "ggml_linear: bias must be a contiguous [", N, "] of x's dtype");
  const std::string best = ggml_linear_path();
  const std::vector<std::string> names = {"scalar", "avx2", "avx512_vnni", "amx"};
  const int64_t chosen = std::find(names.begin(), names.end(), path) - names.begin();
  TORCH_CHECK(chosen <= std::find(names.begin(), names.end(), best) - names.begin(), "ggml_linear: path ", path,
              " is not built here; built: scalar up to ", best);
  const uint8_t* w = weight.data_ptr<uint8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "ggml_linear", [&] {
    const scalar_t* b = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
    run<scalar_t>(x.data_ptr<scalar_t>(), w, t, M, N, K, b, out.data_ptr<scalar_t>(), static_cast<Path>(chosen));
  });
}

}  // namespace

void ggml_linear_into(const at::Tensor& x, const at::Tensor& weight, int64_t type, at::Tensor& out) {
  ggml_linear(x, weight, type, c10::nullopt, out, ggml_linear_path());
}

}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("ggml_linear_path() -> str", &conveyor::ggml_linear_path);
  m.def("ggml_linear(Tensor x, Tensor weight, int type, Tensor? bias, Tensor(a!) out, str path) -> ()");
}

TORCH_LIBRARY_IMPL(conveyor_cpu, CPU, m) { m.impl("ggml_linear", &conveyor::ggml_linear); }
