// A linear layer over llama.cpp's quantized blocks, read as the GGUF file stores them:
// y[M, N] = x[M, K] w[N, K]^T (+ bias), w as N rows of GGML blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
// Q6_K), never expanded in memory.
// (This file: the tiles of a few rows and the op; ggml_gemm.cpp: the batched paths; ggml_blocks.h: the
// blocks and x's quantization.)
//
// Why integer dot products: a decode step reads each weight once, so its time is the bytes it reads, and a
// 4-bit block is 5 bits a weight against bf16's 16. Unpacking each block to floats and multiplying in float32
// costs more instructions per weight than the bytes take to arrive; instead each row of x is quantized per
// 32 values to int8 with one scale (llama.cpp's Q8 activations: a relative error of at most 1/254 per value),
// and each 32-value sub-block of the weight, unpacked to bytes once, is multiplied with every row of the step
// by VPMADDUBSW (unsigned x signed bytes, pairs summed) and VPMADDWD: 32 multiply-adds in two instructions.
// So batched decodes and prompt chunks reuse each unpacked block for all their rows rather than unpacking it
// again per row. Formats whose values are unsigned with an offset (Q4_0's -8, Q4_1's min, the K-quants' mins)
// are kept unsigned and their offset applied once per sub-block through the sum of x's quantized values;
// signed ones (Q8_0, Q6_K) move their sign onto x (VPSIGNB).
//
// Steps of a few rows take tiles that unpack each sub-block in registers and multiply it with up to four rows
// at once (their AVX2 path runs on any x86-64 CPU of the last decade). Steps of more rows (batched decodes,
// prompt chunks) take a GEMM: a thread unpacks a panel of 32 output columns once into its cache and multiplies
// every row with it, with VPDPBUSD where the CPU has AVX-512 VNNI (AMD Zen 4, Intel since Ice Lake), else
// VPMADDUBSW; with AMX-INT8 tiles where the CPU has them (Intel since Sapphire Rapids), from the rows at which
// they timed faster at load (conveyor.native.gemm_choice). Weights unpacked to bfloat16 in registers (AVX-512
// BF16) were the other choice, decided by count rather than by a second kernel: VPDPBF16PS does 32 multiply-adds
// an instruction against VPDPBUSD's 64, with the same unpacking, and the kernel is bound by its instructions, not
// by the bytes it reads.
//
// Threads take output columns from a shared counter, so a thread on a core that another process also wants
// does less of the work rather than holding the step back (a static split waits for its slowest share). A
// portable scalar path computes the same integer products (other CPUs; its float sums may differ in their last
// bits from the vector paths, which agree bit for bit); the tests force every path built.
//
// NOTE: 2-core AMD EPYC (Zen 4), SmolLM2's 30 layers of Q4_1 linear weights (as Q4_X2), 2 threads, one run of
// `python benchmarks/quant.py --kernels` (ms a step; VNNI / AVX2 alone / bf16 F.linear over the dequantized
// weights): 1 row 7.7 / 8.5 / 31.0; 16 rows 21.9 / 29.4 / 36.3; 64 rows 67.8 / 92.6 / 59.6; 256 rows
// 147.1 / 283.1 / 175.0; 512 rows 284.7 / 558.6 / 312.5. (This machine's timings vary by up to 2x from run to
// run: compare within a run.) One thread, 512 x 1536 x 576: 118 GMAC/s against bf16's 94. With the tiles'
// prefetch (one tile ahead), another run: 1 row 5.0 / 5.1 / 19.3; 4 rows 9.0 / 8.9 / 22.6; 16 rows 22.4 / 29.5 /
// 33.9.
// With the panels' fetches ahead (ggml_gemm.cpp) and the tiles' into the thread's next chunk, another run: 1 row
// 3.8 / 3.9 / 17.9; 16 rows 14.3 / 20.1 / 25.6; 64 rows 32.2 / 58.7 / 52.3; 256 rows 108.8 / 216.9 / 146.5; 512 rows
// 214.0 / 429.0 / 276.7.
// NOTE: 2-core Xeon with AMX, the same command, one run (VNNI / AMX / bf16 F.linear, oneDNN's AMX): 64 rows
// 46.6 / 45.1 / 27.4 ms; 256 rows 157.2 / 147.9 / 76.2; 512 rows 253.3 / 226.6 / 68.4. AMX gains little here:
// every 32 values have their own scales, so each TDPBSUD (16 rows x 16 columns x 32) is followed by a store of
// its sums and their scaling in AVX-512, where bf16 tiles sum a whole row of K in the tile.
#include <torch/library.h>

