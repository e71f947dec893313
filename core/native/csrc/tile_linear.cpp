// A decode step through a bfloat16 linear layer with AMX tiles: y[M, N] = x[M, K] w[N, K]^T (+ bias), M <= 64.
//
// A decode step of up to 64 sequences reads every weight once and does at most
// 128 flops per weight: on a CPU with AMX it is bound by memory bandwidth.
// oneDNN's prepacked matmul streams a model's layers at 10-19 GB/s at these
// sizes (its worst between multiples of 16 rows); this kernel walks each
// thread's share of the output columns front to back, 16 at a time, through a
// copy of the weight laid out as AMX B tiles, so each thread reads its part of
// the weight once, in order. Larger batches stay with oneDNN.
//
// Tiles layout [N / 16, K / 32, 16, 32]: element [j, c, r, 2 n + i] = w[16 j + n, 32 c + 2 r + i] (the pairs
// of K that TDPBF16PS multiplies, 16 output columns to a 1 KiB tile, a column block's tiles back to back).
#include <torch/library.h>

#include "common.h"

#if defined(CONVEYOR_AVX512_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define CONVEYOR_AMX 1
#endif

namespace conveyor {
namespace {

constexpr int64_t kMaxRows = 64;  // four tiles of 16 rows

#ifdef CONVEYOR_AMX
// Tiles 0-3: the sums of row tiles 0-3 (the last one `tail` rows); 4: the weight; 5: a full row tile of x,
// 6: the last (tail rows).
void configure(int64_t tail, int64_t row_tiles) {
  TileConfig config;
  for (int t = 0; t < 7; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  config.rows[row_tiles - 1] = static_cast<uint8_t>(tail);
  config.rows[6] = static_cast<uint8_t>(tail);
  load_tile_config(config);
}

// Sums tile `sum` += rows of x (loaded into tile `held`) times the weight tile (tile 4). A macro: GCC's tile
// intrinsics paste their tile numbers into the assembly, so they must be literals.
#define CONVEYOR_MULTIPLY(sum, held, rows, stride) \
  do {                                           \
    _tile_loadd(held, rows, stride);             \
    _tile_dpbf16ps(sum, held, 4);                \
  } while (0)

// One block of 16 output columns for all rows; kTiles row tiles of x, the last one in tile 6.
template <int kTiles>
void column_block(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t M, int64_t N,
                  int64_t K, int64_t block, float* sums) {
  _tile_zero(0);
  if (kTiles > 1) _tile_zero(1);
  if (kTiles > 2) _tile_zero(2);
  if (kTiles > 3) _tile_zero(3);
  const uint16_t* tiles = w + block * 16 * K;
  const int64_t stride = K * 2;  // bytes between rows of x
  for (int64_t c = 0; c < K / 32; ++c) {
    if (kTiles == 1) {  // one row tile leaves the loads idle enough to fetch the stream well ahead
      const char* ahead = reinterpret_cast<const char*>(tiles + (c + 8) * 512);
      for (int line = 0; line < 16; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
    }
    _tile_loadd(4, tiles + c * 512, 64);
    // full row tiles of x in tile 5, the last one (tail rows) in tile 6
    const uint16_t* xc = x + c * 32;
    if (kTiles == 1) CONVEYOR_MULTIPLY(0, 6, xc, stride);
    if (kTiles >= 2) CONVEYOR_MULTIPLY(0, 5, xc, stride);
    if (kTiles == 2) CONVEYOR_MULTIPLY(1, 6, xc + 16 * K, stride);
    if (kTiles >= 3) CONVEYOR_MULTIPLY(1, 5, xc + 16 * K, stride);
    if (kTiles == 3) CONVEYOR_MULTIPLY(2, 6, xc + 32 * K, stride);
    if (kTiles == 4) {
      CONVEYOR_MULTIPLY(2, 5, xc + 32 * K, stride);
      CONVEYOR_MULTIPLY(3, 6, xc + 48 * K, stride);
    }
  }
  _tile_stored(0, sums, 64);
  if (kTiles > 1) _tile_stored(1, sums + 256, 64);
  if (kTiles > 2) _tile_stored(2, sums + 512, 64);
  if (kTiles > 3) _tile_stored(3, sums + 768, 64);
  const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                              _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + block * 16))), 16))
                        : _mm512_setzero_ps();
  for (int64_t m = 0; m < M; ++m) {
    const __m256bh row = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(sums + m * 16), b));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * N + block * 16), (__m256i)row);
  }
}
#endif

bool tile_linear_supported() {
#ifdef CONVEYOR_AMX
  return amx_permitted();
#else
  return false;
#endif
}

void tile_linear(const at::Tensor& x, const at::Tensor& tiles, const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  TORCH_CHECK(tile_linear_supported(), "tile_linear needs a CPU with AMX-BF16 (and a kernel that grants it)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && tiles.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16, "tile_linear: tensors must be bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(0) >= 1 && x.size(0) <= kMaxRows,
              "tile_linear: x must be a contiguous [M, K] with 1 <= M <= ", kMaxRows);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(tiles.dim() == 4 && tiles.is_contiguous() && tiles.size(1) * 32 == K && tiles.size(2) == 16 &&
                  tiles.size(3) == 32, "tile_linear: tiles must be a contiguous [N / 16, K / 32, 16, 32] with K = ", K);
  const int64_t N = tiles.size(0) * 16;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == N && out.is_contiguous(),
              "tile_linear: out must be a contiguous [", M, ", ", N, "]");
  const uint16_t* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == N && bias->is_contiguous(),
                "tile_linear: bias must be a contiguous bfloat16 [", N, "]");
    b = reinterpret_cast<const uint16_t*>(bias->data_ptr());
  }
#ifdef CONVEYOR_AMX
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(tiles.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t row_tiles = (M + 15) / 16, tail = M - 16 * (row_tiles - 1);
  // contiguous runs of column blocks per thread: each thread streams its part of the weight in order
  at::parallel_for(0, N / 16, 8, [&](int64_t first, int64_t last) {
    configure(tail, row_tiles);
    alignas(64) float sums[kMaxRows * 16];
    for (int64_t block = first; block < last; ++block) {
      switch (row_tiles) {
        case 1: column_block<1>(xp, wp, b, yp, M, N, K, block, sums); break;
        case 2: column_block<2>(xp, wp, b, yp, M, N, K, block, sums); break;
        case 3: column_block<3>(xp, wp, b, yp, M, N, K, block, sums); break;
        default: column_block<4>(xp, wp, b, yp, M, N, K, block, sums); break;
      }
    }
    _tile_release();
  });
#endif
}

}  // namespace
}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("tile_linear_supported() -> bool", &conveyor::tile_linear_supported);
  m.def("tile_linear(Tensor x, Tensor tiles, Tensor? bias, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(conveyor_cpu, CPU, m) { m.impl("tile_linear", &conveyor::tile_linear); }
