// What the CPU kernels share: the CPU feature they specialize for, bfloat16
// conversions that vectorize, the work queue that spreads items over ATen's
// threads, and the check of block tables before any memory is read through them.
#pragma once

// (Tensor.h and the one op used, not ATen.h, which declares every op: 4.8 s of headers a file rather than 7.8)
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <thread>
#include <type_traits>
#include <vector>

// VDPBF16PS (bf16 pairs multiplied, float32 sums): the fast paths of the attention kernels.
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define CONVEYOR_AVX512_BF16 1
#endif

// VPDPBUSD (unsigned x signed bytes, four products summed into each int32 lane): the batched path of the
// quantized-block linear layers (ggml_gemm.cpp).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define CONVEYOR_AVX512_VNNI 1
#endif

// AMX tiles (Intel since Sapphire Rapids): bf16 products in tile_linear.cpp, int8 ones in ggml_gemm.cpp.
#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace conveyor {

#if defined(__AMX_TILE__)
// Linux hands out the AMX tile state per process on request.
inline bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return permitted;
}

// A tile configuration (palette 1): each tile's rows and bytes a row.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loads a configuration into this thread's tiles. NOTE: GCC 12 treats LDTILECFG as reading no memory and once
// dropped the stores that filled a configuration (every tile load then raised SIGILL): the barrier keeps them.
inline void load_tile_config(const TileConfig& config) {
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}
#endif

inline float bits_to_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// bfloat16 is the top half of a float32.
inline float bf16_to_float(uint16_t bits) { return bits_to_float(uint32_t(bits) << 16); }

