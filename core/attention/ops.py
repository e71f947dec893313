"""Attention primitives in torch ops (the torch backend's path)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int) -> torch.Tensor:
    """Attention of one sequence's queries over its keys.

    Args:
        q: ``[n, Hq, D]`` queries at positions ``q_start .. q_start + n - 1``.
        k, v: ``[Hkv, L, D]`` keys and values at positions ``0 .. L - 1``
            (``L >= q_start + n``), head-major as the KV storage keeps them.
        q_start: position of the first query.

    Returns:
        ``[n, Hq, D]``; query i sees keys at positions ``<= q_start + i``.
    """
    n, length = q.shape[0], k.shape[1]
    qt = q.transpose(0, 1).unsqueeze(0)
    gqa = q.shape[1] != k.shape[0]
    if q_start == 0 and n == length:
        out = F.scaled_dot_product_attention(qt, k.unsqueeze(0), v.unsqueeze(0), is_causal=True, enable_gqa=gqa)
    else:
        query_pos = torch.arange(q_start, q_start + n, device=q.device).unsqueeze(1)
        mask = torch.arange(length, device=q.device).unsqueeze(0) <= query_pos
        out = F.scaled_dot_product_attention(qt, k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, enable_gqa=gqa)
    return out.squeeze(0).transpose(0, 1)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of one new token per sequence over that sequence's keys.

    NOTE: on CPU this grouped matmul is 2-10x faster than
    ``scaled_dot_product_attention`` for single-token bf16 queries, and the
    head-major key layout lets it multiply the gathered keys without a copy.

    Args:
        q: ``[B, Hq, D]``.
        k, v: ``[Hkv, B, L, D]`` (padded to the longest context).
        mask: ``[B, L]`` bool, True where a key is part of the sequence.

    Returns:
        ``[B, Hq, D]``.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[0]
    grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)
    scores = torch.matmul(grouped, k.transpose(-1, -2)).float() * head_dim**-0.5
    scores = scores.masked_fill(~mask[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).transpose(0, 1).reshape(batch, num_heads, head_dim)
