// Fused element-wise layers of a Llama block for CPUs: RMSNorm (with the
// residual add folded in), SwiGLU's silu(gate) * up, and rotary embedding in
// place. Each reads and writes its tensors once instead of once per torch op.
//
// Every op rounds where the torch reference (conveyor.model.layers, .decoder) rounds: the
// norm in float32, then the weight product in the model dtype; silu, then the
// product with up; each rotary product, then the sum. For bfloat16 and
// float32 the results equal the reference up to float32 rounding of exp/rsqrt.

#include <torch/library.h>

#include <cmath>

#include "common.h"
#include "kernels.h"

namespace {

// Conversions that vectorize: bfloat16 through integer bit operations; float16 through c10.
inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return conveyor::bf16_to_float(x.x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float x) {
  return c10::BFloat16(conveyor::float_to_bf16(x), c10::BFloat16::from_bits());
}
template <>
inline c10::Half from_float<c10::Half>(float x) { return c10::Half(x); }

// Rounds a float32 result to T and back: what storing it in a T tensor does.
template <typename T>
inline float round_as(float x) { return to_float(from_float<T>(x)); }

constexpr int64_t kGrain = 16;  // rows per task

// NOTE: each op's work on one row is a function of its own, never inlined: at::parallel_for calls its body
// inline for a few rows and in an OpenMP region for more, and with -ffast-math the two inlined copies were
// vectorized differently (a row's norm changed in its last bits with the number of rows in the step, which
// [engine] batch_invariant must not allow).
template <typename T>
__attribute__((noinline)) void rms_norm_row(T* x, const T* d, const T* weight, T* y, int64_t hidden, float eps) {
  if (d != nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) x[i] = from_float<T>(to_float(x[i]) + to_float(d[i]));
  }
  float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < hidden; ++i) squares += to_float(x[i]) * to_float(x[i]);
  const float inv = 1.0f / std::sqrt(squares / hidden + eps);
#pragma omp simd
  for (int64_t i = 0; i < hidden; ++i) y[i] = from_float<T>(to_float(weight[i]) * round_as<T>(to_float(x[i]) * inv));
}

template <typename T>
void rms_norm_rows(T* h, const T* delta, const T* weight, T* out, int64_t rows, int64_t hidden, int64_t h_stride,
                   int64_t delta_stride, int64_t out_stride, float eps) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      rms_norm_row<T>(h + r * h_stride, delta != nullptr ? delta + r * delta_stride : nullptr, weight,
                      out + r * out_stride, hidden, eps);
    }
  });
}

template <typename T>
__attribute__((noinline)) void silu_mul_row(const T* gate, const T* up, T* y, int64_t width) {
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) {
    const float g = to_float(gate[i]);
    y[i] = from_float<T>(round_as<T>(g / (1.0f + std::exp(-g))) * to_float(up[i]));
  }
}

template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t width, int64_t in_stride, int64_t out_stride) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = gate_up + r * in_stride;
      silu_mul_row<T>(gate, gate + width, out + r * out_stride, width);
    }
  });
}

template <typename T>
__attribute__((noinline)) void rotary_row(T* x, const T* c, const T* s, int64_t heads, int64_t half,
                                          int64_t head_stride) {
  for (int64_t head = 0; head < heads; ++head) {
    T* first = x + head * head_stride;
    T* second = first + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = to_float(first[i]), x2 = to_float(second[i]);
      const float ci = to_float(c[i]), si = to_float(s[i]);
      first[i] = from_float<T>(round_as<T>(x1 * ci) - round_as<T>(x2 * si));
      second[i] = from_float<T>(round_as<T>(x2 * ci) + round_as<T>(x1 * si));
    }
  }
}

template <typename T>
void rotary_rows(T* x, const T* cos, const T* sin, int64_t rows, int64_t heads, int64_t head_dim, int64_t row_stride,
                 int64_t head_stride, int64_t table_stride) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      rotary_row<T>(x + r * row_stride, cos + r * table_stride, sin + r * table_stride, heads, half, head_stride);
    }
  });
}

