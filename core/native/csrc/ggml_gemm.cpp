// The batched paths of ggml_linear (ggml_blocks.h): steps of many rows (batched decodes, prompt chunks), where
// each unpacked panel of weights serves every row of the step. ggml_linear.cpp's opening comment says why
// integer products, and measures them.
#include "ggml_blocks.h"

namespace conveyor {
namespace ggml {

namespace {
std::atomic<int64_t> g_amx_min_rows{32};
}  // namespace

int64_t amx_min_rows() { return g_amx_min_rows.load(std::memory_order_relaxed); }

void set_amx_min_rows(int64_t rows) { g_amx_min_rows.store(std::max<int64_t>(1, rows), std::memory_order_relaxed); }

namespace {

#ifdef CONVEYOR_AVX2
// The batched path: steps of kGemmRows rows or more. Each thread unpacks a panel of kPanel output columns once
// into its scratch, bytes in the order the integer dot products read them (per sub-block and group of four
// values, the panel's columns side by side, four bytes each), then multiplies every row of the step with it:
// one register of weights serves 16 columns (AVX-512 VNNI: VPDPBUSD) or 8 (AVX2: VPMADDUBSW + VPMADDWD) of a
// tile of rows, x's four bytes broadcast. Unsigned values throughout: Q8_0's bytes move up by 128 and Q6_K's
// by 32, their offsets taking the difference back, so one code path serves every type. (AVX2's VPMADDUBSW
// saturates sums of two products past 32,767: Q8_0's bytes up to 255 do, so Q8_0 keeps the tiles there.)
constexpr int64_t kPanel = 32;     // output columns a panel holds
// the fewest rows the batched path takes (below them the tiles, which unpack the weights again for every four
// rows, measured faster: with AVX2 alone 14.7 against 12.8 ms at 8 rows, 21.2 against 25 at 16, SmolLM2's
// layers, Zen 4. With VNNI the panels win from 3 rows: a 1B model's 8192 x 2048 Q4_0 layer, Zen 4, one run, 2 rows
// 0.47 against 0.46 ms in tiles, 3 rows 0.49 against 0.78, 5 rows 0.53 against 1.04, 7 rows 0.63 against 1.56).
// AMX takes over from amx_min_rows(), measured at load: 32 at first (below them VPDPBUSD was the faster: Xeon
// with AMX, one Q4_0 layer of 3072 x 576, 24 rows 187 us against 212, 32 rows 229 against 210), but both panels
// since fetch ahead, and which wins by how much varies with the CPU and the layer.
constexpr int64_t kGemmRows = 3, kGemmRowsAvx2 = 16;

// The scratch a panel takes, in floats: its bytes, then per sub-block (half) and column a scale and an offset.
inline int64_t panel_floats(int64_t K) { return kPanel * K / 4 + 2 * 2 * (K / kSub) * kPanel; }

// Eight registers of eight 32-bit lanes transposed in place: lane g of register c goes to lane c of register g.
inline void transpose_8x8(__m256i* r) {
  __m256i a[8], b[8];
  for (int i = 0; i < 8; i += 2) {
    a[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    a[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4)
    for (int j = 0; j < 2; ++j) {
      b[i + j] = _mm256_unpacklo_epi64(a[i + j], a[i + j + 2]);
      b[i + j + 2] = _mm256_unpackhi_epi64(a[i + j], a[i + j + 2]);
    }
  // b[0..3]: lanes 0-1 / 4-5 of registers 0-3 (128-bit halves: lanes 0-3, 4-7); b[4..7] the same for 4-7
  const int order[4] = {0, 2, 1, 3};  // (b[0] holds lanes 0 and 4, b[2] lanes 1 and 5, b[1] 2 and 6, b[3] 3 and 7)
  for (int g = 0; g < 4; ++g) {
    r[g] = _mm256_permute2x128_si256(b[order[g]], b[4 + order[g]], 0x20);
    r[g + 4] = _mm256_permute2x128_si256(b[order[g]], b[4 + order[g]], 0x31);
  }
}

// Columns [n, n + kPanel) unpacked into scratch (those past N repeat column N - 1): per sub-block, eight rows of
// four values, each the panel's columns side by side (eight columns' sub-blocks transposed in registers at once).
// NOTE: one four-byte copy per group instead took 40% of a step of 16 rows (perf, Q8_0 blocks, Xeon with AMX):
// SmolLM2's 210 layers at 16 rows went from 19.9-23.6 to 14.8-16.8 ms (Q4_X2) and 22.4-23.9 to 19.6-21.3 (Q8_0),
// two runs alternating the builds.
// Each row's blocks are fetched kUnpackAhead bytes ahead of their unpacking: 32 rows read side by side are more
// streams than the hardware's prefetcher follows.
// NOTE: 2-core AMD EPYC (Zen 4), SmolLM2's 210 layers (best of 7 steps, three runs alternating the builds), ms at
// 16 / 64 rows: int8's Q8_0 blocks 24.0 / 50.2 -> 19.3 / 44.7; Q4_X2 19.4 / 44.7 -> 17.6 / 43.0. 64 bytes ahead
// measured as 128, 192 to 1024 slower.
constexpr int64_t kUnpackAhead = 128;

template <Type t>
void unpack_panel(const uint8_t* weight, int64_t row_bytes, int64_t n, int64_t N, int64_t K, float* scratch) {
  constexpr int64_t values = kBlockValues[t], size = kBlockBytes[t], per_block = values / kSub;
  constexpr int H = kHalves<t>;
  const int64_t subs = K / kSub;
  uint8_t* q = reinterpret_cast<uint8_t*>(scratch);
  float* scale = scratch + kPanel * K / 4;
  float* offset = scale + H * subs * kPanel;
  const uint8_t* rows[kPanel];
  for (int64_t c = 0; c < kPanel; ++c) rows[c] = weight + std::min(n + c, N - 1) * row_bytes;
  const int64_t ahead = (kUnpackAhead + size - 1) / size;  // in blocks
  for (int64_t blk = 0; blk < K / values; ++blk)
    for (int j = 0; j < per_block; ++j) {
      const int64_t s = blk * per_block + j;
      if (j == 0 && blk + ahead < K / values)
        for (int64_t c = 0; c < kPanel; ++c)
          _mm_prefetch(reinterpret_cast<const char*>(rows[c] + (blk + ahead) * size), _MM_HINT_T0);
      for (int64_t c0 = 0; c0 < kPanel; c0 += 8) {
        __m256i v[8];
        for (int c = 0; c < 8; ++c) {
          const SubBlock sub = unpack_sub<t>(rows[c0 + c] + blk * size, j);
          v[c] = sub.q;
          if constexpr (t == Q8_0) v[c] = _mm256_xor_si256(v[c], _mm256_set1_epi8(char(0x80)));  // w + 128
          if constexpr (t == Q6_K) v[c] = _mm256_add_epi8(v[c], _mm256_set1_epi8(32));           // 0-63
          float sc[H], of[H];
          vector_scales<t>(sub, sc, of);
          for (int h = 0; h < H; ++h)
            scale[(H * s + h) * kPanel + c0 + c] = sc[h], offset[(H * s + h) * kPanel + c0 + c] = of[h];
        }
        transpose_8x8(v);
        for (int g = 0; g < 8; ++g)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + ((s * 8 + g) * kPanel + c0) * 4), v[g]);
      }
    }
}

// The weights of the panel a thread unpacks next, fetched into its cache a share at a time while it multiplies this
// panel's rows (which read only the unpacked panel, leaving the memory idle), so that the next unpacking finds them
// there rather than waiting for memory with nothing to compute.
// NOTE: 2-core AMD EPYC (Zen 4), int8's Q8_0 blocks, SmolLM2's 210 layers, with kUnpackAhead (best of 7 steps, four
// runs alternating the builds), ms at 16 / 64 rows: 18.9-19.9 / 44.9-49.2 -> 18.1-18.5 / 42.3-42.4. Into the L2
// cache alone (_MM_HINT_T1) it measured slower at 64 rows. (The AMX path does the same; not yet measured on a Xeon.)
class PanelAhead {
 public:
  // next: the first column of the thread's next panel (-1: none); shares: the calls of fetch() to spread it over
  PanelAhead(const uint8_t* weight, int64_t row_bytes, int64_t next, int64_t N, int64_t shares)
      : lines_(next < 0 ? 0 : row_bytes / 64 + 2), per_share_((lines_ + shares - 1) / shares) {
    for (int64_t c = 0; c < kPanel && lines_ > 0; ++c) {
      const uintptr_t row = reinterpret_cast<uintptr_t>(weight + std::min(next + c, N - 1) * row_bytes);
      rows_[c] = reinterpret_cast<const char*>(row & ~uintptr_t(63));  // (lines_ covers the row from its first line)
    }
  }

