// Paged decode attention for CPUs: one new query token per sequence, attending
// over that sequence's keys and values where they lie, block by block.
//
// The torch path gathers every sequence's blocks into a padded copy before
// multiplying; this kernel reads each key and value row once, in place, and
// keeps scores and sums in float32. Work items are (sequence, KV head) pairs,
// longest context first, pulled by the threads of ATen's pool. With AVX-512
// BF16 and a bf16 cache (head_dim 64 or 128), the dot products run in
// VDPBF16PS; otherwise in loops the compiler vectorizes.
//
// Layouts (one layer): k_cache, v_cache [kv_heads, slots, head_dim], slot =
// block * block_size + offset; an fp8 cache stores e4m3 bits as uint8 with a
// bfloat16 scale per slot and head in k_scale, v_scale [kv_heads, slots].

#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "common.h"
#include "kernels.h"

namespace {

using conveyor::bf16_to_float;

// e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; S.1111.111 is NaN, no infinities.
struct E4M3Table {
  float values[256];
  E4M3Table() {
    for (int bits = 0; bits < 256; ++bits) {
      int exponent = (bits >> 3) & 0xF, mantissa = bits & 0x7;
      float magnitude = exponent == 0 ? std::ldexp(mantissa / 8.0f, -6) : std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
      if (exponent == 0xF && mantissa == 0x7) magnitude = std::numeric_limits<float>::quiet_NaN();
      values[bits] = (bits & 0x80) ? -magnitude : magnitude;
    }
  }
};
const E4M3Table kE4M3;

// Calls visit(position, slot) for positions [first, len) of a sequence, through its block table.
template <typename F>
inline void for_each_slot(const int32_t* table, int64_t first, int64_t len, int64_t block_size, F&& visit) {
  for (int64_t pos = first; pos < len;) {
    const int64_t offset = pos % block_size;
    const int64_t first_slot = int64_t(table[pos / block_size]) * block_size + offset;
    const int64_t n = std::min(block_size - offset, len - pos);
    for (int64_t j = 0; j < n; ++j) visit(pos + j, first_slot + j);
    pos += n;
  }
}

// The first key a query at position len - 1 sees: all of them, or the last `window` (a sliding window).
inline int64_t first_key(int64_t len, int64_t window) { return window > 0 ? std::max<int64_t>(0, len - window) : 0; }

// scores [rows, stride], positions [first, len) of each row -> exp(score - row max) in place (soft-capped
// first where softcap > 0); sums[r] = the row's total.
inline void softmax_numerators(float* scores, int64_t rows, int64_t stride, int64_t first, int64_t len,
                               float softcap, float* sums) {
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * stride;
    if (softcap > 0.0f) {
      for (int64_t t = first; t < len; ++t) s[t] = softcap * std::tanh(s[t] / softcap);
    }
    float top = std::numeric_limits<float>::lowest();
    for (int64_t t = first; t < len; ++t) top = std::max(top, s[t]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = first; t < len; ++t) {
      s[t] = std::exp(s[t] - top);
      sum += s[t];
    }
    sums[r] = sum;
  }
}

// One stored row of head_dim values as float32.
template <typename T>
inline void load_row(const T* src, float* dst, int64_t n);

template <>
inline void load_row<float>(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] = bf16_to_float(bits[d]);
}

template <>
inline void load_row<c10::Half>(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

template <>
inline void load_row<uint8_t>(const uint8_t* src, float* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = kE4M3.values[src[d]];
}


#ifdef CONVEYOR_AVX512_BF16
// bfloat16 cache and queries, head_dim a multiple of 32: dot products in
// dpbf16 (exact bf16 products, float32 sums), values accumulated in float32
// registers for up to kGroup query heads at a time.
template <int kHeadDim, int kGroup>
inline void accumulate_values(const uint16_t* v_head, const int32_t* table, int64_t first, int64_t len,
                              int64_t block_size, const float* probs, int64_t stride, float* out) {
  constexpr int kVectors = kHeadDim / 16;
  __m512 acc[kGroup][kVectors];
  for (int g = 0; g < kGroup; ++g)
    for (int i = 0; i < kVectors; ++i) acc[g][i] = _mm512_setzero_ps();
  for_each_slot(table, first, len, block_size, [&](int64_t t, int64_t slot) {
    const uint16_t* row = v_head + slot * kHeadDim;
    __m512 p[kGroup];
    for (int g = 0; g < kGroup; ++g) p[g] = _mm512_set1_ps(probs[g * stride + t]);
    for (int i = 0; i < kVectors; ++i) {
      const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + i * 16));
      const __m512 value = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
      for (int g = 0; g < kGroup; ++g) acc[g][i] = _mm512_fmadd_ps(p[g], value, acc[g][i]);
    }
  });
  for (int g = 0; g < kGroup; ++g)
    for (int i = 0; i < kVectors; ++i) _mm512_storeu_ps(out + g * kHeadDim + i * 16, acc[g][i]);
}

