// A linear layer over float8 e4m3 weights with one scale per output row: y[M, N] = x[M, K] (w[N, K] scale[N])^T
// (+ bias), the weights converted to float32 in registers as they stream by: no dequantized copy of the layer.
//
// Why: a CPU has no fp8 arithmetic, so the fp8 method dequantized every layer to the model dtype on each step,
// reading a byte a weight and writing two (6.6 tokens/s at one request against bf16's 66.8 on Zen 4). Here
// eight weights become eight floats in four instructions: the bytes sign-extended to 16 bits, shifted left by
// 7 and bit 14 cleared, which leaves e4m3's sign, exponent and mantissa in float16's fields (the same number
// times 2^-8, subnormals included), then VCVTPH2PS. The 2^8 goes into the row's scale, applied once per output.
// Each thread takes output columns from a shared counter (run_work_queue); a tile converts each group of eight
// weights of four columns once and multiplies it with up to two rows of x (float32, converted once per call).
//
// NOTE: 2-core AMD EPYC with AVX2 alone, another job beside it, one run of `python benchmarks/quant.py --methods
// none fp8 --batches 1 16 64 --no-quality`. SmolLM2's gate_up shape ([M, 576] x [576, 3072], bf16 activations,
// us), this kernel / dequantized fp8 / bf16 weights: 1 row 162 / 6,075 / 201; 16 rows 1,115 / 10,197 / 3,502;
// 64 rows 4,201 / 20,476 / 14,117. Decode tokens/s through the offline LLM, fp8 / bf16 weights: 1 request 31.6
// / 36.2, 16 at once 106.6 / 53.7, 64 at once 122.8 / 60.5 (bf16 has no fast matmul on AVX2 alone).
#include <torch/library.h>

#include <algorithm>

#include "common.h"
#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define CONVEYOR_FP8_AVX2 1
#endif

namespace conveyor {
namespace {

#ifdef CONVEYOR_FP8_AVX2
constexpr int64_t kColumns = 4;  // output columns a tile converts together
constexpr int64_t kRows = 2;     // rows of x a tile multiplies with them

// Eight e4m3 bytes -> eight floats, each 2^-8 times the e4m3 value.
inline __m256 fp8x8(const uint8_t* p) {
  const __m128i wide = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i half = _mm_and_si128(_mm_slli_epi16(wide, 7), _mm_set1_epi16(int16_t(0xbfff)));
  return _mm256_cvtph_ps(half);
}

// One e4m3 byte the same way (the tails of K).
inline float fp8_scalar(uint8_t b) {
  const int16_t bits = int16_t(int16_t(int8_t(b)) << 7) & int16_t(0xbfff);
  return _cvtsh_ss(static_cast<uint16_t>(bits));
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// sums[r][c] = x[m0 + r] . w[n + c] (times 2^-8), for R rows and C columns.
template <int R, int C>
inline void tile(const float* x, const uint8_t* w, int64_t K, int64_t m0, int64_t n, float sums[kRows][kColumns]) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const int64_t body = K / 8 * 8;
  for (int64_t k = 0; k < body; k += 8) {
    __m256 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + (m0 + r) * K + k);
    for (int c = 0; c < C; ++c) {
      const __m256 wv = fp8x8(w + (n + c) * K + k);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(wv, xv[r], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float sum = hsum(acc[r][c]);
      for (int64_t k = body; k < K; ++k) sum += fp8_scalar(w[(n + c) * K + k]) * x[(m0 + r) * K + k];
      sums[r][c] = sum;
    }
}

template <int R>
inline void tile_columns(const float* x, const uint8_t* w, int64_t K, int64_t m0, int64_t n, int64_t columns,
                         float sums[kRows][kColumns]) {
  if (columns == kColumns) return tile<R, kColumns>(x, w, K, m0, n, sums);
  for (int64_t c = 0; c < columns; ++c) {
    float one[kRows][kColumns];
    tile<R, 1>(x, w, K, m0, n + c, one);
    for (int r = 0; r < R; ++r) sums[r][c] = one[r][0];
  }
}

template <typename T>
float to_float(T v) {
  if constexpr (std::is_same_v<T, at::BFloat16>) return bf16_to_float(v.x);
  else return static_cast<float>(v);
}

template <typename T>
void run(const T* x, const uint8_t* w, const float* scale, const T* bias, T* out, int64_t M, int64_t N, int64_t K) {
  std::vector<float> xf(M * K);
  for (int64_t i = 0; i < M * K; ++i) xf[i] = to_float(x[i]);
  // About eight chunks a thread, in whole tiles: a thread slowed by a shared core takes fewer of them.
  const int64_t per_thread = N / (8 * num_threads());
  const int64_t chunk = std::max<int64_t>(kColumns, (per_thread + kColumns - 1) / kColumns * kColumns);
  run_work_queue((N + chunk - 1) / chunk, 0, [&](int64_t item, float*) {
    float sums[kRows][kColumns];
    const int64_t n_end = std::min(N, (item + 1) * chunk);
    for (int64_t n = item * chunk; n < n_end; n += kColumns) {
      const int64_t columns = std::min(kColumns, n_end - n);
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        const int64_t rows = std::min(kRows, M - m0);
        if (rows == 2) tile_columns<2>(xf.data(), w, K, m0, n, columns, sums);
        else tile_columns<1>(xf.data(), w, K, m0, n, columns, sums);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < columns; ++c) {
            const float y = sums[r][c] * 256.0f * scale[n + c] + (bias ? to_float(bias[n + c]) : 0.0f);
            out[(m0 + r) * N + n + c] = static_cast<T>(y);
          }
      }
    }
  });
}

// Rows [n0, n1) of out = T(e4m3 w * T(scale[n])): as torch computes `upcast(w, T) * scale[:, None].to(T)`, bit for
// bit (the e4m3 value times the rounded scale is exact in float32, then rounded once to T).
template <typename T>
void upcast_rows(const uint8_t* w, const float* scale, T* out, int64_t n0, int64_t n1, int64_t K) {
  for (int64_t n = n0; n < n1; ++n) {
    const float s = to_float(static_cast<T>(scale[n]));
    const uint8_t* row = w + n * K;
    T* y = out + n * K;
    int64_t k = 0;
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      const __m256 s8 = _mm256_set1_ps(s * 256.0f);  // (fp8x8 gives the values times 2^-8)
      const __m256i half = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
      auto round = [&](__m256 v) {  // to bfloat16, to nearest even, in the low half of each lane
        const __m256i bits = _mm256_castps_si256(v);
        const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
        return _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(half, odd)), 16);
      };
      for (; k + 16 <= K; k += 16) {
        const __m256i lo = round(_mm256_mul_ps(fp8x8(row + k), s8));
        const __m256i hi = round(_mm256_mul_ps(fp8x8(row + k + 8), s8));
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xd8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + k), packed);
      }
    }
    for (; k < K; ++k) y[k] = static_cast<T>(fp8_scalar(row[k]) * 256.0f * s);
  }
}
#endif

