// Every layer of a decode step in one call, for Llama's plain block over GGML block or fp8 weights: the model's layers
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

#include <omp.h>
#include <torch/library.h>

#include <exception>
#include <mutex>

#include "common.h"
#include "kernels.h"

namespace {

using conveyor::Team;
using conveyor::TeamMember;

constexpr int64_t kFp8 = -1;  // the type of fp8 e4m3 weights with a scale per row (conveyor.quant.FP8_TYPE_ID)

// h [M, H]: the embedded tokens; k_cache, v_cache [layers, kv_heads, slots, head_dim]; weights: per layer qkv,
// o_proj, gate_up, down (uint8 GGML blocks of the types in `types`, or fp8 with their rows' scales in `scales`,
// empty tensors for blocks); norms: per layer the input and the post-attention norm's weights, then the final
// norm's; out [M, H]: the final norm of the last layer's stream.
void decode_layers(const at::Tensor& h, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
                   const at::Tensor& block_tables, const at::Tensor& context_lens, const at::Tensor& cos,
                   const at::Tensor& sin, at::TensorList weights, at::IntArrayRef types, at::TensorList scales,
                   at::TensorList norms, double eps, double softmax_scale, int64_t block_size, int64_t num_heads,
                   at::Tensor out) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "decode_layers: h must be a contiguous [M, hidden]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "decode_layers: caches must be [layers, kv_heads, slots, head_dim], alike");
  const int64_t layers = k_cache.size(0), M = h.size(0), H = h.size(1);
  const int64_t kv_heads = k_cache.size(1), head_dim = k_cache.size(3);
  const int64_t q_size = num_heads * head_dim, kv_size = kv_heads * head_dim;
  TORCH_CHECK(int64_t(weights.size()) == 4 * layers && int64_t(types.size()) == 4 * layers &&
                  int64_t(scales.size()) == 4 * layers,
              "decode_layers: four weights, types and scales a layer");
  for (int64_t i = 0; i < 4 * layers; ++i)
    TORCH_CHECK(types[i] >= 0 || (types[i] == kFp8 && scales[i].numel() == weights[i].size(0)),
                "decode_layers: weight ", i, " has type ", types[i],
                " (GGML blocks: 0 and up; fp8: -1, with a scale a row)");
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
  for (int64_t l = 0; l < layers; ++l) {
    k_layers.push_back(k_cache.select(0, l));
    v_layers.push_back(v_cache.select(0, l));
  }
  at::Tensor stream = h.clone(), x = at::empty({M, H}, options), act = at::empty({M, width}, options);
  const auto linear = [&](const at::Tensor& x, int64_t i, at::Tensor& y) {
    if (types[i] == kFp8) return conveyor::fp8_linear_into(x, weights[i], scales[i], y);
    conveyor::ggml_linear_into(x, weights[i], types[i], y);
  };
  const int threads = std::max(1, at::get_num_threads());
  Team team(threads);
  std::exception_ptr failure;
  std::mutex failure_lock;
  std::vector<uint64_t> digests(threads, 0);  // (each member's, to check that they made the same calls)
  int started = threads;  // (OpenMP may start fewer)
  using conveyor::run_once;

#pragma omp parallel num_threads(threads)
  {
    TeamMember member{&team};
    conveyor::t_member = &member;
    try {
      for (int64_t l = 0; l < layers && !team.aborted(); ++l) {
        const c10::optional<at::Tensor> delta = l > 0 ? c10::optional<at::Tensor>(down) : c10::nullopt;
        run_once([&] { conveyor::rms_norm_into(stream, delta, norms[2 * l], eps, x); });
        linear(x, 4 * l, qkv);
        run_once([&] {
          conveyor::rotary_into(q, cos, sin);
          conveyor::rotary_into(k, cos, sin);
          conveyor::store_kv_into(k_layers[l], v_layers[l], slot_mapping, k, v);
        });
        conveyor::paged_decode_into(q, k_layers[l], v_layers[l], block_tables, context_lens, block_size,
                                    softmax_scale, attended);
        linear(attended_rows, 4 * l + 1, o);
        run_once([&] { conveyor::rms_norm_into(stream, o, norms[2 * l + 1], eps, x); });
        linear(x, 4 * l + 2, gate_up);
        run_once([&] { conveyor::silu_mul_into(gate_up, act); });
        linear(act, 4 * l + 3, down);
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
    digests[omp_get_thread_num()] = member.digest;
    if (omp_get_thread_num() == 0) started = omp_get_num_threads();
  }
  if (failure) std::rethrow_exception(failure);
  // a kernel that counted its items differently on two threads would have left some undone or done twice
  for (int t = 1; t < started; ++t)
    TORCH_CHECK(digests[t] == digests[0], "decode_layers: the threads counted different work items (a kernel's count "
                "depends on something other than its arguments and conveyor::num_threads())");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def(
      "decode_layers(Tensor h, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, Tensor block_tables, "
      "Tensor context_lens, Tensor cos, Tensor sin, Tensor[] weights, int[] types, Tensor[] scales, Tensor[] norms, "
      "float eps, float softmax_scale, int block_size, int num_heads, Tensor(c!) out) -> ()");
}

TORCH_LIBRARY_IMPL(conveyor_cpu, CPU, m) { m.impl("decode_layers", &decode_layers); }