// Every 64-byte line of [p, p + bytes) on its way into the cache level hint names.
inline void prefetch_rows(const uint16_t* p, int64_t bytes, int hint) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t offset = 0; offset < bytes; offset += 64) {
    if (hint == _MM_HINT_T0) _mm_prefetch(c + offset, _MM_HINT_T0);
    else _mm_prefetch(c + offset, _MM_HINT_T1);
  }
}

// One vector whose lane j is the sum of v[j]'s lanes: a transpose by shuffles, 15 adds for 16 sums
// (16 separate horizontal sums cost about three times the instructions).
inline __m512 sum_lanes16(const __m512 v[16]) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: (a0+a2, b0+b2, a1+a3, b1+b3)
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's sums of four vectors
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)  // 128-bit lanes (0, 1) and (2, 3) of each added
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                       _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}

template <int kHeadDim>
void attend_bf16(const uint16_t* q_rows, int64_t group, const uint16_t* k_head, const uint16_t* v_head,
                 const int32_t* table, int64_t first, int64_t len, int64_t block_size, float scale, float softcap,
                 float* scores, float* out) {
  constexpr int kVectors = kHeadDim / 32;
  const __m512 scale_v = _mm512_set1_ps(scale);
  // scores[g, t] = q_g . k_t * scale: 16 keys at a time where a block holds them back to back (from the start
  // of first's block; the softmax skips positions before first)
  for (int64_t start = first - first % block_size; start < len; start += block_size) {
    const int64_t first_slot = int64_t(table[start / block_size]) * block_size;
    const int64_t n = std::min(block_size, len - start);
    // Blocks lie anywhere in the cache, too short for the hardware prefetcher to get going: ask for the
    // next block's keys (to L1) and this block's values (to L2, read after the softmax) ahead of use.
    if (start + block_size < len) {
      const int64_t next_slot = int64_t(table[start / block_size + 1]) * block_size;
      const int64_t next_n = std::min(block_size, len - start - block_size);
      prefetch_rows(k_head + next_slot * kHeadDim, next_n * kHeadDim * 2, _MM_HINT_T0);
    }
    prefetch_rows(v_head + first_slot * kHeadDim, n * kHeadDim * 2, _MM_HINT_T1);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      const uint16_t* keys = k_head + (first_slot + j) * kHeadDim;
      for (int64_t g = 0; g < group; ++g) {
        __m512bh query[kVectors];
        for (int i = 0; i < kVectors; ++i) query[i] = (__m512bh)_mm512_loadu_si512(q_rows + g * kHeadDim + i * 32);
        __m512 acc[16];
        for (int r = 0; r < 16; ++r) {
          acc[r] = _mm512_setzero_ps();
          for (int i = 0; i < kVectors; ++i)
            acc[r] = _mm512_dpbf16_ps(acc[r], query[i], (__m512bh)_mm512_loadu_si512(keys + r * kHeadDim + i * 32));
        }
        _mm512_storeu_ps(scores + g * len + start + j, _mm512_mul_ps(sum_lanes16(acc), scale_v));
      }
    }
    for (; j < n; ++j) {
      const uint16_t* key_row = k_head + (first_slot + j) * kHeadDim;
      __m512bh key[kVectors];
      for (int i = 0; i < kVectors; ++i) key[i] = (__m512bh)_mm512_loadu_si512(key_row + i * 32);
      for (int64_t g = 0; g < group; ++g) {
        __m512 acc = _mm512_setzero_ps();
        for (int i = 0; i < kVectors; ++i)
          acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q_rows + g * kHeadDim + i * 32), key[i]);
        scores[g * len + start + j] = _mm512_reduce_add_ps(acc) * scale;
      }
    }
  }
  // softmax numerators; the sums divide at the end
  float sums[64];
  softmax_numerators(scores, group, len, first, len, softcap, sums);
  constexpr int kChunk = kHeadDim == 64 ? 4 : 2;  // 16 accumulator registers
  for (int64_t g = 0; g < group; g += kChunk) {
    const float* probs = scores + g * len;
    float* dst = out + g * kHeadDim;
    switch (std::min<int64_t>(kChunk, group - g)) {
      case 1: accumulate_values<kHeadDim, 1>(v_head, table, first, len, block_size, probs, len, dst); break;
      case 2: accumulate_values<kHeadDim, 2>(v_head, table, first, len, block_size, probs, len, dst); break;
      case 3: accumulate_values<kHeadDim, 3>(v_head, table, first, len, block_size, probs, len, dst); break;
      default: accumulate_values<kHeadDim, 4>(v_head, table, first, len, block_size, probs, len, dst); break;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = 1.0f / sums[g];
    for (int64_t d = 0; d < kHeadDim; ++d) out[g * kHeadDim + d] *= inv;
  }
}
#endif

