"""Triton attention over block tables (the CUDA path of the block KV storage).

K and V of one layer are ``[kv_heads, num_slots, head_dim]`` with slot =
``block * block_size + offset``; each sequence finds its blocks in a row of
``block_tables``. Both kernels use an online softmax in float32 and never
materialize the gathered keys.

The torch path of the same computation is ``conveyor.attention.torch_backend``;
the tests check both kernels against a float64 dense attention. Set ``TRITON_INTERPRET=1`` before this
module is imported to run the kernels on CPU tensors.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# NOTE: the interpreter computes tl.dot on bfloat16 operands wrongly (as if
# they were integers); fp16 and fp32 are right. Under the interpreter the
# prefill kernel upcasts bf16 operands to fp32 before its dots.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _shared_args(q, k_cache, v_cache, out, block_tables, block_size, k_scale, v_scale, scale, window,
                 softcap) -> tuple[tuple, dict]:
    """What both kernels take after their own pointers: scales, softmax scale, window, cap, strides; and the
    layout constants."""
    scaled = k_scale is not None
    args = (
        k_scale if scaled else k_cache, v_scale if scaled else v_cache, q.shape[2] ** -0.5 if scale is None else scale,
        window, softcap or 1.0,
        q.stride(0), q.stride(1),
        k_cache.stride(1), k_cache.stride(0),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        k_scale.stride(0) if scaled else 0,
    )
    layout = {"KV_SCALED": scaled, "CAPPED": bool(softcap), "GROUP": q.shape[1] // k_cache.shape[0],
              "HEAD_DIM": q.shape[2], "BLOCK_SIZE": block_size}
    return args, layout


@triton.jit
def _soft_cap(scores, softcap):
    """``softcap * tanh(scores / softcap)``, tanh written with exp (the interpreter and every backend have it)."""
    return softcap * (2.0 / (1.0 + tl.exp(-2.0 * scores / softcap)) - 1.0)


@triton.jit
def _decode_kernel(
    q_ptr,  # [B, Hq, D]
    k_ptr,  # [Hkv, S, D]
    v_ptr,
    out_ptr,  # [B, Hq, D]
    tables_ptr,  # [B, max_blocks] int32
    context_ptr,  # [B] int32
    k_scale_ptr,  # [Hkv, S]: per-slot scales of an fp8 cache (KV_SCALED)
    v_scale_ptr,
    scale,
    window,  # keys a query sees, its own included (0: all)
    softcap,
    stride_qb, stride_qh,
    stride_ks, stride_kh,
    stride_ob, stride_oh,
    stride_tb,
    stride_sh,
    KV_SCALED: tl.constexpr,
    CAPPED: tl.constexpr,  # scores soft-capped at softcap
    GROUP: tl.constexpr,  # query heads per kv head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block (any size)
    BLOCK_N: tl.constexpr,  # keys per iteration
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qb + head * stride_qh + dims, mask=dim_mask, other=0.0).to(tl.float32)
    context = tl.load(context_ptr + seq)
    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    first = tl.where(window > 0, tl.maximum(context - window, 0), 0)
    for start in range(first, context, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < context
        block = tl.load(tables_ptr + seq * stride_tb + pos // BLOCK_SIZE, mask=valid, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        offsets = slot[:, None] * stride_ks + kv_head * stride_kh + dims[None, :]
        mask = valid[:, None] & dim_mask[None, :]
        k = tl.load(k_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if KV_SCALED:
            k = k * tl.load(k_scale_ptr + kv_head * stride_sh + slot, mask=valid, other=0.0).to(tl.float32)[:, None]
        scores = tl.sum(k * q[None, :], axis=1) * scale
        if CAPPED:
            scores = _soft_cap(scores, softcap)
        scores = tl.where(valid, scores, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if KV_SCALED:
            v = v * tl.load(v_scale_ptr + kv_head * stride_sh + slot, mask=valid, other=0.0).to(tl.float32)[:, None]
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    scale: float | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One query per sequence over its paged context.

    Args:
        q: ``[B, Hq, D]``.
        k_cache, v_cache: ``[Hkv, num_slots, D]`` (one layer).
        block_tables: ``[B, max_blocks]`` int32.
        context_lens: ``[B]`` int32, keys per sequence (the new token's included).
        block_size: tokens per block.
        k_scale, v_scale: ``[Hkv, num_slots]`` scales of an fp8 cache (value = stored x scale), or None.
        out: ``[B, Hq, D]`` to write into (a new tensor if None).
        scale: what scores are multiplied by (None: ``D ** -0.5``).
        window: keys each query sees, its own included: the last ``window`` (0: all).
        softcap: scores become ``softcap * tanh(score / softcap)`` before the softmax (0: not capped).

    Returns:
        ``out``, in q's dtype.
    """
    batch, num_heads, head_dim = q.shape
    if out is None:
        out = torch.empty_like(q)
    args, layout = _shared_args(q, k_cache, v_cache, out, block_tables, block_size, k_scale, v_scale, scale, window,
                                softcap)
    _decode_kernel[(batch, num_heads)](
        q, k_cache, v_cache, out, block_tables, context_lens, *args, **layout,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=64,
    )
    return out


