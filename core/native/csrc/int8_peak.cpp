// The peak of this CPU's int8 dot products: byte multiply-adds per second on every thread when nothing but the
// products runs (independent accumulators in registers, no memory). The packed-block kernels (ggml_gemm.cpp) do
// the same products and more besides (unpacking weights, quantizing x, applying each block's scales), so their
// rate over this one is how much of the arithmetic they leave unused (`conveyor profile`, benchmarks/quant.py
// --kernels). One loop per path, as ggml_linear names them: AVX2 (VPMADDUBSW, VPMADDWD, VPADDD: 32 products a
// register), AVX-512 VNNI (VPDPBUSD: 64), AMX (TDPBUSD: a 16 x 16 x 64 tile product).
// NOTE: 2-core AMD EPYC (Zen 4: 512-bit instructions in two 256-bit halves), 2026-12-07: avx512_vnni 926 GOP/s,
// avx2 453 (a multiply-add counted as two operations; on AVX2 VPMADDUBSW and VPMADDWD each take a multiplier);
// the kernels' Q4_0 GEMM at 512 x 4096 x 4096 reached 591 and 271 of them (64% and 60%).
#include <torch/library.h>

#include <string>

#include "ggml_blocks.h"

namespace conveyor {
namespace {

// Each thread's operations (a multiply-add counted as two) in `iterations` turns of its loop. The results are
// written to `sink` so that nothing is left unused for the compiler to remove.
using Loop = int64_t (*)(int64_t iterations, int32_t* sink);

int64_t scalar_loop(int64_t iterations, int32_t* sink) {
  // (what ggml_linear's scalar path does a value at a time: eight chains, as the vector loops)
  int32_t acc[8] = {};
  uint8_t w = 3;
  int8_t x = 5;
  for (int64_t i = 0; i < iterations; ++i) {
    asm volatile("" : "+r"(w), "+r"(x));
    for (int a = 0; a < 8; ++a) acc[a] += int32_t(uint8_t(w + a)) * x;
  }
  for (int a = 0; a < 8; ++a) sink[a] = acc[a];
  return iterations * 8 * 2;
}

#ifdef CONVEYOR_AVX2
int64_t avx2_loop(int64_t iterations, int32_t* sink) {
  // eight chains from two weights and four inputs: eight different products a turn (VPMADDUBSW takes 4-5 cycles
  // and two can start each cycle); the empty asm makes the compiler recompute them every turn
  __m256i acc[8], w[2], x[4];
  const __m256i ones = _mm256_set1_epi16(1);
  for (int a = 0; a < 8; ++a) acc[a] = _mm256_setzero_si256();
  for (int j = 0; j < 2; ++j) w[j] = _mm256_set1_epi8(char(1 + j));
  for (int j = 0; j < 4; ++j) x[j] = _mm256_set1_epi8(char(1 + j));
  for (int64_t i = 0; i < iterations; ++i) {
    asm volatile("" : "+x"(w[0]), "+x"(w[1]));
    for (int a = 0; a < 8; ++a)
      acc[a] = _mm256_add_epi32(acc[a], _mm256_madd_epi16(_mm256_maddubs_epi16(w[a / 4], x[a % 4]), ones));
  }
  for (int a = 0; a < 8; ++a) _mm256_storeu_si256(reinterpret_cast<__m256i*>(sink + 8 * a), acc[a]);
  return iterations * 8 * 32 * 2;
}
#endif

#ifdef CONVEYOR_AVX512_VNNI
int64_t vnni_loop(int64_t iterations, int32_t* sink) {
  // twelve chains: VPDPBUSD's latency (4-5 cycles) times the products that can start each cycle, with room
  __m512i acc[12];
  const __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
  for (int a = 0; a < 12; ++a) acc[a] = _mm512_setzero_si512();
  for (int64_t i = 0; i < iterations; ++i)
    for (int a = 0; a < 12; ++a) acc[a] = _mm512_dpbusd_epi32(acc[a], w, x);
  for (int a = 0; a < 12; ++a) _mm512_storeu_si512(sink + 16 * a, acc[a]);
  return iterations * 12 * 64 * 2;
}
#endif

#ifdef CONVEYOR_AMX_INT8
int64_t amx_loop(int64_t iterations, int32_t* sink) {
  // four sums of 16 x 16 int32 (tiles 0-3) from two A tiles (4, 5: 16 rows of 64 bytes) and two B tiles (6, 7:
  // 16 rows of four bytes for each of 16 columns): four independent products a turn
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  load_tile_config(config);
  alignas(64) uint8_t bytes[16 * 64];
  std::memset(bytes, 1, sizeof(bytes));
  // (tile numbers are part of each instruction: written out, not looped over)
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, bytes, 64);
  _tile_loadd(5, bytes, 64);
  _tile_loadd(6, bytes, 64);
  _tile_loadd(7, bytes, 64);
  for (int64_t i = 0; i < iterations; ++i) {
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(1, 4, 7);
    _tile_dpbusd(2, 5, 6);
    _tile_dpbusd(3, 5, 7);
  }
  _tile_stored(0, sink, 64);
  _tile_stored(1, sink, 64);
  _tile_stored(2, sink, 64);
  _tile_stored(3, sink, 64);
  _tile_release();
  return iterations * 4 * 16 * 16 * 64 * 2;
}
#endif

// Every thread runs the path's loop `iterations` times at once; returns the operations done in all.
int64_t int8_peak_ops(const std::string& path, int64_t iterations) {
  TORCH_CHECK(iterations > 0, "int8_peak_ops: iterations must be positive, not ", iterations);
  Loop loop = nullptr;
  if (path == "scalar") loop = scalar_loop;
#ifdef CONVEYOR_AVX2
  if (path == "avx2") loop = avx2_loop;
#endif
#ifdef CONVEYOR_AVX512_VNNI
  if (path == "avx512_vnni") loop = vnni_loop;
#endif
#ifdef CONVEYOR_AMX_INT8
  if (path == "amx" && amx_permitted()) loop = amx_loop;
#endif
  TORCH_CHECK(loop != nullptr, "int8_peak_ops: path ", path, " is not built here");
  const int64_t threads = at::get_num_threads();
  std::atomic<int64_t> ops{0};
  // (one chunk a thread: at::parallel_for hands each of ATen's threads one index)
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    alignas(64) int32_t sink[16 * 16 * 4];
    for (int64_t t = begin; t < end; ++t) ops += loop(iterations, sink);
  });
  return ops.load();
}

}  // namespace
}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) { m.def("int8_peak_ops(str path, int iterations) -> int",
                                                &conveyor::int8_peak_ops); }