// Runs visit(b, h, scratch) for every (sequence b, kv head h), longest context first, on ATen's
// threads (one alone where the batch's keys and values are few: key_bytes is what one key of one head holds,
// K and V); each thread has its own scratch of scratch_floats floats.
template <typename Visit>
void for_each_item(const int32_t* lens, int64_t batch, int64_t num_kv_heads, int64_t key_bytes,
                   int64_t scratch_floats, Visit&& visit) {
  std::vector<int64_t> order(batch);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return lens[a] > lens[b]; });
  const int64_t keys = std::accumulate(lens, lens + batch, int64_t(0));
  conveyor::run_work_queue(
      batch * num_kv_heads, scratch_floats,
      [&](int64_t item, float* scratch) { visit(order[item / num_kv_heads], item % num_kv_heads, scratch); },
      keys * num_kv_heads * key_bytes);
}

int32_t max_context(const int32_t* lens, int64_t batch) {
  int32_t longest = 1;
  for (int64_t b = 0; b < batch; ++b) longest = std::max(longest, lens[b]);
  return longest;
}

#ifdef CONVEYOR_AVX512_BF16
// bf16 queries (read through their strides) and cache; the result is written straight into out as bf16.
template <int kHeadDim>
void decode_bf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
                 double softmax_scale, int64_t window, double softcap, at::Tensor& out) {
  const int64_t batch = q.size(0), num_heads = q.size(1), num_kv_heads = k_cache.size(0);
  const int64_t num_slots = k_cache.size(1), group = num_heads / num_kv_heads, width = block_tables.size(1);
  const uint16_t* q_ptr = reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>());
  c10::BFloat16* out_ptr = out.data_ptr<c10::BFloat16>();
  const uint16_t* k_ptr = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<c10::BFloat16>());
  const uint16_t* v_ptr = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<c10::BFloat16>());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int64_t q_stride = q.stride(0), out_stride = out.stride(0);
  const int64_t scores_floats = conveyor::whole_lines(group * max_context(lens, batch));
  for_each_item(lens, batch, num_kv_heads, 2 * kHeadDim * 2, scores_floats + group * kHeadDim,
                [&](int64_t b, int64_t h, float* scratch) {
    float* result = scratch + scores_floats;
    attend_bf16<kHeadDim>(q_ptr + b * q_stride + h * group * kHeadDim, group, k_ptr + h * num_slots * kHeadDim,
                          v_ptr + h * num_slots * kHeadDim, tables + b * width, first_key(lens[b], window), lens[b],
                          block_size, static_cast<float>(softmax_scale), static_cast<float>(softcap), scratch, result);
    c10::BFloat16* dst = out_ptr + b * out_stride + h * group * kHeadDim;
    for (int64_t i = 0; i < group * kHeadDim; ++i) dst[i] = c10::BFloat16(result[i]);
  });
}
#endif

