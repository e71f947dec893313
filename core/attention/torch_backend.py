"""``torch``: attention in torch ops, on any device and cache dtype.

Decodes are gathered block by block into padded copies, in a few groups of
similar context length, and attend in one grouped matmul per group; each
prompt chunk attends with ``scaled_dot_product_attention`` over its own new
keys (a fresh prompt) or over what its sequence has cached.
"""

from __future__ import annotations

import torch

from conveyor.attention.backend import AttentionBackend
from conveyor.attention.ops import causal_attention, decode_attention
from conveyor.attention.storage import dequantize

# decodes per step are split into at most this many length groups, of at least this many each
MAX_DECODE_GROUPS = 4
MIN_DECODE_GROUP = 8


class TorchAttention(AttentionBackend):
    """Torch ops over gathered blocks: the reference path, and the fallback where no kernel runs."""

    name = "torch"

    @classmethod
    def unavailable(cls, device: torch.device) -> str | None:
        return None

    def plan_decodes(self, tables: list[list[int]], context_lens: list[int]) -> list:
        device, size = self.storage.device, self.storage.block_size
        order = sorted(range(len(tables)), key=lambda i: len(tables[i]))
        num_groups = min(MAX_DECODE_GROUPS, -(-len(tables) // MIN_DECODE_GROUP))
        groups = []
        for g in range(num_groups):
            rows = order[g * len(tables) // num_groups : (g + 1) * len(tables) // num_groups]
            width = len(tables[rows[-1]])
            padded = [tables[i] + [0] * (width - len(tables[i])) for i in rows]
            # NOTE: index_select over whole blocks is ~4x faster than advanced indexing on CPU.
            blocks = torch.tensor(padded, dtype=torch.long, device=device).flatten()
            context = torch.tensor([context_lens[i] for i in rows], device=device)
            positions = torch.arange(width * size, device=device)
            groups.append((torch.tensor(rows, device=device), blocks, positions, context.unsqueeze(1)))
        return groups

    def decode(self, layer: int, q: torch.Tensor, plan: list, out: torch.Tensor) -> None:
        k_cache, v_cache, k_scale, v_scale = self.storage.layer(layer)
        params = self.layers[layer]
        for rows, blocks, positions, context in plan:
            mask = positions < context
            if params.window:
                mask &= positions >= context - params.window
            keys = self._gather_blocks(k_cache, k_scale, blocks, rows.shape[0], q.dtype)
            values = self._gather_blocks(v_cache, v_scale, blocks, rows.shape[0], q.dtype)
            out[rows] = decode_attention(q[rows], keys, values, mask, params.scale, params.softcap)

    def _gather_blocks(self, cache: torch.Tensor, scales: torch.Tensor | None, blocks: torch.Tensor, rows: int,
                       dtype: torch.dtype) -> torch.Tensor:
        num_kv_heads, num_blocks = cache.shape[0], self.storage.num_blocks
        shape = (num_kv_heads, rows, -1, cache.shape[2])
        gathered = cache.view(num_kv_heads, num_blocks, -1).index_select(1, blocks).view(shape)
        if scales is None:
            return gathered
        gathered_scales = scales.view(num_kv_heads, num_blocks, -1).index_select(1, blocks).view(shape[:-1])
        return dequantize(gathered, gathered_scales, dtype)

    def plan_prefills(self, tables: list[list[int]], starts: list[int], lens: list[int], first_row: int) -> list:
        device, size = self.storage.device, self.storage.block_size
        # (first row, rows, first position, slots of the whole context or None when it starts at 0)
        chunks = []
        row = first_row
        for table, start, n in zip(tables, starts, lens):
            context_slots = None
            if start > 0:
                blocks = torch.tensor(table, dtype=torch.long, device=device)
                context_slots = (blocks.unsqueeze(1) * size + torch.arange(size, device=device)).flatten()[: start + n]
            chunks.append((row, n, start, context_slots))
            row += n
        return chunks

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: list,
                out: torch.Tensor) -> None:
        k_cache, v_cache, k_scale, v_scale = self.storage.layer(layer)
        params = self.layers[layer]
        for row, n, start, context_slots in plan:
            if context_slots is None:  # a fresh prompt attends its own new keys
                keys, values = k[row : row + n].transpose(0, 1), v[row : row + n].transpose(0, 1)
            else:
                keys = gather_slots(k_cache, k_scale, context_slots, q.dtype)
                values = gather_slots(v_cache, v_scale, context_slots, q.dtype)
            out[row : row + n] = causal_attention(q[row : row + n], keys, values, start, params.scale, params.window,
                                                  params.softcap)


def gather_slots(cache: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    gathered = cache.index_select(1, slots)
    return gathered if scales is None else dequantize(gathered, scales.index_select(1, slots), dtype)