// Round to nearest even; a NaN stays a (quiet) NaN.
inline uint16_t float_to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  return static_cast<uint16_t>(nan ? 0x7fc0u : (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// Floats in a 64-byte line.
constexpr int64_t kLineFloats = 16;

// n rounded up to whole 64-byte lines of floats. Scratch buffers whose size depends on the batch (the longest
// context) are rounded so, so that every buffer after them sits at the same alignment whatever the batch: a
// vectorized reduction may peel its first iterations by alignment, which would change the order of a sum
// (-ffast-math lets the compiler reorder), and so its last bits, with the batch ([engine] batch_invariant).
inline int64_t whole_lines(int64_t n) { return (n + kLineFloats - 1) / kLineFloats * kLineFloats; }

// Memory a step streams below which one thread does it alone: waking ATen's other threads costs more than they
// save. NOTE: idle OpenMP threads sleep (conveyor sets OMP_WAIT_POLICY=PASSIVE), and waking one took 10-20 us
// (2-core AMD EPYC, AVX2): SmolLM2's 576 x 576 Q4_1 layer at one row read 16 us on one thread and 24-33 us on
// two; its 1536 x 576 layers (0.55 MB) 40 us and 27-40. One stream through `conveyor serve`
// (benchmarks/latency.py, default config, four interleaved pairs in one run): ITL p50 20.2-23.6 ms with this,
// 24.7-28.9 without. Threads that spin instead were worse: they took the cores the engine's other threads and
// processes need (one stream 5x slower with GOMP_SPINCOUNT=10000).
constexpr int64_t kSoloBytes = int64_t(384) << 10;

// A team: threads that run one long op together (decode_layers.cpp: every layer of a decode step), each
// calling the same kernels in the same order. Inside it, run_work_queue hands each call's items to whichever
// members come for them, numbered on from the last call's, and returns once all are done; so the threads are
// woken once an op, not once a kernel. A member that comes late (its core taken by another process) finds a
// call's items taken and goes on to the next: no member waits for another to arrive, only for the items it has
// taken to be done. The wait spins (a kernel's items take microseconds), then yields the core to whatever else
// wants it.
class Team {
 public:
  explicit Team(int threads) : threads_(threads) {}

  // The threads the team was started with: what the kernels divide their work by inside it.
  int threads() const { return threads_; }

  // Takes the next item if it is below `end` (the current call's last, plus one).
  bool claim(int64_t end, int64_t* item) {
    int64_t next = next_.load(std::memory_order_relaxed);
    while (next < end) {
      if (next_.compare_exchange_weak(next, next + 1, std::memory_order_acq_rel)) {
        *item = next;
        return true;
      }
    }
    return false;
  }

  // An item taken is done (its writes are seen by whoever waits for it).
  void finished() { done_.fetch_add(1, std::memory_order_release); }

  // Waits until every item below `end` is done (or a member has given up: abort()).
  void wait_done(int64_t end) {
    for (int spins = 0; done_.load(std::memory_order_acquire) < end && !aborted(); ++spins) {
      if (spins < kSpins) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
      } else {
        std::this_thread::yield();
      }
    }
  }

  // A member failed: the others stop waiting for its items (the op's results are then not used).
  void abort() { aborted_.store(true, std::memory_order_release); }
  bool aborted() const { return aborted_.load(std::memory_order_acquire); }

 private:
  static constexpr int kSpins = 4000;  // about 20-50 us of pause instructions before yielding
  const int threads_;
  alignas(64) std::atomic<int64_t> next_{0};
  alignas(64) std::atomic<int64_t> done_{0};
  std::atomic<bool> aborted_{false};
};

// This thread's place in the team it runs in (null outside one): where its next call's items start, and a digest
// of the item counts of its calls so far (every member's must be the same: decode_layers checks).
struct TeamMember {
  Team* team;
  int64_t first = 0;
  uint64_t digest = 0;
};
inline thread_local TeamMember* t_member = nullptr;

// The threads a kernel divides its work among: the team's inside one (every member must count the same items for
// a call, and ATen's per-thread count can differ between the threads of a team), else ATen's.
inline int num_threads() { return t_member != nullptr ? t_member->team->threads() : at::get_num_threads(); }

// Calls visit(args...): one compiled copy of an item's work for run_work_queue's every path. Inlined into each
// of them (a team's members, ATen's threads), the item's work was vectorized differently in each under
// -ffast-math: float32 paged attention in decode_layers' team differed from the same op alone in the last bits of
// a sum, which the int8 rounding of the next layer's activations then made 0.3 of a hidden state.
#if defined(__clang__)
#define CONVEYOR_ONE_COPY __attribute__((noinline))  // (clang neither clones nor knows noipa)
#else
#define CONVEYOR_ONE_COPY __attribute__((noipa))  // (GCC: neither inlined nor cloned for constant arguments)
#endif
template <typename Visit, typename... Args>
CONVEYOR_ONE_COPY void visit_item(Visit& visit, Args... args) {
  visit(args...);
}

// Runs visit(item, scratch) for items 0 .. num_items - 1 on ATen's threads, each thread pulling the next
// item from a shared counter (items of uneven cost balance themselves; order them costliest first), or on the
// calling thread alone where the work reads fewer than kSoloBytes (`bytes`: what all items read; -1: unknown).
// Inside a team, every member makes the same calls and the team's threads share each call's items (whatever
// `bytes`); it returns once all are done. Each thread has its own scratch of scratch_floats floats, starting on
// a 64-byte line.
template <typename Visit>
void run_work_queue(int64_t num_items, int64_t scratch_floats, Visit&& visit, int64_t bytes = -1) {
  // visit(item, scratch), or visit(item, next, scratch): `next` is the item this thread takes after `item`, taken
  // before it starts `item` (-1: none), so that it can fetch the next item's memory while it computes this one's
  constexpr bool ahead = std::is_invocable_v<Visit, int64_t, int64_t, float*>;
  auto scratch_of = [&](std::vector<float>& storage) {
    storage.resize(scratch_floats + kLineFloats);
    const uintptr_t address = reinterpret_cast<uintptr_t>(storage.data());
    return reinterpret_cast<float*>((address + 63) & ~uintptr_t(63));
  };
  // items from take(&item) until it returns false, each visited, then done(); offset: what take's items start at
  auto drain = [&](auto&& take, auto&& done, int64_t offset) {
    int64_t item;
    if (!take(&item)) return;
    std::vector<float> storage;
    float* scratch = scratch_of(storage);
    if constexpr (ahead) {
      for (;;) {
        int64_t next;
        const bool more = take(&next);
        visit_item(visit, item - offset, more ? next - offset : int64_t(-1), scratch);
        done();
        if (!more) break;
        item = next;
      }
    } else {
      do {
        visit_item(visit, item - offset, scratch);
        done();
      } while (take(&item));
    }
  };
  if (TeamMember* member = t_member) {
    Team& team = *member->team;
    const int64_t first = member->first, end = first + num_items;
    member->first = end;
    member->digest = member->digest * 1000003u + uint64_t(num_items);
    drain([&](int64_t* item) { return team.claim(end, item); }, [&] { team.finished(); }, first);
    team.wait_done(end);
    return;
  }
  std::atomic<int64_t> next{0};
  auto work = [&](int64_t, int64_t) {
    drain([&](int64_t* item) { return (*item = next.fetch_add(1)) < num_items; }, [] {}, 0);
  };
  if (bytes >= 0 && bytes < kSoloBytes) return work(0, 1);
  at::parallel_for(0, at::get_num_threads(), 1, work);
}

// Runs f() once: inside a team, on whichever member comes first, the others waiting until it is done.
template <typename F>
void run_once(F&& f) {
  run_work_queue(1, 0, [&](int64_t, float*) { f(); });
}

// Sequence i reads positions [0, lens[i]) through row i of block_tables; every block it
// touches must be inside the cache, and its table must be wide enough.
inline void check_block_tables(const at::Tensor& block_tables, const int32_t* lens, int64_t num_seqs,
                               int64_t block_size, int64_t num_slots) {
  TORCH_CHECK(block_size > 0 && num_slots % block_size == 0, "block_size must divide the cache's slots");
  const int64_t width = block_tables.size(1), num_blocks = num_slots / block_size;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  for (int64_t i = 0; i < num_seqs; ++i) {
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= width * block_size, "sequence ", i, " has ", lens[i],
                " keys, outside what its block table of ", width, " blocks holds");
    for (int64_t b = 0; b < (lens[i] + block_size - 1) / block_size; ++b) {
      const int32_t block = tables[i * width + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "sequence ", i, " uses block ", block, " of ", num_blocks);
    }
  }
}

}  // namespace conveyor