// Query and result rows in the model's dtype, read and written through their strides (heads of a token back to
// back), converted to and from float32 as each item takes them: no buffer is shared between items but out.
template <typename Q>
struct HeadRows {
  static void load(const at::Tensor& t, int64_t b, int64_t head, int64_t n, float* dst) {
    load_row<Q>(t.data_ptr<Q>() + b * t.stride(0) + head * t.stride(1), dst, n);
  }
  static void store(at::Tensor& t, int64_t b, int64_t head, int64_t n, const float* src) {
    Q* dst = t.data_ptr<Q>() + b * t.stride(0) + head * t.stride(1);
    for (int64_t i = 0; i < n; ++i) dst[i] = Q(src[i]);  // (rounded to nearest even, as a copy_ rounds)
  }
};

// Any cache dtype (fp8 with its scales) and head size: float32 queries and results, converted at the ends.
template <typename T, int kHeadDim, typename Q>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
            const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size, double softmax_scale,
            int64_t window, double softcap, at::Tensor& out) {
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = kHeadDim ? kHeadDim : q.size(2);
  const int64_t num_kv_heads = k_cache.size(0), num_slots = k_cache.size(1);
  const int64_t group = num_heads / num_kv_heads, table_width = block_tables.size(1);
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  const bool scaled = k_scale.has_value();
  const c10::BFloat16* ks_ptr = scaled ? k_scale->data_ptr<c10::BFloat16>() : nullptr;
  const c10::BFloat16* vs_ptr = scaled ? v_scale->data_ptr<c10::BFloat16>() : nullptr;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const float scale = static_cast<float>(softmax_scale);
  // scratch: scores [group, len], then acc [group, D], row [D], scaled q [group, D], sums [group], a result row [D]
  const int64_t scores_floats = conveyor::whole_lines(group * max_context(lens, batch));
  const int64_t scratch_floats = scores_floats + 2 * group * head_dim + head_dim + group + head_dim;

  for_each_item(lens, batch, num_kv_heads, 2 * head_dim * int64_t(sizeof(T)), scratch_floats,
                [&](int64_t b, int64_t h, float* scratch) {
    float* scores = scratch;
    float* acc = scores + scores_floats;
    float* row = acc + group * head_dim;
    float* qs = row + head_dim;
    float* sums = qs + group * head_dim;
    float* result = sums + group;
    const int64_t len = lens[b], first = first_key(len, window);
    const int32_t* table = tables + b * table_width;
    for (int64_t g = 0; g < group; ++g) HeadRows<Q>::load(q, b, h * group + g, head_dim, qs + g * head_dim);
    for (int64_t i = 0; i < group * head_dim; ++i) qs[i] *= scale;
    const T* k_head = k_ptr + h * num_slots * head_dim;
    const T* v_head = v_ptr + h * num_slots * head_dim;
    const int64_t scale_offset = h * num_slots;
    // scores[g, t] = q_g . k_t (scaled)
    for_each_slot(table, first, len, block_size, [&](int64_t t, int64_t slot) {
      load_row<T>(k_head + slot * head_dim, row, head_dim);
      const float row_scale = scaled ? static_cast<float>(ks_ptr[scale_offset + slot]) : 1.0f;
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = qs + g * head_dim;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * row[d];
        scores[g * len + t] = dot * row_scale;
      }
    });
    softmax_numerators(scores, group, len, first, len, static_cast<float>(softcap), sums);
    // acc[g] = sum_t p[g, t] v_t
    std::fill(acc, acc + group * head_dim, 0.0f);
    for_each_slot(table, first, len, block_size, [&](int64_t t, int64_t slot) {
      load_row<T>(v_head + slot * head_dim, row, head_dim);
      const float row_scale = scaled ? static_cast<float>(vs_ptr[scale_offset + slot]) : 1.0f;
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[g * len + t] * row_scale;
        float* a = acc + g * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) a[d] += p * row[d];
      }
    });
    for (int64_t g = 0; g < group; ++g) {
      const float inv = 1.0f / sums[g];
      for (int64_t d = 0; d < head_dim; ++d) result[d] = acc[g * head_dim + d] * inv;
      HeadRows<Q>::store(out, b, h * group + g, head_dim, result);
    }
  });
}

