"""Attention primitives in torch ops (the torch backend's path)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float | None = None,
                     window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Attention of one sequence's queries over its keys.

    Args:
        q: ``[n, Hq, D]`` queries at positions ``q_start .. q_start + n - 1``.
        k, v: ``[Hkv, L, D]`` keys and values at positions ``0 .. L - 1``
            (``L >= q_start + n``), head-major as the KV storage keeps them.
        q_start: position of the first query.
        scale: what scores are multiplied by (None: ``D ** -0.5``).
        window: keys a query sees, its own included (0: all before it).
        softcap: scores become ``softcap * tanh(score / softcap)`` before the softmax (0: not capped).

    Returns:
        ``[n, Hq, D]``; query i sees keys at positions ``<= q_start + i`` (and ``> q_start + i - window``).
    """
    n, length = q.shape[0], k.shape[1]
    qt = q.transpose(0, 1).unsqueeze(0)
    gqa = q.shape[1] != k.shape[0]
    if softcap:
        return _capped_attention(q, k, v, _causal_mask(q_start, n, length, window, q.device), scale, softcap)
    if q_start == 0 and n == length and not window:
        out = F.scaled_dot_product_attention(qt, k.unsqueeze(0), v.unsqueeze(0), is_causal=True, enable_gqa=gqa,
                                             scale=scale)
    else:
        mask = _causal_mask(q_start, n, length, window, q.device)
        out = F.scaled_dot_product_attention(qt, k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, enable_gqa=gqa,
                                             scale=scale)
    return out.squeeze(0).transpose(0, 1)


def _causal_mask(q_start: int, n: int, length: int, window: int, device: torch.device) -> torch.Tensor:
    """``[n, length]`` bool: True where query ``q_start + i`` sees key ``j``."""
    query_pos = torch.arange(q_start, q_start + n, device=device).unsqueeze(1)
    keys = torch.arange(length, device=device).unsqueeze(0)
    mask = keys <= query_pos
    return mask & (keys > query_pos - window) if window else mask


def _capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None,
                      softcap: float) -> torch.Tensor:
    """Soft-capped attention (which SDPA cannot do): ``q [n, Hq, D]``, ``k``, ``v [Hkv, L, D]``, ``mask [n, L]``."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[0]
    grouped = q.view(n, num_kv_heads, num_heads // num_kv_heads, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
    scores = torch.matmul(grouped, k.unsqueeze(1).transpose(-1, -2)).float() * (scale or head_dim**-0.5)
    scores = torch.tanh(scores / softcap) * softcap
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).to(v.dtype)
    return torch.matmul(probs, v.unsqueeze(1)).permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float | None = None, softcap: float = 0.0) -> torch.Tensor:
    """Attention of one new token per sequence over that sequence's keys.

    NOTE: on CPU this grouped matmul is 2-10x faster than
    ``scaled_dot_product_attention`` for single-token bf16 queries, and the
    head-major key layout lets it multiply the gathered keys without a copy.

    Args:
        q: ``[B, Hq, D]``.
        k, v: ``[Hkv, B, L, D]`` (padded to the longest context).
        mask: ``[B, L]`` bool, True where a key is part of the sequence (and inside its window).
        scale: what scores are multiplied by (None: ``D ** -0.5``).
        softcap: scores become ``softcap * tanh(score / softcap)`` before the softmax (0: not capped).

    Returns:
        ``[B, Hq, D]``.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[0]
    grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)
    scores = torch.matmul(grouped, k.transpose(-1, -2)).float() * (scale or head_dim**-0.5)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).transpose(0, 1).reshape(batch, num_heads, head_dim)
