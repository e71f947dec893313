// Argument checks shared by the paged attention kernels: they read memory
// through the block tables, so every block a sequence uses must exist.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace conveyor {

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