void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
                            double softmax_scale, int64_t window, double softcap, at::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q [B, Hq, D], caches [Hkv, slots, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV caches must be contiguous");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "K and V caches differ in shape or dtype");
  TORCH_CHECK(q.size(2) == k_cache.size(2), "q and the caches differ in head_dim");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0 && q.size(1) / k_cache.size(0) <= 64,
              "query heads must be a multiple (at most 64) of KV heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() && block_tables.dim() == 2 &&
                  block_tables.size(0) == q.size(0),
              "block_tables: contiguous int32 [B, blocks]");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.is_contiguous() &&
                  context_lens.numel() == q.size(0),
              "context_lens: contiguous int32 [B]");
  TORCH_CHECK(out.sizes() == q.sizes(), "out must have q's shape");
  conveyor::check_block_tables(block_tables, context_lens.data_ptr<int32_t>(), q.size(0), block_size, k_cache.size(1));
  TORCH_CHECK(k_scale.has_value() == v_scale.has_value(), "k_scale and v_scale come together");
  if (k_scale.has_value()) {
    TORCH_CHECK(k_cache.scalar_type() == at::kByte, "scales come with an fp8 (uint8 bits) cache");
    for (const at::Tensor* s : {&*k_scale, &*v_scale}) {
      TORCH_CHECK(s->scalar_type() == at::kBFloat16 && s->is_contiguous() &&
                      s->sizes() == k_cache.sizes().slice(0, 2),
                  "scales: contiguous bfloat16 [Hkv, slots]");
    }
  }
#ifdef CONVEYOR_AVX512_BF16
  // heads of one token back to back, unit inner stride (a view into the qkv buffer qualifies)
  const auto rows_of_heads = [](const at::Tensor& t) { return t.stride(2) == 1 && t.stride(1) == t.size(2); };
  if (k_cache.scalar_type() == at::kBFloat16 && q.scalar_type() == at::kBFloat16 &&
      out.scalar_type() == at::kBFloat16 && rows_of_heads(q) && rows_of_heads(out)) {
    if (q.size(2) == 64) return decode_bf16<64>(q, k_cache, v_cache, block_tables, context_lens, block_size,
                                                softmax_scale, window, softcap, out);
    if (q.size(2) == 128) return decode_bf16<128>(q, k_cache, v_cache, block_tables, context_lens, block_size,
                                                  softmax_scale, window, softcap, out);
  }
#endif
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "out must have q's dtype");
  // (rows of q and out are read and written in place: along head_dim at unit stride)
  const at::Tensor qs = q.stride(2) == 1 ? q : q.contiguous();
  at::Tensor result = out.stride(2) == 1 ? out : at::empty(out.sizes(), out.options());
  const auto with_rows = [&](auto element, auto query) {
    using T = decltype(element);
    using Q = decltype(query);
    switch (q.size(2)) {
      case 64:
        return decode<T, 64, Q>(qs, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, block_size,
                                softmax_scale, window, softcap, result);
      case 128:
        return decode<T, 128, Q>(qs, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, block_size,
                                 softmax_scale, window, softcap, result);
      default:
        return decode<T, 0, Q>(qs, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, block_size,
                               softmax_scale, window, softcap, result);
    }
  };
  const auto run = [&](auto element) {
    switch (q.scalar_type()) {
      case at::kFloat:
        return with_rows(element, float{});
      case at::kBFloat16:
        return with_rows(element, c10::BFloat16{});
      case at::kHalf:
        return with_rows(element, c10::Half{});
      default:
        TORCH_CHECK(false, "unsupported query dtype ", q.scalar_type());
    }
  };
  switch (k_cache.scalar_type()) {
    case at::kFloat:
      run(float{});
      break;
    case at::kBFloat16:
      run(c10::BFloat16{});
      break;
    case at::kHalf:
      run(c10::Half{});
      break;
    case at::kByte:
      TORCH_CHECK(k_scale.has_value(), "an fp8 (uint8 bits) cache needs its scales");
      run(uint8_t{});
      break;
    default:
      TORCH_CHECK(false, "unsupported KV cache dtype ", k_cache.scalar_type());
  }
  if (!result.is_same(out)) out.copy_(result);
}

}  // namespace

void conveyor::paged_decode_into(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
                                 double softmax_scale, at::Tensor& out) {
  paged_decode_attention(q, k_cache, v_cache, c10::nullopt, c10::nullopt, block_tables, context_lens, block_size,
                         softmax_scale, 0, 0.0, out);
}

TORCH_LIBRARY(conveyor_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_scale, Tensor? v_scale, "
      "Tensor block_tables, Tensor context_lens, int block_size, float softmax_scale, int window, float softcap, "
      "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(conveyor_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
