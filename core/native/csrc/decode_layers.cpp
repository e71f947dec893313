// Every layer of a decode step in one call, for Llama's plain block over GGML block weights: the model's layers
// as conveyor.model.decoder runs them (RMSNorm with the residual add, Q/K/V, rotary, the KV store, paged
// attention, the output projection, RMSNorm, gate/up, SwiGLU, down), calling the same kernels in the same order,
// so the hidden states equal the layer-by-layer path's bit for bit.
//
// Why: one token of SmolLM2-135M reads its 97 MB of weights in about 4 ms, and the layer-by-layer path spent as
// long again between the kernels: about 300 Python calls and torch ops a token, and ATen's threads woken and
// put back to sleep (OMP_WAIT_POLICY=PASSIVE) for every kernel that used both cores, or one core left idle for
// the kernels too small to be worth waking them for. Here the threads are woken once a step and run as a team
// (common.h): each kernel's items go to whichever thread comes for them, so the small layers use every core
// too, and the element-wise work between the kernels (norms, rotary and the KV store, SwiGLU) is one item that
// the first thread to come does. A thread whose core another process has taken misses the items it came too
// late for rather than holding the others back.
//
// NOTE: 2-core AMD EPYC (AVX2), one stream in-process (LLM.generate, 128 tokens, greedy): 12.9 ms a token
// layer by layer, 6.0 in one call; 32 streams: 307 and 329 tok/s. With another process keeping one core busy,
// threads that waited at a barrier for each other after every kernel made one stream 23 ms a token (layer by
// layer: 16); hence items taken by whoever comes.

#include <torch/library.h>

#include <exception>
#include <mutex>

#include "common.h"
#include "kernels.h"

namespace {

using conveyor::Team;
using conveyor::TeamMember;

// h [M, H]: the embedded tokens; k_cache, v_cache [layers, kv_heads, slots, head_dim]; weights: per layer qkv,
// o_proj, gate_up, down (uint8 GGML blocks of the types in `types`); norms: per layer the input and the
// post-attention norm's weights, then the final norm's; out [M, H]: the final norm of the last layer's stream.
void decode_layers(const at::Tensor& h, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
                   const at::Tensor& block_tables, const at::Tensor& context_lens, const at::Tensor& cos,
                   const at::Tensor& sin, at::TensorList weights, at::IntArrayRef types, at::TensorList norms,
                   double eps, double softmax_scale, int64_t block_size, int64_t num_heads, at::Tensor out) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "decode_layers: h must be a contiguous [M, hidden]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "decode_layers: caches must be [layers, kv_heads, slots, head_dim], alike");
  const int64_t layers = k_cache.size(0), M = h.size(0), H = h.size(1);
  const int64_t kv_heads = k_cache.size(1), head_dim = k_cache.size(3);
  const int64_t q_size = num_heads * head_dim, kv_size = kv_heads * head_dim;
  TORCH_CHECK(int64_t(weights.size()) == 4 * layers && int64_t(types.size()) == 4 * layers,
              "decode_layers: four weights and types a layer");
  TORCH_CHECK(int64_t(norms.size()) == 2 * layers + 1, "decode_layers: two norms a layer and the final one");
  TORCH_CHECK(out.sizes() == h.sizes() && out.is_contiguous() && out.scalar_type() == h.scalar_type(),
              "decode_layers: out must be a contiguous tensor like h");
  const int64_t width = weights[2].size(0) / 2;  // the MLP's intermediate size
  for (int64_t l = 0; l < layers; ++l) {
    TORCH_CHECK(weights[4 * l].size(0) == q_size + 2 * kv_size && weights[4 * l + 1].size(0) == H &&
                    weights[4 * l + 2].size(0) == 2 * width && weights[4 * l + 3].size(0) == H,
                "decode_layers: layer ", l, "'s weights do not match the model's shape");
  }
  // Everything the layers share, made before the threads start (a failed check there is an error here, not in
  // one thread of a team that another waits for).
  const auto options = h.options();
  at::Tensor qkv = at::empty({M, q_size + 2 * kv_size}, options);
  at::Tensor q = qkv.narrow(1, 0, q_size).view({M, num_heads, head_dim});
  at::Tensor k = qkv.narrow(1, q_size, kv_size).view({M, kv_heads, head_dim});
  at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({M, kv_heads, head_dim});
  at::Tensor attended = at::empty({M, num_heads, head_dim}, options);
  at::Tensor attended_rows = attended.view({M, q_size});
  at::Tensor o = at::empty({M, H}, options), gate_up = at::empty({M, 2 * width}, options);
  at::Tensor down = at::empty({M, H}, options);
  std::vector<at::Tensor> k_layers, v_layers;
  for (int64_t l = 0; l < layers; ++l) k_layers.push_back(k_cache.select(0, l)), v_layers.push_back(v_cache.select(0, l));
  at::Tensor stream = h.clone(), x = at::empty({M, H}, options), act = at::empty({M, width}, options);
  Team team;
  std::exception_ptr failure;
  std::mutex failure_lock;
  using conveyor::run_once;

#pragma omp parallel num_threads(std::max(1, at::get_num_threads()))
  {
    TeamMember member{&team};
    conveyor::t_member = &member;
    try {
      for (int64_t l = 0; l < layers && !team.aborted(); ++l) {
        const c10::optional<at::Tensor> delta = l > 0 ? c10::optional<at::Tensor>(down) : c10::nullopt;
        run_once([&] { conveyor::rms_norm_into(stream, delta, norms[2 * l], eps, x); });
        conveyor::ggml_linear_into(x, weights[4 * l], types[4 * l], qkv);
        run_once([&] {
          conveyor::rotary_into(q, cos, sin);
          conveyor::rotary_into(k, cos, sin);
          conveyor::store_kv_into(k_layers[l], v_layers[l], slot_mapping, k, v);
        });
        conveyor::paged_decode_into(q, k_layers[l], v_layers[l], block_tables, context_lens, block_size,
                                    softmax_scale, attended);
        conveyor::ggml_linear_into(attended_rows, weights[4 * l + 1], types[4 * l + 1], o);
        run_once([&] { conveyor::rms_norm_into(stream, o, norms[2 * l + 1], eps, x); });
        conveyor::ggml_linear_into(x, weights[4 * l + 2], types[4 * l + 2], gate_up);
        run_once([&] { conveyor::silu_mul_into(gate_up, act); });
        conveyor::ggml_linear_into(act, weights[4 * l + 3], types[4 * l + 3], down);
      }
      if (!team.aborted()) run_once([&] { conveyor::rms_norm_into(stream, down, norms[2 * layers], eps, out); });
    } catch (...) {
      {
        std::lock_guard<std::mutex> hold(failure_lock);
        if (!failure) failure = std::current_exception();
      }
      team.abort();
    }
    conveyor::t_member = nullptr;
  }
  if (failure) std::rethrow_exception(failure);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def(
      "decode_layers(Tensor h, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, Tensor block_tables, "
      "Tensor context_lens, Tensor cos, Tensor sin, Tensor[] weights, int[] types, Tensor[] norms, float eps, "
      "float softmax_scale, int block_size, int num_heads, Tensor(c!) out) -> ()");
}

TORCH_LIBRARY_IMPL(conveyor_cpu, CPU, m) { m.impl("decode_layers", &decode_layers); }