  // The next share of every row's lines.
  void fetch() {
    const int64_t end = std::min(lines_, done_ + per_share_);
    for (int64_t c = 0; c < kPanel && done_ < end; ++c)
      for (int64_t line = done_; line < end; ++line) _mm_prefetch(rows_[c] + 64 * line, _MM_HINT_T0);
    done_ = end;
  }

 private:
  const char* rows_[kPanel];
  int64_t lines_, per_share_, done_ = 0;
};

// The vector operations of the batched path: L columns a register, tiles of R rows x C registers.
struct Avx2Lanes {
  static constexpr int L = 8, R = 4, C = 1;
  using I = __m256i;
  using F = __m256;
  static I izero() { return _mm256_setzero_si256(); }
  static F fzero() { return _mm256_setzero_ps(); }
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I broadcast(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }
  static I dot(I acc, I w, I x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
  }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static void storef(float* p, F v) { _mm256_storeu_ps(p, v); }
};

#ifdef CONVEYOR_AVX512_VNNI
struct VnniLanes {
  static constexpr int L = 16, R = 6, C = 2;
  using I = __m512i;
  using F = __m512;
  static I izero() { return _mm512_setzero_si512(); }
  static F fzero() { return _mm512_setzero_ps(); }
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I broadcast(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  static I dot(I acc, I w, I x) { return _mm512_dpbusd_epi32(acc, w, x); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static void storef(float* p, F v) { _mm512_storeu_ps(p, v); }
};
#endif

// Rows [m0, m0 + R) x the panel's columns [col0, col0 + L * C) into sums[r * kPanel + column].
template <Type t, typename V, int R>
void panel_tile(const float* scratch, int64_t col0, int64_t K, const QuantizedRows& x, int64_t m0, float* sums) {
  constexpr int C = V::C, L = V::L, H = kHalves<t>;
  const int64_t subs = K / kSub;
  const uint8_t* q = reinterpret_cast<const uint8_t*>(scratch) + col0 * 4;
  const float* scale = scratch + kPanel * K / 4 + col0;
  const float* offset = scale + H * subs * kPanel;
  const int8_t* xq = x.q.data() + m0 * K;
  typename V::F acc[R][C];
  typename V::I dots[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = V::fzero(), dots[r][c] = V::izero();
  for (int64_t s = 0; s < subs; ++s)
    for (int h = 0; h < H; ++h) {
      // (unrolled: GCC otherwise copied every accumulator between registers around each product; Zen 4, SmolLM2's
      // layers as Q4_X2, 64 and 256 rows 3% faster)
#pragma GCC unroll 8
      for (int g = 8 / H * h; g < 8 / H * (h + 1); ++g) {
        typename V::I w[C];
        for (int c = 0; c < C; ++c) w[c] = V::load(q + ((s * 8 + g) * kPanel + c * L) * 4);
        for (int r = 0; r < R; ++r) {
          const typename V::I xv = V::broadcast(xq + r * K + s * kSub + 4 * g);
          for (int c = 0; c < C; ++c) dots[r][c] = V::dot(dots[r][c], w[c], xv);
        }
      }
      typename V::F ws[C], wo[C];
      for (int c = 0; c < C; ++c)
        ws[c] = V::loadf(scale + (s * H + h) * kPanel + c * L), wo[c] = V::loadf(offset + (s * H + h) * kPanel + c * L);
      for (int r = 0; r < R; ++r) {
        const int64_t i = (m0 + r) * subs + s;
        const typename V::F xd = V::set1(x.scale[i]), xo = V::set1(H == 1 ? x.sum[i] : x.half_sum[2 * i + h]);
        for (int c = 0; c < C; ++c) {
          acc[r][c] = V::fma(V::mul(V::cvt(dots[r][c]), ws[c]), xd, acc[r][c]);
          acc[r][c] = V::fma(wo[c], xo, acc[r][c]);
          dots[r][c] = V::izero();
        }
      }
    }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) V::storef(sums + r * kPanel + col0 + c * L, acc[r][c]);
}

// sums[r * kPanel + c] of a panel's columns [n, n + kPanel), rows out[r * N ...]: those below N, bias added.
template <typename T>
void store_panel(const float* sums, int64_t rows, int64_t n, int64_t N, const T* bias, T* out) {
  const int64_t columns = std::min(kPanel, N - n);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < columns; ++c)
      store(out + r * N + n + c, sums[r * kPanel + c] + (bias ? to_float(bias[n + c]) : 0.0f));
}

// Every row of x times columns [n, n + kPanel) (those below N stored, bias added).
template <typename T, Type t, typename V>
void panel_columns(const uint8_t* weight, int64_t row_bytes, int64_t n, int64_t next, int64_t N, int64_t K,
                   const QuantizedRows& x, int64_t M, const T* bias, T* out, float* scratch) {
  using Tile = void (*)(const float*, int64_t, int64_t, const QuantizedRows&, int64_t, float*);
  static_assert(V::R <= 6, "the table below covers tiles of up to six rows");
  static constexpr Tile tiles[6] = {panel_tile<t, V, 1>, panel_tile<t, V, std::min(2, V::R)>,
                                    panel_tile<t, V, std::min(3, V::R)>, panel_tile<t, V, std::min(4, V::R)>,
                                    panel_tile<t, V, std::min(5, V::R)>, panel_tile<t, V, std::min(6, V::R)>};
  unpack_panel<t>(weight, row_bytes, n, N, K, scratch);
  float sums[V::R * kPanel];
  PanelAhead ahead(weight, row_bytes, next, N, (M + V::R - 1) / V::R);
  for (int64_t m0 = 0; m0 < M; m0 += V::R) {
    ahead.fetch();
    const int64_t rows = std::min<int64_t>(V::R, M - m0);
    for (int64_t col0 = 0; col0 < kPanel; col0 += V::L * V::C) tiles[rows - 1](scratch, col0, K, x, m0, sums);
    store_panel(sums, rows, n, N, bias, out + m0 * N);
  }
}

template <typename T, typename V>
using PanelColumns = void (*)(const uint8_t*, int64_t, int64_t, int64_t, int64_t, int64_t, const QuantizedRows&,
                              int64_t, const T*, T*, float*);

template <typename T, typename V>
PanelColumns<T, V> pick_panel(Type t) {
  static constexpr PanelColumns<T, V> table[kNumTypes] = {
      panel_columns<T, Q4_0, V>, panel_columns<T, Q4_1, V>, panel_columns<T, Q5_0, V>,
      panel_columns<T, Q5_1, V>, panel_columns<T, Q8_0, V>, panel_columns<T, Q4_K, V>,
      panel_columns<T, Q5_K, V>, panel_columns<T, Q6_K, V>, panel_columns<T, Q4_X2, V>};
  return table[t];
}

template <typename T, typename V>
void run_panels(const uint8_t* weight, Type t, int64_t M, int64_t N, int64_t K, const QuantizedRows& x, const T* bias,
                T* out) {
  const int64_t row_bytes = K / kBlockValues[t] * kBlockBytes[t];
  const PanelColumns<T, V> columns = pick_panel<T, V>(t);
  run_work_queue((N + kPanel - 1) / kPanel, panel_floats(K), [&](int64_t panel, int64_t next, float* scratch) {
    columns(weight, row_bytes, panel * kPanel, next < 0 ? -1 : next * kPanel, N, K, x, M, bias, out, scratch);
  });
}

#ifdef CONVEYOR_AMX_INT8
// The batched path with AMX: the same panel, its bytes already in the layout of a TDPBSUD B tile (per sub-block
// eight rows of four values, 16 columns a tile), and x's bytes as A tiles of 16 rows (x padded with zero rows to
// a multiple of 16). One TDPBSUD gives a sub-block's integer sums for 16 rows x 16 columns (VPDPBUSD: one row x
// 16 columns a group of four values); then the sub-block's scales are applied in the same order as panel_tile
// applies them, so a row's outputs are the same bits on every path. Types of one scale a sub-block (all but
// Q6_K). The products of the next sub-block run while the scales of this one are applied: tiles 0, 2, 3 (x, the
// panel, the sums) for even sub-blocks and 1, 4, 5 for odd ones (a tile's number is part of the instruction).
void amx_configure() {
  TileConfig config;
  config.rows[0] = config.rows[1] = 16;
  config.colsb[0] = config.colsb[1] = kSub;
  config.rows[2] = config.rows[4] = kSub / 4;
  config.colsb[2] = config.colsb[4] = 64;
  config.rows[3] = config.rows[5] = 16;
  config.colsb[3] = config.colsb[5] = 64;
  load_tile_config(config);
}

#define CONVEYOR_AMX_PRODUCT(xt, wt, st, xp, wp, stride)  \
  do {                                                    \
    _tile_loadd(xt, xp, stride);                          \
    _tile_loadd(wt, wp, kPanel * 4);                      \
    _tile_zero(st);                                       \
    _tile_dpbsud(st, xt, wt);                             \
  } while (0)

// Sub-block s's integer sums (dots[16 r + column]) times its scales, added to acc[r].
inline void amx_scale(const int32_t* dots, const float* scale, const float* offset, const QuantizedRows& x,
                      int64_t m0, int64_t subs, int64_t s, __m512* acc) {
  const __m512 ws = _mm512_loadu_ps(scale + s * kPanel), wo = _mm512_loadu_ps(offset + s * kPanel);
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    const int64_t i = (m0 + r) * subs + s;
    const __m512 d = _mm512_cvtepi32_ps(_mm512_load_si512(dots + 16 * r));
    acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, ws), _mm512_set1_ps(x.scale[i]), acc[r]);
    acc[r] = _mm512_fmadd_ps(wo, _mm512_set1_ps(x.sum[i]), acc[r]);
  }
}

// Rows [m0, m0 + 16) x the panel's columns [col0, col0 + 16) into sums[r * kPanel + column].
void amx_tile(const float* scratch, int64_t col0, int64_t K, const QuantizedRows& x, int64_t m0, float* sums) {
  const int64_t subs = K / kSub;
  const uint8_t* q = reinterpret_cast<const uint8_t*>(scratch) + col0 * 4;
  const float* scale = scratch + kPanel * K / 4 + col0;
  const float* offset = scale + subs * kPanel;
  const int8_t* xq = x.q.data() + m0 * K;
  alignas(64) int32_t even[16 * 16], odd[16 * 16];
  __m512 acc[16];
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t step = 8 * kPanel * 4;  // a sub-block's bytes in the panel
  CONVEYOR_AMX_PRODUCT(0, 2, 3, xq, q, K);
  for (int64_t s = 0; s < subs; s += 2) {
    if (s + 1 < subs) CONVEYOR_AMX_PRODUCT(1, 4, 5, xq + (s + 1) * kSub, q + (s + 1) * step, K);
    _tile_stored(3, even, 64);
    if (s + 2 < subs) CONVEYOR_AMX_PRODUCT(0, 2, 3, xq + (s + 2) * kSub, q + (s + 2) * step, K);
    amx_scale(even, scale, offset, x, m0, subs, s, acc);
    if (s + 1 < subs) {
      _tile_stored(5, odd, 64);
      amx_scale(odd, scale, offset, x, m0, subs, s + 1, acc);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) _mm512_storeu_ps(sums + r * kPanel + col0, acc[r]);
}

// Every row of x (quantized as Rows) times columns [n, n + kPanel) in AMX tiles (those below N stored, bias added):
// configure() sets the tiles up, tile() multiplies 16 rows by 16 of the panel's columns.
template <typename T, Type t, typename Rows, void (*configure)(),
          void (*tile)(const float*, int64_t, int64_t, const Rows&, int64_t, float*)>
void amx_panel_columns(const uint8_t* weight, int64_t row_bytes, int64_t n, int64_t next, int64_t N, int64_t K,
                       const Rows& x, int64_t M, const T* bias, T* out, float* scratch) {
  static_assert(kHalves<t> == 1, "one scale a sub-block");
  unpack_panel<t>(weight, row_bytes, n, N, K, scratch);
  configure();
  alignas(64) float sums[16 * kPanel];
  PanelAhead ahead(weight, row_bytes, next, N, (M + 15) / 16);
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    ahead.fetch();
    for (int64_t col0 = 0; col0 < kPanel; col0 += 16) tile(scratch, col0, K, x, m0, sums);
    store_panel(sums, std::min<int64_t>(16, M - m0), n, N, bias, out + m0 * N);
  }
  _tile_release();
}

template <typename T, Type t>
constexpr auto amx_columns = amx_panel_columns<T, t, QuantizedRows, amx_configure, amx_tile>;

// Whether type t takes the AMX path (one scale a sub-block).
constexpr bool amx_type(Type t) { return t != Q6_K; }

template <typename T>
void run_amx_panels(const uint8_t* weight, Type t, int64_t M, int64_t N, int64_t K, QuantizedRows& x,
                    const T* bias, T* out) {
  const int64_t padded = (M + 15) / 16 * 16, subs = K / kSub;  // (zero rows: whole tiles of x)
  x.q.resize(padded * K, 0);
  x.scale.resize(padded * subs, 0.0f);
  x.sum.resize(padded * subs, 0.0f);
  using Columns = void (*)(const uint8_t*, int64_t, int64_t, int64_t, int64_t, int64_t, const QuantizedRows&,
                           int64_t, const T*, T*, float*);
  static constexpr Columns table[kNumTypes] = {
      amx_columns<T, Q4_0>, amx_columns<T, Q4_1>, amx_columns<T, Q5_0>, amx_columns<T, Q5_1>, amx_columns<T, Q8_0>,
      amx_columns<T, Q4_K>, amx_columns<T, Q5_K>, nullptr,          amx_columns<T, Q4_X2>};
  const int64_t row_bytes = K / kBlockValues[t] * kBlockBytes[t];
  run_work_queue((N + kPanel - 1) / kPanel, panel_floats(K), [&](int64_t panel, int64_t next, float* scratch) {
    table[t](weight, row_bytes, panel * kPanel, next < 0 ? -1 : next * kPanel, N, K, x, M, bias, out, scratch);
  });
}

// Q8_0R (Q8_0 blocks with one scale a row: the int8 method's weights) on AMX. The integer sums of the path above
// leave the tile every 32 values to take their sub-block's scales, which cost more than the product itself. With
// the weights' scale the same across a row, only x's scales part the sums: x quantized per 64 values here, one
// TDPBSUD (16 rows x 16 columns x 64 values) a group, its sums scaled by x's scale alone, the weights' scale applied
// once at the end. (Per 64 values the rounding is close to per 32: SmolLM2 teacher-forced over 2,048 tokens of
// GPL-3 against fp32, each rounding simulated in torch, +0.73% perplexity per 64, +0.86% per 32, +3.8% per row;
// with this path, +0.97%.)
// NOTE: 2-core Xeon with AMX, one 3072 x 576 layer of the int8 method, bf16 x, us at 16 / 64 / 256 rows: this path
// 146 / 259 / 734, amx_tile's 165 / 360 / 1,182, the VNNI panels' 167 / 392 / 1,297, bf16 weights in oneDNN's AMX
// tiles 196 / 296 / 602 (decode: plugins/quant/int8.py).
constexpr int64_t kGroup = 64;
constexpr int64_t kAmxRowsMin = 16;  // the fewest rows a step needs for the path (one whole tile of x)

// x quantized per kGroup values: q, each group's scale d (q * d approximates x), and 128 times the sum of its q
// (what the weights' shift up by 128 adds to each integer sum). Rows from M to a multiple of 16 are zeros.
struct Rows64 {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> shift;
};

template <typename T>
inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (std::is_same_v<T, at::Half>)
      return _mm512_cvtph_ps(bits);
    else
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
}

