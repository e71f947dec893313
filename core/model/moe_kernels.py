"""A Triton grouped GEMM for the mixture-of-experts MLP (the CUDA path of ``conveyor.model.moe``).

The (token, expert) pairs of a step are sorted by expert and each expert's
run is padded to a whole number of ``BLOCK_M`` rows; every program of the
kernel takes one block of rows (all of one expert) and one tile of output
columns, and multiplies the rows' inputs by that expert's weight. The first
GEMM reads each pair's token row (``pair // top_k``) against the stacked
gate|up weights; the second reads the pair's activated row against the
stacked down weights and scales it by the pair's routing weight. The sum over
the top k is one reduction at the end.

Its torch reference is ``MoE._grouped``; the tests compare both under
``TRITON_INTERPRET=1`` (set before this module is imported) on a CPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from conveyor.model.moe import activate

# NOTE: the interpreter computes tl.dot on bfloat16 operands wrongly (see conveyor.attention.kernels); under it
# the kernel upcasts bf16 tiles to fp32 before its dots.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_M = 16


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [rows, K]: the inputs (token rows, or pair rows)
    b_ptr,  # [E, N, K]: each expert's weight
    c_ptr,  # [pairs, N]
    sorted_pairs_ptr,  # [padded]: pair ids, in expert order, padding = num_pairs
    block_experts_ptr,  # [padded / BLOCK_M]: the expert of each block of rows
    weights_ptr,  # [pairs] float32 routing weights (MUL_WEIGHT)
    num_pairs,
    N, K,
    stride_am, stride_be, stride_bn, stride_cm,
    A_ROW_DIVISOR: tl.constexpr,  # a row of a pair: pair // A_ROW_DIVISOR (top_k for tokens, 1 for pairs)
    MUL_WEIGHT: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    tile = tl.program_id(1)
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    expert = tl.load(block_experts_ptr + block)
    rows = pairs // A_ROW_DIVISOR
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptr + expert * stride_be + cols[None, :] * stride_bn + ks[:, None],
                    mask=col_mask[None, :] & k_mask[:, None], other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(a, b)
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    tl.store(c_ptr + pairs[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & col_mask[None, :])


def align_to_blocks(experts: torch.Tensor, num_experts: int, block: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs ``experts [T, k]`` sorted by expert, each expert's run padded to a multiple of ``block``.

    Returns:
        ``sorted_pairs [padded]`` (pair ids ``t * k + j``; padding is ``T * k``) and ``block_experts
        [padded / block]``.
    """
    flat = experts.flatten()
    num_pairs, device = flat.numel(), flat.device
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block - 1) // block * block
    starts = torch.cumsum(padded, 0) - padded  # where each expert's run begins
    firsts = torch.cumsum(counts, 0) - counts  # where each expert begins in sorted order
    sorted_experts = flat[order]
    destination = starts[sorted_experts] + torch.arange(num_pairs, device=device) - firsts[sorted_experts]
    total = int(padded.sum())
    sorted_pairs = torch.full((total,), num_pairs, dtype=torch.int64, device=device)
    sorted_pairs[destination] = order
    block_experts = torch.repeat_interleave(torch.arange(num_experts, device=device), padded // block)
    return sorted_pairs, block_experts


def grouped_gemm(a: torch.Tensor, weights: torch.Tensor, sorted_pairs: torch.Tensor, block_experts: torch.Tensor,
                 num_pairs: int, row_divisor: int, pair_weights: torch.Tensor | None = None) -> torch.Tensor:
    """``out[p] = a[p // row_divisor] @ weights[expert of p].T`` (times ``pair_weights[p]`` where given):
    ``a [rows, K]``, ``weights [E, N, K]`` -> ``[num_pairs, N]``."""
    _, n, k = weights.shape
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    block_n, block_k = 64, 32
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, weights, out, sorted_pairs, block_experts,
        pair_weights if pair_weights is not None else out, num_pairs, n, k,
        a.stride(0), weights.stride(0), weights.stride(1), out.stride(0),
        A_ROW_DIVISOR=row_divisor, MUL_WEIGHT=pair_weights is not None,
        UPCAST=INTERPRETED and a.dtype == torch.bfloat16,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, experts: torch.Tensor,
              weights: torch.Tensor, activation: str) -> torch.Tensor:
    """The routed experts' output ``[T, H]``.

    Args:
        x: ``[T, H]`` (contiguous rows).
        gate_up: ``[E, 2I, H]``; down: ``[E, H, I]``.
        experts, weights: ``[T, k]`` each token's experts and routing weights.
        activation: the gate's activation ("silu", "gelu_tanh", "gelu").
    """
    num_tokens, top_k = experts.shape
    num_pairs = num_tokens * top_k
    sorted_pairs, block_experts = align_to_blocks(experts, gate_up.shape[0])
    x = x.contiguous()
    hidden = grouped_gemm(x, gate_up, sorted_pairs, block_experts, num_pairs, top_k)
    hidden = activate(hidden, activation).contiguous()
    out = grouped_gemm(hidden, down, sorted_pairs, block_experts, num_pairs, 1,
                       weights.flatten().float().contiguous())
    return out.view(num_tokens, top_k, -1).sum(dim=1)