#include <string>

#include "ggml_blocks.h"
#include "kernels.h"

namespace conveyor {
namespace {

using namespace ggml;

constexpr int64_t kRowTile = 4;  // rows of x multiplied with each unpacked sub-block
constexpr int64_t kColumns = 4;  // the most output columns unpacked and multiplied together (one row: 4; more: 2)

// Columns a tile of `rows` rows takes: its accumulators (rows x columns) and unpacked weights fit in registers.
inline int64_t tile_columns(int64_t rows) { return rows == 1 ? 4 : 2; }
constexpr int64_t kMinChunk = 16;  // the fewest output columns a thread takes at a time

// The vector tiles fetch the weights kAheadTiles tiles on while they multiply these. NOTE: without it a step of
// one row read the default model's packed layers from memory at 9.9 GB/s and its Q8_0 head at 11.8 (6.7 and 2.5
// ms, 2-core Zen 4, where the same core streams 21 GB/s and two 28): each tile's four rows are only 1.4-3.8 KB of
// memory, too short a run for the hardware's prefetcher to get ahead. With it, 15-16 GB/s and 21-24 GB/s (4.1-4.5
// and 1.3-1.4 ms); one tile ahead and two measured alike, four and eight slower for the layers: their fetches past
// the end of a chunk read the next columns, mostly another thread's. Now the tiles near a chunk's end fetch the
// thread's next chunk (run_work_queue's lookahead): one stream in-process (`LLM.generate`, 400 tokens), six runs
// alternating the builds, 185 -> 207 tok/s on average one tile ahead; then two tiles ahead against one, six runs:
// 1 row 190-234 against 181-225 tok/s, each run faster; 4 rows alike; three tiles no faster than two.
constexpr int64_t kAheadTiles = 2;

// Output columns [n, n + columns) for rows [m0, m0 + rows): sums[r * kColumns + c], offsets included. `ahead`: the
// weights the thread multiplies kAheadTiles tiles later (as many rows from there as this tile has), fetched into
// the cache while it multiplies these.
using Tile = void (*)(const uint8_t* weight, int64_t row_bytes, int64_t n, int64_t columns, const uint8_t* ahead,
                      const QuantizedRows& x, int64_t m0, int64_t rows, int64_t K, float* sums, float* scratch);

// The portable path: each weight row unpacked into scratch, then plain integer dot products.
template <Type t>
void scalar_tile(const uint8_t* weight, int64_t row_bytes, int64_t n, int64_t columns, const uint8_t*,
                 const QuantizedRows& x, int64_t m0, int64_t rows, int64_t K, float* sums, float* scratch) {
  const int64_t subs = K / kSub;
  const Unpacked w{reinterpret_cast<uint8_t*>(scratch), scratch + K / 4, scratch + K / 4 + 8 * subs};
  for (int c = 0; c < columns; ++c) {
    unpack_row<t>(weight + (n + c) * row_bytes, K, w);
    for (int r = 0; r < rows; ++r) {
      const int8_t* xq = x.q.data() + (m0 + r) * K;
      float total = 0.0f;
      for (int64_t s = 0; s < subs; ++s) {
        float sub = 0.0f;
        for (int g = 0; g < 8; ++g) {
          int32_t dot = 0;
          for (int k = 32 * s + 4 * g; k < 32 * s + 4 * g + 4; ++k)
            dot += (kSigned[t] ? int32_t(int8_t(w.q[k])) : int32_t(w.q[k])) * xq[k];
          sub += w.scale[8 * s + g] * float(dot);
        }
        total += x.scale[(m0 + r) * subs + s] * sub + w.offset[s] * x.sum[(m0 + r) * subs + s];
      }
      sums[r * kColumns + c] = total;
    }
  }
}

#ifdef CONVEYOR_AVX2
// The int32 dot products of up to four columns (C of them; lanes: groups of four values) summed per half of
// the register, column c in lane c: low, the first 16 values (lanes 0-3), high, the second 16.
template <int C>
inline void column_sums(const __m256i* d, __m128i* low, __m128i* high) {
  const __m256i zero = _mm256_setzero_si256();
  const __m256i ab = _mm256_hadd_epi32(d[0], C > 1 ? d[1] : zero);
  const __m256i cd = C > 2 ? _mm256_hadd_epi32(d[2], C > 3 ? d[3] : zero) : zero;
  const __m256i sums = _mm256_hadd_epi32(ab, cd);
  *low = _mm256_castsi256_si128(sums);
  *high = _mm256_extracti128_si256(sums, 1);
}

// acc += dots * scale * x's scale, then offset * x's sum: the float arithmetic of every vector path, in this
// order, so that a row's outputs are the same bits in the tiles and in the batched path (panel_tile).
inline __m128 accumulate(__m128 acc, __m128i dots, __m128 scale, __m128 offset, float xd, float xo) {
  acc = _mm_fmadd_ps(_mm_mul_ps(_mm_cvtepi32_ps(dots), scale), _mm_set1_ps(xd), acc);
  return _mm_fmadd_ps(offset, _mm_set1_ps(xo), acc);
}

// R rows x C columns, sizes fixed at compile time so that the accumulators stay in registers. The values are
// multiplied as the batched path stores them (Q8_0's up by 128, Q6_K's by 32: the shift is added to the
// integer sums exactly and taken back by the offset).
template <Type t, int R, int C>
void avx2_tile_fixed(const uint8_t* weight, int64_t row_bytes, int64_t n, const uint8_t* ahead_rows,
                     const QuantizedRows& x, int64_t m0, int64_t K, float* sums) {
  constexpr int64_t values = kBlockValues[t], size = kBlockBytes[t], per_block = values / kSub;
  constexpr int H = kHalves<t>;
  const int64_t subs = K / kSub;
  const __m256i ones = _mm256_set1_epi16(1);
  __m128 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm_setzero_ps();
  const int8_t* xq = x.q.data() + m0 * K;
  for (int64_t blk = 0; blk < K / values; ++blk) {
    const uint8_t* block[C];
    for (int c = 0; c < C; ++c) block[c] = weight + (n + c) * row_bytes + blk * size;
    const char* ahead = reinterpret_cast<const char*>(ahead_rows + C * blk * size);
    for (int64_t line = 0; line < C * size; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    for (int j = 0; j < per_block; ++j) {
      const int64_t s = blk * per_block + j;
      SubBlock w[C];
      __m256i wabs[C];
      float lanes[2][H][4] = {};  // (scales, offsets)
      for (int c = 0; c < C; ++c) {
        w[c] = unpack_sub<t>(block[c], j);
        wabs[c] = kSigned[t] ? _mm256_sign_epi8(w[c].q, w[c].q) : w[c].q;
        float sc[H], of[H];
        vector_scales<t>(w[c], sc, of);
        for (int h = 0; h < H; ++h) lanes[0][h][c] = sc[h], lanes[1][h][c] = of[h];
      }
      // (put together in registers. NOTE: written to memory lane by lane and read back as one vector, they stalled
      // each load, which the CPU cannot forward from four stores. One row of 8192 x 1536 on two threads, 2-core AMD
      // EPYC (AVX2), best of three runs interleaved with the old build's, us: Q4_K 1104 -> 550, Q5_K 873 -> 651,
      // Q5_0 693 -> 580, Q4_1 658 -> 446, Q8_0 641 -> 534, Q6_K 924 -> 960; the default model's Q8_0 head
      // (49152 x 576) 1550 -> 1110.)
      __m128 scale[H], offset[H];
      for (int h = 0; h < H; ++h) {
        scale[h] = _mm_setr_ps(lanes[0][h][0], lanes[0][h][1], lanes[0][h][2], lanes[0][h][3]);
        offset[h] = _mm_setr_ps(lanes[1][h][0], lanes[1][h][1], lanes[1][h][2], lanes[1][h][3]);
      }
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + s * kSub));
        __m256i d[C];
        for (int c = 0; c < C; ++c)
          d[c] = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs[c], kSigned[t] ? _mm256_sign_epi8(xv, w[c].q) : xv), ones);
        __m128i low, high;
        column_sums<C>(d, &low, &high);
        const int64_t i = (m0 + r) * subs + s;
        if constexpr (t == Q6_K) {
          low = _mm_add_epi32(low, _mm_set1_epi32(32 * x.half_isum[2 * i]));
          high = _mm_add_epi32(high, _mm_set1_epi32(32 * x.half_isum[2 * i + 1]));
          acc[r] = accumulate(acc[r], low, scale[0], offset[0], x.scale[i], x.half_sum[2 * i]);
          acc[r] = accumulate(acc[r], high, scale[H - 1], offset[H - 1], x.scale[i], x.half_sum[2 * i + 1]);
        } else {
          __m128i total = _mm_add_epi32(low, high);
          if constexpr (t == Q8_0)
            total = _mm_add_epi32(total, _mm_set1_epi32(128 * (x.half_isum[2 * i] + x.half_isum[2 * i + 1])));
          acc[r] = accumulate(acc[r], total, scale[0], offset[0], x.scale[i], x.sum[i]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(16) float lanes[4];
    _mm_store_ps(lanes, acc[r]);
    for (int c = 0; c < C; ++c) sums[r * kColumns + c] = lanes[c];
  }
}

// x in Q4_X2's order: per row and pair of sub-blocks, their first halves then their second halves (the lanes the
// unit's low and high nibbles fill).
void pair_rows(QuantizedRows& x, int64_t M, int64_t K) {
  const int64_t subs = K / kSub;
  x.paired_q.resize(M * K);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t p = 0; p < subs / 2; ++p) {
      const int8_t* src = x.q.data() + r * K + 64 * p;
      int8_t* dst = x.paired_q.data() + r * K + 64 * p;
      for (int half = 0; half < 2; ++half)
        for (int j = 0; j < 2; ++j) std::memcpy(dst + 32 * half + 16 * j, src + 32 * j + 16 * half, 16);
    }
}

// Q4_X2: a unit's 64 nibbles unpacked with three instructions, its two sub-blocks' sums in the low and high
// halves of one register.
template <int R, int C>
void avx2_tile_q4x2(const uint8_t* weight, int64_t row_bytes, int64_t n, const uint8_t* ahead_rows,
                    const QuantizedRows& x, int64_t m0, int64_t K, float* sums) {
  const int64_t pairs = K / 64, subs = K / kSub;
  const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0f);
  __m128 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m256i lo[C], hi[C];
    // per column [d0, d1, m0, m1], transposed: d0 of each column, d1, m0, m1
    __m128 halves[4] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
    // the weights kAheadTiles tiles on, as far into their run of memory as this tile has come
    const char* ahead = reinterpret_cast<const char*>(ahead_rows + C * 40 * p);
    for (int line = 0; line < C * 40; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    for (int c = 0; c < C; ++c) {
      const uint8_t* unit = weight + (n + c) * row_bytes + 40 * p;
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit));
      lo[c] = _mm256_and_si256(bytes, low4);
      hi[c] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
      halves[c] = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(unit + 32)));
    }
    _MM_TRANSPOSE4_PS(halves[0], halves[1], halves[2], halves[3]);
    for (int r = 0; r < R; ++r) {
      const int64_t row = (m0 + r) * K + 64 * p;
      const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.paired_q.data() + row));
      const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.paired_q.data() + row + 32));
      __m256i d[C];
      for (int c = 0; c < C; ++c)
        d[c] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo[c], xa), _mm256_maddubs_epi16(hi[c], xb)),
                                 ones);
      __m128i first, second;
      column_sums<C>(d, &first, &second);
      const int64_t i = (m0 + r) * subs + 2 * p;
      acc[r] = accumulate(acc[r], first, halves[0], halves[2], x.scale[i], x.sum[i]);
      acc[r] = accumulate(acc[r], second, halves[1], halves[3], x.scale[i + 1], x.sum[i + 1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(16) float lanes[4];
    _mm_store_ps(lanes, acc[r]);
    for (int c = 0; c < C; ++c) sums[r * kColumns + c] = lanes[c];
  }
}

