"""KV storage in fixed-size blocks, and attention over per-request block tables.

Both built-in KV cache layouts store K and V here; they differ only in how
they hand out blocks (paged: one at a time, shared through the prefix cache;
contiguous: a whole slab of consecutive blocks per request). On CUDA the
attention runs in Triton kernels (conveyor.attention.kernels). On CPU it runs
in the C++ kernels of conveyor.native where they build: decodes always,
prompt chunks where the CPU has AVX-512 BF16 and the cache is bf16; torch
does the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from conveyor import native
from conveyor.attention.ops import causal_attention, decode_attention
from conveyor.kvcache import SCALE_DTYPE, KVCacheSpec
from conveyor.request import Request

logger = logging.getLogger("conveyor")

# decodes per step are split into at most this many length groups, of at least this many each
MAX_DECODE_GROUPS = 4
MIN_DECODE_GROUP = 8
FP8_MAX = 448.0


def blocks_for_budget(spec: KVCacheSpec, block_size: int, memory_gb: float, memory_fraction: float) -> int:
    """How many blocks the memory budget holds: measured free memory on GPU, ``memory_gb`` on CPU."""
    if spec.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(spec.device)
        budget = free * memory_fraction
    else:
        budget = memory_gb * 2**30
    return int(budget // (block_size * spec.bytes_per_token))


def log_capacity(name: str, num_blocks: int, block_size: int, spec: KVCacheSpec) -> None:
    capacity = num_blocks * block_size
    logger.info(
        "KV cache (%s, %s): %d blocks x %d tokens = %d tokens, %.2f GiB (%d B/token = 2 x %d layers x %d kv heads x %s);"
        " max concurrency at max_model_len %d: %.1f",
        name, str(spec.storage_dtype).removeprefix("torch."), num_blocks, block_size, capacity,
        capacity * spec.bytes_per_token / 2**30, spec.bytes_per_token, spec.num_layers, spec.num_kv_heads,
        f"({spec.head_dim} x 1 B + {SCALE_DTYPE.itemsize} B scale)" if spec.quantized
        else f"{spec.head_dim} x {spec.dtype.itemsize} B",
        spec.max_model_len, capacity / spec.max_model_len,
    )


def quantize_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 with one scale per token and head: ``x[t, h] ~= q[t, h] * scale[t, h]``.

    Args:
        x: ``[tokens, kv_heads, head_dim]``.

    Returns:
        q as uint8 bits ``[tokens, kv_heads, head_dim]`` and the scales ``[tokens, kv_heads]`` (SCALE_DTYPE).
    """
    scale = (x.abs().amax(dim=-1).float() / FP8_MAX).clamp_min(1e-8).to(SCALE_DTYPE)
    q = (x.float() / scale.float()[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), scale


def dequantize(bits: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of ``quantize_heads`` on gathered rows: ``bits [..., D]`` (uint8), ``scale [...]``."""
    return bits.view(torch.float8_e4m3fn).to(dtype) * scale.to(dtype).unsqueeze(-1)


def _padded_int32(rows: Sequence[list[int]], device: torch.device) -> torch.Tensor:
    """Block tables as one int32 tensor, each row padded with block 0 (never read past its length)."""
    width = max(len(t) for t in rows)
    return torch.tensor([t + [0] * (width - len(t)) for t in rows], dtype=torch.int32, device=device)


class BlockStorage:
    """K and V tensors for every layer: ``[layers, kv_heads, num_blocks * block_size, head_dim]``.

    Head-major: the keys of one head in one block are a contiguous
    ``[block_size, head_dim]`` matrix, so gathered blocks multiply without a copy.
    An fp8 cache (``spec.cache_dtype``) stores e4m3 values (kept as uint8 bits,
    which CPU copies support) and a scale per token and head in ``k_scale``
    and ``v_scale`` ``[layers, kv_heads, slots]``; attention dequantizes what it reads.
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, block_size: int, backend: str = "auto"):
        """
        Args:
            backend: "triton" (kernels), "cpu" (the C++ kernels), "torch", or "auto": triton on
                CUDA; on CPU the C++ kernels where they build, torch otherwise.
        """
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        on_cpu = spec.device.type == "cpu"
        self.use_triton = backend == "triton" or (backend == "auto" and spec.device.type == "cuda")
        if backend == "cpu":
            if not on_cpu:
                raise ValueError(f'[kvcache] attention = "cpu" needs the CPU device, not {spec.device}')
            if not native.load():
                raise RuntimeError('[kvcache] attention = "cpu": the C++ kernels could not be built here'
                                   ' (see the warning above); use "auto" or "torch"')
        self.use_cpu_kernel = backend == "cpu" or (backend == "auto" and on_cpu and native.load())
        shape = (spec.num_layers, spec.num_kv_heads, num_blocks * block_size, spec.head_dim)
        self.quantized = spec.quantized
        dtype = torch.uint8 if self.quantized else spec.dtype
        self.k = torch.zeros(shape, dtype=dtype, device=spec.device)
        self.v = torch.zeros(shape, dtype=dtype, device=spec.device)
        self.k_scale = self.v_scale = None
        if self.quantized:
            self.k_scale = torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=spec.device)
            self.v_scale = torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=spec.device)
        # prompt chunks too, where the CPU has AVX-512 BF16 and the cache is bf16 (else scaled_dot_product_attention)
        self.use_cpu_prefill = self.use_cpu_kernel and native.prefill_supported(
            torch.empty(0, 1, spec.head_dim, dtype=spec.dtype), self.k[0]
        )
        # whether decodes / prompt chunks run in a kernel over the block tables (else the torch path)
        self.kernel_decodes = self.use_triton or self.use_cpu_kernel
        self.kernel_prefills = self.use_triton or self.use_cpu_prefill

    @property
    def num_bytes(self) -> int:
        scales = self.k_scale.nbytes + self.v_scale.nbytes if self.quantized else 0
        return self.k.nbytes + self.v.nbytes + scales

    def attention(
        self, tables: Sequence[list[int]], requests: Sequence[Request], num_tokens: Sequence[int], num_decodes: int
    ) -> BlockTableAttention:
        return BlockTableAttention(self, tables, requests, num_tokens, num_decodes)


