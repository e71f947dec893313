// Paged prefill attention for CPUs with AVX-512 BF16: the queries of prompt
// chunks attend causally over their sequence's keys, cached and new, read from
// the paged bfloat16 cache.
//
// Per (sequence, KV head), the keys and values are first packed into 16-key
// tiles laid out for VDPBF16PS (pairs of bf16 along the dot product), so one
// instruction does 32 multiply-adds with float32 sums. Each query position then
// runs an online softmax over the tiles up to its own position, for all query
// heads of the KV head at once (they share the keys and the causal limit).
// Probabilities are rounded to bf16 for the product with V, as
// scaled_dot_product_attention does for bf16 on CPU; sums stay float32.

#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "common.h"

namespace {

#ifdef CONVEYOR_AVX512_BF16
constexpr int kTile = 16;             // keys per tile: one float32 lane each
constexpr float kMasked = -1.0e30f;   // finite "minus infinity" (the build assumes finite math)

inline int64_t tiles_for(int64_t len) { return (len + kTile - 1) / kTile; }

// keys[t][p][j] = (k[16t + j][2p], k[16t + j][2p + 1]); values[t][kp][d] = (v[16t + 2kp][d], v[16t + 2kp + 1][d]).
// Keys past len are zero.
template <int D>
void pack(const uint16_t* k_head, const uint16_t* v_head, const int32_t* table, int64_t len, int64_t block_size,
          uint32_t* keys, uint32_t* values) {
  const int64_t tiles = tiles_for(len);
  const auto row_of = [&](const uint16_t* head, int64_t pos) {
    return head + (int64_t(table[pos / block_size]) * block_size + pos % block_size) * D;
  };
  for (int64_t t = 0; t < tiles; ++t) {
    uint32_t* k_tile = keys + t * kTile * (D / 2);
    for (int j = 0; j < kTile; ++j) {
      const int64_t pos = t * kTile + j;
      if (pos < len) {
        uint32_t pairs[D / 2];
        std::memcpy(pairs, row_of(k_head, pos), sizeof(pairs));
        for (int p = 0; p < D / 2; ++p) k_tile[p * kTile + j] = pairs[p];
      } else {
        for (int p = 0; p < D / 2; ++p) k_tile[p * kTile + j] = 0;
      }
    }
    uint32_t* v_tile = values + t * (kTile / 2) * D;
    for (int kp = 0; kp < kTile / 2; ++kp) {
      const int64_t pos = t * kTile + 2 * kp;
      const uint16_t* even = pos < len ? row_of(v_head, pos) : nullptr;
      const uint16_t* odd = pos + 1 < len ? row_of(v_head, pos + 1) : nullptr;
      for (int d = 0; d < D; ++d) {
        v_tile[kp * D + d] = uint32_t(even ? even[d] : 0) | (uint32_t(odd ? odd[d] : 0) << 16);
      }
    }
  }
}

inline __m512 exp16(__m512 x) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, x);
#pragma omp simd
  for (int i = 0; i < 16; ++i) lanes[i] = std::exp(lanes[i]);
  return _mm512_load_ps(lanes);
}