template <Type t>
void avx2_tile(const uint8_t* weight, int64_t row_bytes, int64_t n, int64_t columns, const uint8_t* ahead,
               const QuantizedRows& x, int64_t m0, int64_t rows, int64_t K, float* sums, float*) {
  static_assert(kRowTile == 4 && kColumns == 4, "the table below covers 1-4 rows and tile_columns");
  using Fixed = void (*)(const uint8_t*, int64_t, int64_t, const uint8_t*, const QuantizedRows&, int64_t, int64_t,
                         float*);
  if constexpr (t == Q4_X2) {
    static constexpr Fixed tiles[kRowTile][kColumns] = {
        {avx2_tile_q4x2<1, 1>, avx2_tile_q4x2<1, 2>, avx2_tile_q4x2<1, 3>, avx2_tile_q4x2<1, 4>},
        {avx2_tile_q4x2<2, 1>, avx2_tile_q4x2<2, 2>, nullptr, nullptr},
        {avx2_tile_q4x2<3, 1>, avx2_tile_q4x2<3, 2>, nullptr, nullptr},
        {avx2_tile_q4x2<4, 1>, avx2_tile_q4x2<4, 2>, nullptr, nullptr}};
    tiles[rows - 1][columns - 1](weight, row_bytes, n, ahead, x, m0, K, sums);
  } else {
    static constexpr Fixed tiles[kRowTile][kColumns] = {
        {avx2_tile_fixed<t, 1, 1>, avx2_tile_fixed<t, 1, 2>, avx2_tile_fixed<t, 1, 3>, avx2_tile_fixed<t, 1, 4>},
        {avx2_tile_fixed<t, 2, 1>, avx2_tile_fixed<t, 2, 2>, nullptr, nullptr},
        {avx2_tile_fixed<t, 3, 1>, avx2_tile_fixed<t, 3, 2>, nullptr, nullptr},
        {avx2_tile_fixed<t, 4, 1>, avx2_tile_fixed<t, 4, 2>, nullptr, nullptr}};
    tiles[rows - 1][columns - 1](weight, row_bytes, n, ahead, x, m0, K, sums);
  }
}
#endif