bool fp8_linear_supported() {
#ifdef CONVEYOR_FP8_AVX2
  return true;
#else
  return false;
#endif
}

void fp8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  TORCH_CHECK(fp8_linear_supported(), "fp8_linear needs a CPU with AVX2, FMA and F16C");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "fp8_linear: x must be a contiguous [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == K && weight.is_contiguous() && weight.element_size() == 1,
              "fp8_linear: weight must be a contiguous float8_e4m3fn [N, ", K, "]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == N && scale.is_contiguous(),
              "fp8_linear: scale must be a contiguous float32 [", N, "]");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.dim() == 2 && out.size(0) == M && out.size(1) == N &&
                  out.is_contiguous(), "fp8_linear: out must be a contiguous [", M, ", ", N, "] of x's dtype");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->numel() == N && bias->is_contiguous(),
                "fp8_linear: bias must be a contiguous [", N, "] of x's dtype");
#ifdef CONVEYOR_FP8_AVX2
  const auto* w = static_cast<const uint8_t*>(weight.data_ptr());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fp8_linear", [&] {
    const scalar_t* b = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
    run<scalar_t>(x.data_ptr<scalar_t>(), w, scale.data_ptr<float>(), b, out.data_ptr<scalar_t>(), M, N, K);
  });
#endif
}

void fp8_upcast(const at::Tensor& weight, const at::Tensor& scale, at::Tensor& out) {
  TORCH_CHECK(fp8_linear_supported(), "fp8_upcast needs a CPU with AVX2, FMA and F16C");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.element_size() == 1,
              "fp8_upcast: weight must be a contiguous float8_e4m3fn [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == N && scale.is_contiguous(),
              "fp8_upcast: scale must be a contiguous float32 [", N, "]");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == N && out.size(1) == K && out.is_contiguous(),
              "fp8_upcast: out must be a contiguous [", N, ", ", K, "]");
#ifdef CONVEYOR_FP8_AVX2
  const auto* w = static_cast<const uint8_t*>(weight.data_ptr());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "fp8_upcast", [&] {
    scalar_t* y = out.data_ptr<scalar_t>();
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      upcast_rows<scalar_t>(w, scale.data_ptr<float>(), y, n0, n1, K);
    });
  });
#endif
}

}  // namespace

void fp8_linear_into(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, at::Tensor& out) {
  fp8_linear(x, weight, scale, c10::nullopt, out);
}

}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("fp8_linear_supported() -> bool", &conveyor::fp8_linear_supported);
  m.def("fp8_linear(Tensor x, Tensor weight, Tensor scale, Tensor? bias, Tensor(a!) out) -> ()");
  m.def("fp8_upcast(Tensor weight, Tensor scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(conveyor_cpu, CPU, m) {
  m.impl("fp8_linear", &conveyor::fp8_linear);
  m.impl("fp8_upcast", &conveyor::fp8_upcast);
}