// One query position, kGroup query heads: out[g] = softmax(q_g K^T * scale) V over keys [0, last].
template <int D, int kGroup>
void attend_position(const uint16_t* const* q_rows, const uint32_t* keys, const uint32_t* values, int64_t last,
                     float scale, uint16_t* const* out_rows) {
  constexpr int kPairs = D / 2, kVectors = D / 16;
  __m512 acc[kGroup][kVectors];
  float top[kGroup], sums[kGroup];
  const uint32_t* q_pairs[kGroup];
  for (int g = 0; g < kGroup; ++g) {
    for (int c = 0; c < kVectors; ++c) acc[g][c] = _mm512_setzero_ps();
    top[g] = kMasked;
    sums[g] = 0.0f;
    q_pairs[g] = reinterpret_cast<const uint32_t*>(q_rows[g]);
  }
  const int64_t tiles = last / kTile + 1;
  for (int64_t t = 0; t < tiles; ++t) {
    const uint32_t* k_tile = keys + t * kTile * kPairs;
    __m512 scores[kGroup], scores_odd[kGroup];
    for (int g = 0; g < kGroup; ++g) scores[g] = scores_odd[g] = _mm512_setzero_ps();
    for (int p = 0; p < kPairs; p += 2) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(k_tile + p * kTile);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(k_tile + (p + 1) * kTile);
      for (int g = 0; g < kGroup; ++g) {
        scores[g] = _mm512_dpbf16_ps(scores[g], (__m512bh)_mm512_set1_epi32(q_pairs[g][p]), k0);
        scores_odd[g] = _mm512_dpbf16_ps(scores_odd[g], (__m512bh)_mm512_set1_epi32(q_pairs[g][p + 1]), k1);
      }
    }
    const __m512 scale_v = _mm512_set1_ps(scale);
    // lanes past the causal limit (only in the last tile) are masked out
    const int64_t visible = std::min<int64_t>(kTile, last - t * kTile + 1);
    const __mmask16 keep = visible >= kTile ? __mmask16(0xFFFF) : __mmask16((1u << visible) - 1);
    const uint32_t* v_tile = values + t * (kTile / 2) * D;
    for (int g = 0; g < kGroup; ++g) {
      __m512 s = _mm512_mul_ps(_mm512_add_ps(scores[g], scores_odd[g]), scale_v);
      s = _mm512_mask_mov_ps(_mm512_set1_ps(kMasked), keep, s);
      const float new_top = std::max(top[g], _mm512_reduce_max_ps(s));
      const float correction = std::exp(top[g] - new_top);
      const __m512 probs = exp16(_mm512_sub_ps(s, _mm512_set1_ps(new_top)));
      sums[g] = sums[g] * correction + _mm512_reduce_add_ps(probs);
      top[g] = new_top;
      const __m512 correction_v = _mm512_set1_ps(correction);
      for (int c = 0; c < kVectors; ++c) acc[g][c] = _mm512_mul_ps(acc[g][c], correction_v);
      alignas(32) uint32_t prob_pairs[kTile / 2];
      _mm256_store_si256(reinterpret_cast<__m256i*>(prob_pairs), (__m256i)_mm512_cvtneps_pbh(probs));
      for (int kp = 0; kp < kTile / 2; ++kp) {
        const __m512bh weight = (__m512bh)_mm512_set1_epi32(prob_pairs[kp]);
        for (int c = 0; c < kVectors; ++c) {
          acc[g][c] = _mm512_dpbf16_ps(acc[g][c], weight, (__m512bh)_mm512_loadu_si512(v_tile + kp * D + c * 16));
        }
      }
    }
  }
  for (int g = 0; g < kGroup; ++g) {
    const __m512 inv = _mm512_set1_ps(1.0f / sums[g]);
    for (int c = 0; c < kVectors; ++c) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out_rows[g] + c * 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[g][c], inv)));
    }
  }
}

template <int D>
void prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
             const at::Tensor& q_rows, const at::Tensor& q_lens, const at::Tensor& starts, int64_t block_size,
             double softmax_scale, at::Tensor& out) {
  constexpr int kChunk = D == 64 ? 3 : 2;  // query heads per pass: accumulators stay in registers
  constexpr int64_t kPositions = 16;       // query positions per work item
  const int64_t num_seqs = q_rows.size(0), num_heads = q.size(1), num_kv_heads = k_cache.size(0);
  const int64_t num_slots = k_cache.size(1), group = num_heads / num_kv_heads, width = block_tables.size(1);
  const int32_t* rows = q_rows.data_ptr<int32_t>();
  const int32_t* lens = q_lens.data_ptr<int32_t>();
  const int32_t* first = starts.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const uint16_t* q_ptr = reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>());
  uint16_t* out_ptr = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  const uint16_t* k_ptr = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<c10::BFloat16>());
  const uint16_t* v_ptr = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<c10::BFloat16>());
  const int64_t q_token_stride = q.stride(0), q_head_stride = q.stride(1);
  const int64_t out_token_stride = out.stride(0), out_head_stride = out.stride(1);

  // packed keys and values of every (sequence, kv head)
  std::vector<int64_t> offsets(num_seqs * num_kv_heads + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s) {
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      offsets[s * num_kv_heads + h + 1] = offsets[s * num_kv_heads + h] + tiles_for(first[s] + lens[s]) * kTile * D / 2;
    }
  }
  // Kept from call to call (per calling thread), grown only: buffers made afresh for every layer of every step were
  // page-faulted in and zeroed each time, which for a short chunk over a long context cost more than its
  // attention. pack() writes every element of the tiles it fills.
  static thread_local std::vector<uint32_t> kept_keys, kept_values;
  if (kept_keys.size() < size_t(offsets.back())) {
    kept_keys.resize(offsets.back());
    kept_values.resize(offsets.back());
  }
  // (pointers, not the vectors: in the lambdas below, run on other threads, a thread_local's name is theirs)
  uint32_t* const keys = kept_keys.data();
  uint32_t* const values = kept_values.data();
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / num_kv_heads, h = item % num_kv_heads;
      pack<D>(k_ptr + h * num_slots * D, v_ptr + h * num_slots * D, tables + s * width, first[s] + lens[s],
              block_size, keys + offsets[item], values + offsets[item]);
    }
  });

  // work items: (sequence, kv head, 16 query positions), the most keys first
  struct Item {
    int64_t seq, head, position;
  };
  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t i = 0; i < lens[s]; i += kPositions) items.push_back({s, h, i});
  std::stable_sort(items.begin(), items.end(),
                   [&](const Item& a, const Item& b) { return first[a.seq] + a.position > first[b.seq] + b.position; });
  const float scale = static_cast<float>(softmax_scale);
  conveyor::run_work_queue(int64_t(items.size()), 0, [&](int64_t index, float*) {
    const Item item = items[index];
    const int64_t offset = offsets[item.seq * num_kv_heads + item.head];
    const int64_t end = std::min<int64_t>(item.position + kPositions, lens[item.seq]);
    for (int64_t i = item.position; i < end; ++i) {
      const int64_t token = rows[item.seq] + i;
      for (int64_t g = 0; g < group; g += kChunk) {
        const uint16_t* q_heads[kChunk];
        uint16_t* out_heads[kChunk];
        const int64_t n = std::min<int64_t>(kChunk, group - g);
        for (int64_t c = 0; c < n; ++c) {
          const int64_t head = item.head * group + g + c;
          q_heads[c] = q_ptr + token * q_token_stride + head * q_head_stride;
          out_heads[c] = out_ptr + token * out_token_stride + head * out_head_stride;
        }
        const int64_t last = first[item.seq] + i;
        if (n == kChunk) {
          attend_position<D, kChunk>(q_heads, keys + offset, values + offset, last, scale, out_heads);
        } else if (n == 2) {
          attend_position<D, 2>(q_heads, keys + offset, values + offset, last, scale, out_heads);
        } else {
          attend_position<D, 1>(q_heads, keys + offset, values + offset, last, scale, out_heads);
        }
      }
    }
  });
}
#endif