Tile pick_tile(Type t, bool vector) {
  static constexpr Tile scalar[kNumTypes] = {scalar_tile<Q4_0>, scalar_tile<Q4_1>, scalar_tile<Q5_0>,
                                             scalar_tile<Q5_1>, scalar_tile<Q8_0>, scalar_tile<Q4_K>,
                                             scalar_tile<Q5_K>, scalar_tile<Q6_K>, scalar_tile<Q4_X2>};
#ifdef CONVEYOR_AVX2
  static constexpr Tile avx2[kNumTypes] = {avx2_tile<Q4_0>, avx2_tile<Q4_1>, avx2_tile<Q5_0>, avx2_tile<Q5_1>,
                                           avx2_tile<Q8_0>, avx2_tile<Q4_K>, avx2_tile<Q5_K>, avx2_tile<Q6_K>,
                                           avx2_tile<Q4_X2>};
  if (vector) return avx2[t];
#endif
  return scalar[t];
}

template <typename T>
void run(const T* x, const uint8_t* weight, Type t, int64_t M, int64_t N, int64_t K, const T* bias, T* out,
         Path path, bool row_scales) {
  if (row_scales && run_rows_gemm(x, weight, M, N, K, bias, out, path)) return;
  QuantizedRows xq;
  quantize_rows(x, M, K, xq);
  if (run_gemm(weight, t, M, N, K, xq, bias, out, path)) return;
#ifdef CONVEYOR_AVX2
  if (t == Q4_X2 && path >= kAvx2) pair_rows(xq, M, K);
#endif
  const bool vector = path >= kAvx2;
  const int64_t row_bytes = K / kBlockValues[t] * kBlockBytes[t], subs = K / kSub;
  const Tile tile = pick_tile(t, vector);
  // the scalar path's scratch: one unpacked row (bytes, then 8 scales and an offset per sub-block)
  const int64_t scratch_floats = vector ? 0 : K / 4 + subs * 9;
  // About eight chunks a thread: enough to even out a slow thread, long enough runs of memory for the
  // hardware's prefetcher (16-column chunks of SmolLM2's 49,152-row head read 2.6 ms with one thread and 2.2
  // with two; whole eighths, 1.4). Each row tile walks its chunk's weights again, so with more rows than one
  // tile a chunk is also kept small enough (128 KB) to stay in the core's cache from one tile to the next.
  int64_t chunk_columns = (N / (8 * num_threads()) + 3) / 4 * 4;
  if (M > kRowTile) chunk_columns = std::min(chunk_columns, (int64_t(128) << 10) / row_bytes / 4 * 4);
  chunk_columns = std::max(kMinChunk, chunk_columns);
  const int64_t chunks = (N + chunk_columns - 1) / chunk_columns;
  auto visit = [&](int64_t chunk, int64_t next_chunk, float* scratch) {
    float sums[kRowTile * kColumns];
    const int64_t n_begin = chunk * chunk_columns, n_end = std::min(N, n_begin + chunk_columns);
    for (int64_t m0 = 0; m0 < M; m0 += kRowTile) {
      const int64_t rows = std::min<int64_t>(kRowTile, M - m0);
      for (int64_t n = n_begin; n < n_end; n += tile_columns(rows)) {
        const int64_t columns = std::min<int64_t>(tile_columns(rows), n_end - n);
        // the tile kAheadTiles on: in this chunk, or its first again for the next rows (in the cache), or in the
        // thread's next chunk (this tile's own columns where there is none)
        int64_t ahead = n + kAheadTiles * columns;
        if (ahead >= n_end)
          ahead = m0 + kRowTile < M ? n_begin : next_chunk >= 0 ? next_chunk * chunk_columns + ahead - n_end : n;
        if (ahead >= N) ahead = n;
        tile(weight, row_bytes, n, columns, weight + ahead * row_bytes, xq, m0, rows, K, sums, scratch);
        for (int r = 0; r < rows; ++r)
          for (int c = 0; c < columns; ++c) {
            const float b = bias ? to_float(bias[n + c]) : 0.0f;
            store(out + (m0 + r) * N + n + c, sums[r * kColumns + c] + b);
          }
      }
    }
  };
  // a step of a few rows streams the weights once: a small layer is one thread's work (common.h, kSoloBytes)
  run_work_queue(chunks, scratch_floats, visit, M <= kRowTile ? N * row_bytes : -1);
}