template <typename T>
void quantize_rows64(const T* x, int64_t M, int64_t padded, int64_t K, Rows64& out) {
  const int64_t groups = K / kGroup;
  out.q.assign(padded * K, 0);
  out.scale.assign(padded * groups, 0.0f);
  out.shift.assign(padded * groups, 0);
  at::parallel_for(0, M * groups, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t offset = (i / groups) * K + (i % groups) * kGroup;
      __m512 v[4], m = _mm512_setzero_ps();
      for (int j = 0; j < 4; ++j) v[j] = load16(x + offset + 16 * j), m = _mm512_max_ps(m, _mm512_abs_ps(v[j]));
      const float d = _mm512_reduce_max_ps(m) / 127.0f, inverse = d > 0.0f ? 1.0f / d : 0.0f;
      __m512i sum = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {  // (rounded to nearest even, as quantize_sub)
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[j], _mm512_set1_ps(inverse)));
        sum = _mm512_add_epi32(sum, q);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out.q.data() + offset + 16 * j), _mm512_cvtsepi32_epi8(q));
      }
      out.scale[i] = d;
      out.shift[i] = _mm512_reduce_add_epi32(_mm512_slli_epi32(sum, 7));  // (128 times; NaN in x wraps, no overflow)
    }
  });
}

void amx_configure_rows() {
  TileConfig config;
  for (int i = 0; i < 6; ++i) config.rows[i] = 16, config.colsb[i] = 64;
  load_tile_config(config);
}