bool paged_prefill_supported(const at::Tensor& q, const at::Tensor& k_cache) {
#ifdef CONVEYOR_AVX512_BF16
  return q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
         (q.size(2) == 64 || q.size(2) == 128);
#else
  return false;
#endif
}

void paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& block_tables, const at::Tensor& q_rows, const at::Tensor& q_lens,
                             const at::Tensor& starts, int64_t block_size, double softmax_scale, at::Tensor out) {
  TORCH_CHECK(paged_prefill_supported(q, k_cache),
              "paged_prefill_attention needs AVX-512 BF16, a bfloat16 cache and queries, and head_dim 64 or 128");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && out.sizes() == q.sizes() && out.stride(2) == 1 &&
                  out.scalar_type() == q.scalar_type(),
              "q and out: [T, Hq, D] with unit inner stride");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  v_cache.scalar_type() == k_cache.scalar_type() && k_cache.size(2) == q.size(2),
              "k_cache, v_cache: contiguous [Hkv, slots, D] like q");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0, "query heads must be a multiple of KV heads");
  for (const at::Tensor* t : {&q_rows, &q_lens, &starts}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->dim() == 1 && t->size(0) == q_rows.size(0),
                "q_rows, q_lens, starts: contiguous int32 [S]");
  }
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() && block_tables.dim() == 2 &&
                  block_tables.size(0) == q_rows.size(0),
              "block_tables: contiguous int32 [S, blocks]");
  std::vector<int32_t> ends(q_rows.size(0));
  for (int64_t i = 0; i < q_rows.size(0); ++i) {
    const int32_t row = q_rows.data_ptr<int32_t>()[i], n = q_lens.data_ptr<int32_t>()[i];
    TORCH_CHECK(n >= 1 && starts.data_ptr<int32_t>()[i] >= 0 && row >= 0 && row + n <= q.size(0),
                "chunk ", i, ": rows ", row, "..", row + n, " outside q's ", q.size(0));
    ends[i] = starts.data_ptr<int32_t>()[i] + n;
  }
  conveyor::check_block_tables(block_tables, ends.data(), q_rows.size(0), block_size, k_cache.size(1));
#ifdef CONVEYOR_AVX512_BF16
  if (q.size(2) == 64) {
    prefill<64>(q, k_cache, v_cache, block_tables, q_rows, q_lens, starts, block_size, softmax_scale, out);
  } else {
    prefill<128>(q, k_cache, v_cache, block_tables, q_rows, q_lens, starts, block_size, softmax_scale, out);
  }
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("paged_prefill_supported(Tensor q, Tensor k_cache) -> bool");
  m.def(
      "paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor q_rows, "
      "Tensor q_lens, Tensor starts, int block_size, float softmax_scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(conveyor_cpu, CPU, m) {
  m.impl("paged_prefill_supported", &paged_prefill_supported);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}