class BlockTableAttention:
    """One step's attention: writes the new K, V through the slot mapping, then attends.

    Decodes (one query each) attend as one padded batch over their block
    tables; each prefill chunk attends over its own context.
    """

    def __init__(
        self,
        storage: BlockStorage,
        tables: Sequence[list[int]],
        requests: Sequence[Request],
        num_tokens: Sequence[int],
        num_decodes: int,
    ):
        self.storage = storage
        device = storage.spec.device
        size = storage.block_size
        slots: list[int] = []
        for table, request, n in zip(tables, requests, num_tokens):
            start = request.num_computed_tokens
            slots.extend(table[p // size] * size + p % size for p in range(start, start + n))
        self.slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
        self.num_decodes = num_decodes
        # torch path: decodes attend in groups of similar context length, each padded only to its own longest.
        self.decode_groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        if num_decodes and storage.kernel_decodes:
            self._prepare_decode_tables(tables, requests, num_decodes)
        elif num_decodes:
            order = sorted(range(num_decodes), key=lambda i: len(tables[i]))
            num_groups = min(MAX_DECODE_GROUPS, -(-num_decodes // MIN_DECODE_GROUP))
            for g in range(num_groups):
                rows = order[g * num_decodes // num_groups : (g + 1) * num_decodes // num_groups]
                width = len(tables[rows[-1]])
                padded = [tables[i] + [0] * (width - len(tables[i])) for i in rows]
                # NOTE: index_select over whole blocks is ~4x faster than advanced indexing on CPU.
                blocks = torch.tensor(padded, dtype=torch.long, device=device).flatten()
                context = torch.tensor([requests[i].num_computed_tokens + 1 for i in rows], device=device)
                mask = torch.arange(width * size, device=device) < context.unsqueeze(1)
                self.decode_groups.append((torch.tensor(rows, device=device), blocks, mask))
        # (first row, rows, first position, slots of the whole context or None when it starts at 0)
        self.prefills: list[tuple[int, int, int, torch.Tensor | None]] = []
        row = num_decodes
        for table, request, n in zip(tables[num_decodes:], requests[num_decodes:], num_tokens[num_decodes:]):
            start = request.num_computed_tokens
            context_slots = None
            if start > 0 and not storage.kernel_prefills:
                blocks = torch.tensor(table, dtype=torch.long, device=device)
                context_slots = (blocks.unsqueeze(1) * size + torch.arange(size, device=device)).flatten()[: start + n]
            self.prefills.append((row, n, start, context_slots))
            row += n
        if self.prefills and storage.kernel_prefills:
            self._prepare_prefill_tables(tables, num_decodes)

    def _prepare_decode_tables(
        self, tables: Sequence[list[int]], requests: Sequence[Request], num_decodes: int
    ) -> None:
        self.decode_tables = _padded_int32(tables[:num_decodes], self.storage.spec.device)
        self.decode_context = torch.tensor(
            [r.num_computed_tokens + 1 for r in requests[:num_decodes]], dtype=torch.int32, device=self.storage.spec.device
        )

    def _prepare_prefill_tables(self, tables: Sequence[list[int]], num_decodes: int) -> None:
        device = self.storage.spec.device

        def int32(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        self.prefill_tables = _padded_int32(tables[num_decodes:], device)
        self.prefill_rows = int32([row for row, _, _, _ in self.prefills])
        self.prefill_lens = int32([n for _, n, _, _ in self.prefills])
        self.prefill_starts = int32([start for _, _, start, _ in self.prefills])
        self.max_prefill_len = max(n for _, n, _, _ in self.prefills)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        storage = self.storage
        # [Hkv, slots, D] for this layer
        k_cache, v_cache = storage.k[layer], storage.v[layer]
        k_scale = v_scale = None
        if storage.quantized:
            k_scale, v_scale = storage.k_scale[layer], storage.v_scale[layer]
            for cache, scales, new in ((k_cache, k_scale, k), (v_cache, v_scale, v)):
                bits, scale = quantize_heads(new)
                cache.index_copy_(1, self.slot_mapping, bits.transpose(0, 1))
                scales.index_copy_(1, self.slot_mapping, scale.transpose(0, 1))
        else:
            k_cache.index_copy_(1, self.slot_mapping, k.transpose(0, 1))
            v_cache.index_copy_(1, self.slot_mapping, v.transpose(0, 1))
        if storage.use_triton:
            return self._kernels(q, k_cache, v_cache, k_scale, v_scale)
        out = torch.empty_like(q)
        num_kv_heads, num_blocks = k_cache.shape[0], storage.num_blocks

        def gather_blocks(cache: torch.Tensor, scales: torch.Tensor | None, blocks: torch.Tensor, rows: int):
            shape = (num_kv_heads, rows, -1, cache.shape[2])
            gathered = cache.view(num_kv_heads, num_blocks, -1).index_select(1, blocks).view(shape)
            if scales is None:
                return gathered
            gathered_scales = scales.view(num_kv_heads, num_blocks, -1).index_select(1, blocks).view(shape[:-1])
            return dequantize(gathered, gathered_scales, q.dtype)

        def gather_slots(cache: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor):
            gathered = cache.index_select(1, slots)
            return gathered if scales is None else dequantize(gathered, scales.index_select(1, slots), q.dtype)

        if storage.use_cpu_kernel and self.num_decodes:
            native.paged_decode_attention(
                q[: self.num_decodes], k_cache, v_cache, self.decode_tables, self.decode_context,
                storage.block_size, k_scale, v_scale, out=out[: self.num_decodes],
            )
        for rows, blocks, mask in self.decode_groups:
            keys = gather_blocks(k_cache, k_scale, blocks, rows.shape[0])
            values = gather_blocks(v_cache, v_scale, blocks, rows.shape[0])
            out[rows] = decode_attention(q[rows], keys, values, mask)
        if storage.use_cpu_prefill and self.prefills:
            native.paged_prefill_attention(
                q, k_cache, v_cache, self.prefill_tables, self.prefill_rows, self.prefill_lens, self.prefill_starts,
                storage.block_size, out,
            )
            return out
        for row, n, start, context_slots in self.prefills:
            if context_slots is None:
                keys, values = k[row : row + n].transpose(0, 1), v[row : row + n].transpose(0, 1)
            else:
                keys = gather_slots(k_cache, k_scale, context_slots)
                values = gather_slots(v_cache, v_scale, context_slots)
            out[row : row + n] = causal_attention(q[row : row + n], keys, values, start)
        return out

    def _kernels(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> torch.Tensor:
        from conveyor.attention.kernels import paged_decode_attention, paged_prefill_attention

        if k_scale is not None:  # the kernels read e4m3 values
            k_cache, v_cache = k_cache.view(torch.float8_e4m3fn), v_cache.view(torch.float8_e4m3fn)
        size = self.storage.block_size
        out = torch.empty_like(q)
        if self.num_decodes:
            out[: self.num_decodes] = paged_decode_attention(
                q[: self.num_decodes], k_cache, v_cache, self.decode_tables, self.decode_context, size,
                k_scale, v_scale,
            )
        if self.prefills:
            paged_prefill_attention(
                q, k_cache, v_cache, self.prefill_tables, self.prefill_rows, self.prefill_lens,
                self.prefill_starts, size, self.max_prefill_len, out=out, k_scale=k_scale, v_scale=v_scale,
            )
        return out