// Group g's integer sums (dots[16 r + column]), the weights' shift taken back, times x's scales, added to acc[r].
inline void amx_rows_scale(const int32_t* dots, const Rows64& x, int64_t m0, int64_t groups, int64_t g, __m512* acc) {
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    const int64_t i = (m0 + r) * groups + g;
    const __m512i d = _mm512_sub_epi32(_mm512_load_si512(dots + 16 * r), _mm512_set1_epi32(x.shift[i]));
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(x.scale[i]), acc[r]);
  }
}

// Rows [m0, m0 + 16) x the panel's columns [col0, col0 + 16) into sums[r * kPanel + column]: a group's B tile is
// two sub-blocks of the unpacked panel (16 rows of four values), the products of the next group running while
// this one's sums are scaled, as in amx_tile.
void amx_rows_tile(const float* scratch, int64_t col0, int64_t K, const Rows64& x, int64_t m0, float* sums) {
  const int64_t groups = K / kGroup;
  const uint8_t* q = reinterpret_cast<const uint8_t*>(scratch) + col0 * 4;
  const float* scale = scratch + kPanel * K / 4 + col0;  // (sub-block 0's: the row's)
  const int8_t* xq = x.q.data() + m0 * K;
  alignas(64) int32_t even[16 * 16], odd[16 * 16];
  __m512 acc[16];
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t step = 16 * kPanel * 4;  // a group's bytes in the panel
  CONVEYOR_AMX_PRODUCT(0, 2, 3, xq, q, K);
  for (int64_t g = 0; g < groups; g += 2) {
    if (g + 1 < groups) CONVEYOR_AMX_PRODUCT(1, 4, 5, xq + (g + 1) * kGroup, q + (g + 1) * step, K);
    _tile_stored(3, even, 64);
    if (g + 2 < groups) CONVEYOR_AMX_PRODUCT(0, 2, 3, xq + (g + 2) * kGroup, q + (g + 2) * step, K);
    amx_rows_scale(even, x, m0, groups, g, acc);
    if (g + 1 < groups) {
      _tile_stored(5, odd, 64);
      amx_rows_scale(odd, x, m0, groups, g + 1, acc);
    }
  }
  const __m512 ws = _mm512_loadu_ps(scale);
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) _mm512_storeu_ps(sums + r * kPanel + col0, _mm512_mul_ps(acc[r], ws));
}
#endif

}  // namespace