template <typename F>
void dispatch(at::ScalarType dtype, const char* op, F&& body) {
  switch (dtype) {
    case at::kFloat: return body(float{});
    case at::kBFloat16: return body(c10::BFloat16{});
    case at::kHalf: return body(c10::Half{});
    default: TORCH_CHECK(false, op, ": unsupported dtype ", dtype);
  }
}

void check_rows(const at::Tensor& t, const char* name, int64_t rows, int64_t width) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == width && t.stride(1) == 1,
              name, ": expected [", rows, ", ", width, "] with unit inner stride, got ", t.sizes());
}

// out = weight * norm(h), or with delta: h += delta first (in place), then the same.
void rms_norm(at::Tensor h, const c10::optional<at::Tensor>& delta, const at::Tensor& weight, double eps,
              at::Tensor out) {
  const int64_t rows = h.size(0), hidden = h.size(1);
  check_rows(h, "h", rows, hidden);
  check_rows(out, "out", rows, hidden);
  if (delta.has_value()) check_rows(*delta, "delta", rows, hidden);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden && weight.is_contiguous(), "weight: [hidden]");
  TORCH_CHECK(weight.scalar_type() == h.scalar_type() && out.scalar_type() == h.scalar_type() &&
                  (!delta.has_value() || delta->scalar_type() == h.scalar_type()),
              "rms_norm: tensors differ in dtype");
  dispatch(h.scalar_type(), "rms_norm", [&](auto element) {
    using T = decltype(element);
    rms_norm_rows<T>(h.data_ptr<T>(), delta.has_value() ? delta->data_ptr<T>() : nullptr, weight.data_ptr<T>(),
                     out.data_ptr<T>(), rows, hidden, h.stride(0), delta.has_value() ? delta->stride(0) : 0,
                     out.stride(0), static_cast<float>(eps));
  });
}

// out [T, I] = silu(gate_up[:, :I]) * gate_up[:, I:]
void silu_mul(const at::Tensor& gate_up, at::Tensor out) {
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  check_rows(gate_up, "gate_up", rows, 2 * width);
  check_rows(out, "out", rows, width);
  TORCH_CHECK(out.scalar_type() == gate_up.scalar_type(), "silu_mul: tensors differ in dtype");
  dispatch(gate_up.scalar_type(), "silu_mul", [&](auto element) {
    using T = decltype(element);
    silu_mul_rows<T>(gate_up.data_ptr<T>(), out.data_ptr<T>(), rows, width, gate_up.stride(0), out.stride(0));
  });
}

// x [T, heads, head_dim] (any row and head strides, unit inner stride) rotated in place by cos, sin [T, head_dim / 2].
void rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "x: [T, heads, head_dim], unit inner stride");
  const int64_t rows = x.size(0), half = x.size(2) / 2;
  check_rows(cos, "cos", rows, half);
  check_rows(sin, "sin", rows, half);
  TORCH_CHECK(cos.stride(0) == sin.stride(0), "cos and sin differ in layout");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary: tensors differ in dtype");
  dispatch(x.scalar_type(), "rotary", [&](auto element) {
    using T = decltype(element);
    rotary_rows<T>(x.data_ptr<T>(), cos.data_ptr<T>(), sin.data_ptr<T>(), rows, x.size(1), x.size(2), x.stride(0),
                   x.stride(1), cos.stride(0));
  });
}

}  // namespace

void conveyor::rms_norm_into(at::Tensor& h, const c10::optional<at::Tensor>& delta, const at::Tensor& weight,
                             double eps, at::Tensor& out) {
  rms_norm(h, delta, weight, eps, out);
}

void conveyor::silu_mul_into(const at::Tensor& gate_up, at::Tensor& out) { silu_mul(gate_up, out); }

void conveyor::rotary_into(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) { rotary_(x, cos, sin); }

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("rms_norm(Tensor(a!) h, Tensor? delta, Tensor weight, float eps, Tensor(b!) out) -> ()");
  m.def("silu_mul(Tensor gate_up, Tensor(a!) out) -> ()");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(conveyor_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rotary_", &rotary_);
}
