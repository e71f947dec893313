// One token through a bfloat16 linear layer: y[N] = w[N, K] x[K] (+ bias), the weight row-major.
//
// A decode step of one sequence reads every weight once and does two flops per
// weight: it is bound by memory bandwidth. oneDNN's prepacked matmul reaches
// about 70% of this CPU's read bandwidth at one token over a model's layers;
// this kernel streams each thread's rows front to back with VDPBF16PS (four
// rows at a time, a horizontal sum per row at the end) and reaches about 85%.
// Larger batches stay with oneDNN, whose AMX tiles win once weights are reused.
#include <torch/library.h>

#include "common.h"

namespace conveyor {
namespace {

#ifdef CONVEYOR_AVX512_BF16
constexpr int64_t ROWS = 4;

// The 32 bfloat16 of x (or the K % 32 tail, zero-filled) starting at k.
inline __m512bh load_bf16(const uint16_t* p, int64_t k, int64_t K) {
  const int64_t left = K - k;
  if (left >= 32) return (__m512bh)_mm512_loadu_si512(p + k);
  return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1ull << left) - 1), p + k);
}

void gemv_rows(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t K, int64_t n0,
               int64_t n1) {
  int64_t n = n0;
  for (; n + ROWS <= n1; n += ROWS) {
    __m512 acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
    const uint16_t* rows = w + n * K;
    for (int64_t k = 0; k < K; k += 32) {
      const __m512bh xv = load_bf16(x, k, K);
      for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], xv, load_bf16(rows + r * K, k, K));
    }
    for (int r = 0; r < ROWS; ++r) {
      const float b = bias ? bf16_to_float(bias[n + r]) : 0.0f;
      y[n + r] = float_to_bf16(_mm512_reduce_add_ps(acc[r]) + b);
    }
  }
  for (; n < n1; ++n) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) acc = _mm512_dpbf16_ps(acc, load_bf16(x, k, K), load_bf16(w + n * K, k, K));
    y[n] = float_to_bf16(_mm512_reduce_add_ps(acc) + (bias ? bf16_to_float(bias[n]) : 0.0f));
  }
}
#endif

bool gemv_supported() {
#ifdef CONVEYOR_AVX512_BF16
  return true;
#else
  return false;
#endif
}

void gemv_bf16(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  TORCH_CHECK(gemv_supported(), "gemv_bf16 needs a CPU with AVX-512 BF16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16, "gemv_bf16: tensors must be bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.is_contiguous(), "gemv_bf16: x must be a contiguous [1, K]");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1),
              "gemv_bf16: weight must be a contiguous [N, K] with K = ", x.size(1));
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == 1 && out.size(1) == N && out.is_contiguous(),
              "gemv_bf16: out must be a contiguous [1, ", N, "]");
  const uint16_t* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == N && bias->is_contiguous(),
                "gemv_bf16: bias must be a contiguous bfloat16 [", N, "]");
    b = reinterpret_cast<const uint16_t*>(bias->data_ptr());
  }
#ifdef CONVEYOR_AVX512_BF16
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(out.data_ptr());
  // contiguous runs of whole row groups per thread: each thread streams its part of the weight in order
  const int64_t groups = (N + ROWS - 1) / ROWS;
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    gemv_rows(xp, wp, b, yp, K, g0 * ROWS, std::min(N, g1 * ROWS));
  });
#endif
}

}  // namespace
}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("gemv_supported() -> bool", &conveyor::gemv_supported);
  m.def("gemv_bf16(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(conveyor_cpu, CPU, m) { m.impl("gemv_bf16", &conveyor::gemv_bf16); }