// The fastest path built here: "amx", "avx512_vnni", "avx2" or "scalar".
std::string ggml_linear_path() {
#if defined(CONVEYOR_AMX_INT8) && defined(CONVEYOR_AVX2)
  if (amx_permitted()) return "amx";
#endif
#if defined(CONVEYOR_AVX512_VNNI) && defined(CONVEYOR_AVX2)
  return "avx512_vnni";
#elif defined(CONVEYOR_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

void ggml_linear(const at::Tensor& x, const at::Tensor& weight, int64_t type, const c10::optional<at::Tensor>& bias,
                 at::Tensor& out, const std::string& path) {
  TORCH_CHECK(type >= 0 && type <= kQ8_0Rows, "ggml_linear: unknown type ", type);
  const bool row_scales = type == kQ8_0Rows;
  const Type t = row_scales ? Q8_0 : static_cast<Type>(type);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "ggml_linear: x must be a contiguous [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(K % kBlockValues[t] == 0, "ggml_linear: K = ", K, " is not a multiple of the type's ",
              kBlockValues[t], " values a block");
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.is_contiguous() &&
                  weight.size(1) == K / kBlockValues[t] * kBlockBytes[t],
              "ggml_linear: weight must be a contiguous uint8 [N, ", K / kBlockValues[t] * kBlockBytes[t], "]");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.dim() == 2 && out.size(0) == M && out.size(1) == N &&
                  out.is_contiguous(), "ggml_linear: out must be a contiguous [", M, ", ", N, "] of x's dtype");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->numel() == N && bias->is_contiguous(),
                "ggml_linear: bias must be a contiguous [", N, "] of x's dtype");
  const std::string best = ggml_linear_path();
  const std::vector<std::string> names = {"scalar", "avx2", "avx512_vnni", "amx"};
  const int64_t chosen = std::find(names.begin(), names.end(), path) - names.begin();
  TORCH_CHECK(chosen <= std::find(names.begin(), names.end(), best) - names.begin(), "ggml_linear: path ", path,
              " is not built here; built: scalar up to ", best);
  const uint8_t* w = weight.data_ptr<uint8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "ggml_linear", [&] {
    const scalar_t* b = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
    run<scalar_t>(x.data_ptr<scalar_t>(), w, t, M, N, K, b, out.data_ptr<scalar_t>(), static_cast<Path>(chosen),
                  row_scales);
  });
}

}  // namespace

void ggml_linear_into(const at::Tensor& x, const at::Tensor& weight, int64_t type, at::Tensor& out) {
  ggml_linear(x, weight, type, c10::nullopt, out, ggml_linear_path());
}

}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor_cpu, m) {
  m.def("ggml_linear_path() -> str", &conveyor::ggml_linear_path);
  m.def("ggml_amx_min_rows() -> int", &conveyor::ggml::amx_min_rows);
  m.def("ggml_set_amx_min_rows(int rows) -> ()", &conveyor::ggml::set_amx_min_rows);
  m.def("ggml_linear(Tensor x, Tensor weight, int type, Tensor? bias, Tensor(a!) out, str path) -> ()");
}

TORCH_LIBRARY_IMPL(conveyor_cpu, CPU, m) { m.impl("ggml_linear", &conveyor::ggml_linear); }
