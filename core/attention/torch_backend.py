"""``torch``: attention in torch ops, on any device and cache dtype.

Decodes are gathered block by block into padded copies, in a few groups of
similar context length, and attend in one grouped matmul per group; each
prompt chunk attends with ``scaled_dot_product_attention`` over its own new
keys (a fresh prompt) or over what its sequence has cached.

In batch-invariant mode, queries go in blocks of ``INVARIANT_ROWS`` (the last
padded), each over its keys in steps of ``INVARIANT_KEYS`` at fixed
positions with an online softmax in float32: every op a query meets has the
same shape, whatever else is in its step (a padded copy would not: its
length, and so the reductions' order, would be the longest query's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.attention.backend import AttentionBackend, DecodeTables, PrefillTables
from conveyor.attention.ops import causal_attention, decode_attention
from conveyor.attention.storage import dequantize
from conveyor.model.invariant import INVARIANT_ROWS

# decodes per step are split into at most this many length groups, of at least this many each
MAX_DECODE_GROUPS = 4
MIN_DECODE_GROUP = 8
# batch-invariant mode: keys per step of the online softmax (steps start at multiples of it)
INVARIANT_KEYS = 64


class TorchAttention(AttentionBackend):
    """Torch ops over gathered blocks: the reference path, and the fallback where no kernel runs."""

    name = "torch"

    @classmethod
    def unavailable(cls, device: torch.device) -> str | None:
        return None

    def plan_decodes(self, tables: DecodeTables) -> list | DecodeTables:
        if self.batch_invariant:
            return tables
        device, size = self.storage.device, self.storage.block_size
        context_lens = tables.context_lens.tolist()
        order = sorted(range(len(context_lens)), key=context_lens.__getitem__)
        num_groups = min(MAX_DECODE_GROUPS, -(-len(order) // MIN_DECODE_GROUP))
        groups = []
        for g in range(num_groups):
            rows = torch.tensor(order[g * len(order) // num_groups : (g + 1) * len(order) // num_groups], device=device)
            width = -(-context_lens[order[(g + 1) * len(order) // num_groups - 1]] // size)
            # NOTE: index_select over whole blocks is ~4x faster than advanced indexing on CPU. (Entries past a
            # row's own blocks are blocks of the pool, masked out by its context length.)
            blocks = tables.tables[rows, :width].long().flatten()
            positions = torch.arange(width * size, device=device)
            groups.append((rows, blocks, positions, tables.context_lens[rows].unsqueeze(1)))
        return groups

    def decode(self, layer: int, q: torch.Tensor, plan: list | DecodeTables, out: torch.Tensor) -> None:
        if isinstance(plan, DecodeTables):  # (batch-invariant mode)
            for first in range(0, q.shape[0], INVARIANT_ROWS):
                rows = slice(first, first + INVARIANT_ROWS)
                out[rows] = self._invariant_block(layer, q[rows], plan.tables[rows], plan.context_lens[rows])
            return
        k_cache, v_cache, k_scale, v_scale = self.storage.layer(layer)
        params = self.layers[layer]
        for rows, blocks, positions, context in plan:
            mask = positions < context
            if params.window:
                mask &= positions >= context - params.window
            keys = self._gather_blocks(k_cache, k_scale, blocks, rows.shape[0], q.dtype)
            values = self._gather_blocks(v_cache, v_scale, blocks, rows.shape[0], q.dtype)
            out[rows] = decode_attention(q[rows], keys, values, mask, params.scale, params.softcap)

    def _invariant_block(self, layer: int, q: torch.Tensor, tables: torch.Tensor,
                         context_lens: torch.Tensor) -> torch.Tensor:
        """Up to ``INVARIANT_ROWS`` decodes (``q [n, Hq, D]``), padded to that many, in the batch-invariant way."""
        k_cache, v_cache, k_scale, v_scale = self.storage.layer(layer)
        params = self.layers[layer]
        size, rows, width = self.storage.block_size, INVARIANT_ROWS, INVARIANT_KEYS
        n, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[0]
        pad = rows - n  # (padding rows see the first key of block 0)
        queries = F.pad(q.float(), (0, 0, 0, 0, 0, pad)).view(rows, num_kv_heads, -1, 1, head_dim)
        context = F.pad(context_lens.long(), (0, pad), value=1).unsqueeze(1)
        tables = F.pad(tables.long(), (0, 0, 0, pad))
        first = (context - params.window).clamp(min=0) if params.window else torch.zeros_like(context)
        # running max, sum and weighted values of each query head: [R, Hkv, G, 1], [R, Hkv, G, D]
        top = torch.full((*queries.shape[:3], 1), float("-inf"), device=q.device)
        total = torch.zeros_like(top)
        acc = torch.zeros(queries.shape[:3] + (head_dim,), device=q.device)

        def gather(cache: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor:
            rows_of_keys = gather_slots(cache, scales, slots, torch.float32).float()  # [Hkv, R * W, D]
            return rows_of_keys.view(num_kv_heads, rows, 1, width, head_dim).transpose(0, 1)  # [R, Hkv, 1, W, D]

        for start in range(int(first.min()) // width * width, int(context.max()), width):
            positions = torch.arange(start, start + width, device=q.device)
            seen = (positions < context) & (positions >= first)  # [R, W]
            blocks = tables[:, (positions // size).clamp(max=tables.shape[1] - 1)]
            slots = torch.where(seen, blocks * size + positions % size, 0).flatten()
            scores = (queries * gather(k_cache, k_scale, slots)).sum(-1) * params.scale  # [R, Hkv, G, W]
            if params.softcap:
                scores = torch.tanh(scores / params.softcap) * params.softcap
            scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
            new_top = torch.maximum(top, scores.amax(-1, keepdim=True))
            shift = new_top.masked_fill(new_top == float("-inf"), 0.0)  # (queries that have seen no key yet)
            probs, kept = torch.exp(scores - shift), torch.exp(top - shift)
            total = total * kept + probs.sum(-1, keepdim=True)
            acc = acc * kept + (probs.unsqueeze(-1) * gather(v_cache, v_scale, slots)).sum(-2)
            top = new_top
        return (acc / total).view(rows, num_heads, head_dim)[:n].to(q.dtype)

    def _gather_blocks(self, cache: torch.Tensor, scales: torch.Tensor | None, blocks: torch.Tensor, rows: int,
                       dtype: torch.dtype) -> torch.Tensor:
        num_kv_heads, num_blocks = cache.shape[0], self.storage.num_blocks
        shape = (num_kv_heads, rows, -1, cache.shape[2])
        gathered = cache.view(num_kv_heads, num_blocks, -1).index_select(1, blocks).view(shape)
        if scales is None:
            return gathered
        gathered_scales = scales.view(num_kv_heads, num_blocks, -1).index_select(1, blocks).view(shape[:-1])
        return dequantize(gathered, gathered_scales, dtype)

    def plan_prefills(self, tables: PrefillTables) -> list:
        device, size = self.storage.device, self.storage.block_size
        # (first row, rows, first position, slots of the whole context or None when it starts at 0)
        chunks = []
        for i, (row, n, start) in enumerate(zip(tables.rows.tolist(), tables.lens.tolist(), tables.starts.tolist())):
            context_slots = None
            if start > 0:
                blocks = tables.tables[i, : -(-(start + n) // size)].long()
                context_slots = (blocks.unsqueeze(1) * size + torch.arange(size, device=device)).flatten()[: start + n]
            chunks.append((row, n, start, context_slots))
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
