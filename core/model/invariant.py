"""Batch-invariant matmuls (``[engine] batch_invariant``).

A BLAS picks its kernel and blocking by the shape of a matmul, so one token's
row of a linear layer can come out differently, in the last bits, in a step
of 1 token and in one of 300 (MKL's float32 GEMM does; oneDNN's prepacked
bfloat16 kernels on an AMX CPU happen not to, but nothing promises it). In
batch-invariant mode every linear layer multiplies blocks of exactly
``INVARIANT_ROWS`` rows, the last block padded with zeros: every row meets
the same matmul, whatever shares its step. This is the CPU counterpart of
the fixed tile configurations (no split-K) of vLLM's and SGLang's
batch-invariant kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# rows of every matmul in batch-invariant mode: one AMX tile's height, and few enough that a step of one
# token pays little for the padding (benchmarks/batch_invariant.py)
INVARIANT_ROWS = 16


def in_row_blocks(apply: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                  rows: int = INVARIANT_ROWS) -> torch.Tensor:
    """``apply(x)`` for a row-wise ``apply`` (``[N, in] -> [N, out]``), called on blocks of exactly ``rows`` rows."""
    n = x.shape[0]
    if n % rows:
        x = torch.cat([x, x.new_zeros(rows - n % rows, *x.shape[1:])])
    blocks = [apply(block) for block in x.split(rows)]
    out = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
    return out[:n]