@triton.jit
def _prefill_kernel(
    q_ptr,  # [T, Hq, D]: the chunks of all sequences, back to back
    k_ptr,  # [Hkv, S, D]
    v_ptr,
    out_ptr,  # [T, Hq, D]
    tables_ptr,  # [N, max_blocks] int32
    q_rows_ptr,  # [N] int32: first row of each sequence's chunk in q
    q_lens_ptr,  # [N] int32: rows of each chunk
    starts_ptr,  # [N] int32: position of each chunk's first token
    k_scale_ptr,  # [Hkv, S]: per-slot scales of an fp8 cache (KV_SCALED)
    v_scale_ptr,
    scale,
    window,
    softcap,
    stride_qt, stride_qh,
    stride_ks, stride_kh,
    stride_ot, stride_oh,
    stride_tb,
    stride_sh,
    KV_SCALED: tl.constexpr,
    CAPPED: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per iteration
    UPCAST_DOT: tl.constexpr,  # fp32 dots (see INTERPRETED)
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_len = tl.load(q_lens_ptr + seq)
    if tile * BLOCK_M < q_len:
        kv_head = head // GROUP
        first_row = tl.load(q_rows_ptr + seq)
        start = tl.load(starts_ptr + seq)
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < q_len
        query_pos = start + rows
        dims = tl.arange(0, BLOCK_D)
        dim_mask = dims < HEAD_DIM
        q_offsets = (first_row + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :]
        # native dtype into tl.dot (tensor cores), float32 accumulation
        q = tl.load(q_ptr + q_offsets, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
        if UPCAST_DOT:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        # keys up to the last query of this tile (causal), from the first one its first query sees
        end = start + tl.minimum((tile + 1) * BLOCK_M, q_len)
        key_first = tl.where(window > 0, tl.maximum(start + tile * BLOCK_M - window + 1, 0), 0)
        for key_start in range(key_first, end, BLOCK_N):
            key_pos = key_start + tl.arange(0, BLOCK_N)
            key_valid = key_pos < end
            block = tl.load(tables_ptr + seq * stride_tb + key_pos // BLOCK_SIZE, mask=key_valid, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + key_pos % BLOCK_SIZE
            kv_offsets = slot[:, None] * stride_ks + kv_head * stride_kh + dims[None, :]
            kv_mask = key_valid[:, None] & dim_mask[None, :]
            k = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0)
            if KV_SCALED:
                k_scale = tl.load(k_scale_ptr + kv_head * stride_sh + slot, mask=key_valid, other=0.0)
                k = (k.to(tl.float32) * k_scale.to(tl.float32)[:, None]).to(q.dtype)
            elif UPCAST_DOT:
                k = k.to(tl.float32)
            scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
            if CAPPED:
                scores = _soft_cap(scores, softcap)
            allowed = (key_pos[None, :] <= query_pos[:, None]) & key_valid[None, :]
            allowed &= (window <= 0) | (key_pos[None, :] > query_pos[:, None] - window)
            scores = tl.where(allowed, scores, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            # rows with nothing allowed yet keep m = -inf; avoid inf - inf
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            p = tl.exp(scores - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            v = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0)
            if KV_SCALED:
                v_scale = tl.load(v_scale_ptr + kv_head * stride_sh + slot, mask=key_valid, other=0.0)
                v = (v.to(tl.float32) * v_scale.to(tl.float32)[:, None]).to(q.dtype)
            elif UPCAST_DOT:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_offsets = (first_row + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    q_rows: torch.Tensor,
    q_lens: torch.Tensor,
    starts: torch.Tensor,
    block_size: int,
    max_q_len: int,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    scale: float | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Prefill chunks attending causally over their paged context.

    Args:
        q: ``[T, Hq, D]``; sequence i's chunk is rows ``q_rows[i] .. q_rows[i] + q_lens[i]``.
        k_cache, v_cache: ``[Hkv, num_slots, D]`` (one layer), already holding the chunks' keys.
        block_tables: ``[N, max_blocks]`` int32.
        q_rows, q_lens, starts: ``[N]`` int32; ``starts[i]`` is the position of the chunk's first token.
        block_size: tokens per block.
        max_q_len: the longest chunk.
        out: where to write (rows outside the chunks are left alone); a new tensor if None.
        k_scale, v_scale: ``[Hkv, num_slots]`` scales of an fp8 cache, or None.
        scale, window, softcap: as ``paged_decode_attention`` takes them; each query sees the last ``window``
            positions up to its own.

    Returns:
        ``out``.
    """
    _, num_heads, head_dim = q.shape
    if out is None:
        out = torch.empty_like(q)
    block_m = 16
    grid = (q_lens.shape[0], num_heads, triton.cdiv(max_q_len, block_m))
    args, layout = _shared_args(q, k_cache, v_cache, out, block_tables, block_size, k_scale, v_scale, scale, window,
                                softcap)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, q_rows, q_lens, starts, *args, **layout,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m,
        BLOCK_N=32,
        UPCAST_DOT=INTERPRETED and q.dtype == torch.bfloat16,
    )
    return out
