// The kernels one C++ op calls in another's place (decode_layers.cpp): each as its op does it, with its
// checks, on ATen's threads, or on a team's (common.h) when called by every member of one.
#pragma once

#include <ATen/core/Tensor.h>

namespace conveyor {

// ggml_linear.cpp: out = x w^T, w as GGML blocks of the given type, on the fastest path built here.
void ggml_linear_into(const at::Tensor& x, const at::Tensor& weight, int64_t type, at::Tensor& out);

// fp8_linear.cpp: out = x (w * scale[:, None])^T, w float8 e4m3 [N, K] converted in registers.
void fp8_linear_into(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, at::Tensor& out);

// paged_decode.cpp: one query per sequence over its paged keys and values (no window, no soft cap).
void paged_decode_into(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
                       double softmax_scale, at::Tensor& out);

// elementwise.cpp: RMSNorm with the residual add folded in, silu(gate) * up, rotary embedding in place.
void rms_norm_into(at::Tensor& h, const c10::optional<at::Tensor>& delta, const at::Tensor& weight, double eps,
                   at::Tensor& out);
void silu_mul_into(const at::Tensor& gate_up, at::Tensor& out);
void rotary_into(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// kv_store.cpp: a step's new keys and values into the paged cache at their slots.
void store_kv_into(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& k,
                   const at::Tensor& v);

}  // namespace conveyor