template <typename T>
bool run_gemm(const uint8_t* weight, Type t, int64_t M, int64_t N, int64_t K, QuantizedRows& x, const T* bias, T* out,
              Path path) {
#ifdef CONVEYOR_AMX_INT8
  if (path == kAmx && M >= amx_min_rows() && amx_type(t)) {
    run_amx_panels<T>(weight, t, M, N, K, x, bias, out);
    return true;
  }
#endif
#ifdef CONVEYOR_AVX512_VNNI
  if (M >= kGemmRows && path >= kVnni) {
    run_panels<T, VnniLanes>(weight, t, M, N, K, x, bias, out);
    return true;
  }
#endif
  if (M >= kGemmRowsAvx2 && path == kAvx2 && t != Q8_0) {
    run_panels<T, Avx2Lanes>(weight, t, M, N, K, x, bias, out);
    return true;
  }
  return false;
}
#else
}  // namespace

template <typename T>
bool run_gemm(const uint8_t*, Type, int64_t, int64_t, int64_t, QuantizedRows&, const T*, T*, Path) {
  return false;
}
#endif

template <typename T>
bool run_rows_gemm(const T* x, const uint8_t* weight, int64_t M, int64_t N, int64_t K, const T* bias, T* out,
                   Path path) {
#if defined(CONVEYOR_AVX2) && defined(CONVEYOR_AMX_INT8)
  if constexpr (!std::is_same_v<T, double>) {
    if (path == kAmx && M >= kAmxRowsMin && K % kGroup == 0) {
      Rows64 xq;
      quantize_rows64(x, M, (M + 15) / 16 * 16, K, xq);
      const int64_t row_bytes = K / kBlockValues[Q8_0] * kBlockBytes[Q8_0];
      run_work_queue((N + kPanel - 1) / kPanel, panel_floats(K), [&](int64_t panel, int64_t next, float* scratch) {
        amx_panel_columns<T, Q8_0, Rows64, amx_configure_rows, amx_rows_tile>(
            weight, row_bytes, panel * kPanel, next < 0 ? -1 : next * kPanel, N, K, xq, M, bias, out, scratch);
      });
      return true;
    }
  }
#endif
  return false;
}

