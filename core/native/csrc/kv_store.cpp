// The new keys and values of a step into the paged cache, one row per token and head.
//
// index_copy_ on the head-major cache [kv_heads, slots, head_dim] from the
// token-major rows [tokens, kv_heads, head_dim] (a view into the qkv output)
// costs about 40 us per layer at 64 tokens; these are 192 row copies of 128
// bytes.
#include <torch/library.h>

#include "common.h"
#include "kernels.h"

namespace {

void store_kv(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping, const at::Tensor& k,
              const at::Tensor& v) {
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(), "caches: contiguous [kv_heads, slots, head_dim], alike");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(1) == k_cache.size(0) && k.size(2) == k_cache.size(2),
              "k, v: [tokens, kv_heads, head_dim] matching the caches");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k, v: unit stride along head_dim");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(), "k, v and the caches must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == k.size(0), "slot_mapping: contiguous int64 [tokens]");
  const int64_t tokens = k.size(0), heads = k.size(1), num_slots = k_cache.size(1);
  const int64_t row_bytes = k.size(2) * k.element_size();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "token ", t, " goes to slot ", slots[t], " of ", num_slots);
  char* caches[2] = {static_cast<char*>(k_cache.data_ptr()), static_cast<char*>(v_cache.data_ptr())};
  const char* sources[2] = {static_cast<const char*>(k.data_ptr()), static_cast<const char*>(v.data_ptr())};
  const int64_t strides[2][2] = {{k.stride(0), k.stride(1)}, {v.stride(0), v.stride(1)}};
  const int64_t element = k.element_size();
  at::parallel_for(0, tokens * heads, 512, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / heads, h = item % heads;
      for (int c = 0; c < 2; ++c)
        std::memcpy(caches[c] + (h * num_slots + slots[t]) * row_bytes,
                    sources[c] + (t * strides[c][0] + h * strides[c][1]) * element, row_bytes);
    }
  });
}

}  // namespace

void conveyor::store_kv_into(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
                             const at::Tensor& k, const at::Tensor& v) {
  store_kv(k_cache, v_cache, slot_mapping, k, v);
}

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("store_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, Tensor k, Tensor v) -> ()");
}

TORCH_LIBRARY_IMPL(conveyor_cpu, CPU, m) { m.impl("store_kv", &store_kv); }