template bool run_gemm<double>(const uint8_t*, Type, int64_t, int64_t, int64_t, QuantizedRows&, const double*,
                               double*, Path);
template bool run_gemm<float>(const uint8_t*, Type, int64_t, int64_t, int64_t, QuantizedRows&, const float*, float*,
                              Path);
template bool run_gemm<at::BFloat16>(const uint8_t*, Type, int64_t, int64_t, int64_t, QuantizedRows&,
                                     const at::BFloat16*, at::BFloat16*, Path);
template bool run_gemm<at::Half>(const uint8_t*, Type, int64_t, int64_t, int64_t, QuantizedRows&, const at::Half*,
                                 at::Half*, Path);

template bool run_rows_gemm<double>(const double*, const uint8_t*, int64_t, int64_t, int64_t, const double*, double*,
                                    Path);
template bool run_rows_gemm<float>(const float*, const uint8_t*, int64_t, int64_t, int64_t, const float*, float*, Path);
template bool run_rows_gemm<at::BFloat16>(const at::BFloat16*, const uint8_t*, int64_t, int64_t, int64_t,
                                          const at::BFloat16*, at::BFloat16*, Path);
template bool run_rows_gemm<at::Half>(const at::Half*, const uint8_t*, int64_t, int64_t, int64_t, const at::Half*,
                                      at::Half*, Path);

}  // namespace ggml
}  // namespace conveyor
