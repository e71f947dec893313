"""The KV cache tensors of one worker: keys and values of every layer in fixed-size blocks."""

from __future__ import annotations

import torch

from conveyor import native
from conveyor.kvcache import KVCacheLayout
from conveyor.model.formats import quantize_fp8
from conveyor.model.loader import DTYPES

# the per-token, per-head scale of an fp8 cache
SCALE_DTYPE = torch.bfloat16


class KVStorage:
    """K and V for every layer: ``[layers, kv_heads, (num_blocks + 1) * block_size, head_dim]``.

    Slot ``block * block_size + offset`` holds one token. Head-major: the keys
    of one head in one block are a contiguous ``[block_size, head_dim]``
    matrix, so gathered blocks multiply without a copy. An fp8 cache stores
    e4m3 values (as uint8 bits, which CPU copies support) and a bfloat16 scale
    per token and head in ``k_scale`` and ``v_scale`` ``[layers, kv_heads, slots]``.
    """

    def __init__(self, layout: KVCacheLayout, device: torch.device):
        spec = layout.spec
        self.layout = layout
        # the pool's blocks, and one more that the KV cache manager never hands out: the rows that pad a
        # compiled step to its batch size write and read there
        self.num_blocks = layout.num_blocks + 1
        self.pad_block = layout.num_blocks
        self.block_size = layout.block_size
        self.device = device
        # the model's activation dtype (what attention computes in)
        self.dtype = DTYPES[spec.dtype]
        self.quantized = spec.quantized
        shape = (spec.num_layers, spec.num_kv_heads, self.num_blocks * layout.block_size, spec.head_dim)
        self.k = torch.zeros(shape, dtype=torch.uint8 if self.quantized else self.dtype, device=device)
        self.v = torch.zeros_like(self.k)
        # a CPU with the C++ kernels stores rows in one pass (index_copy_ elsewhere)
        self.native_store = device.type == "cpu" and native.load()
        self.k_scale = self.v_scale = None
        if self.quantized:
            self.k_scale = torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=device)
            self.v_scale = torch.zeros_like(self.k_scale)

    @property
    def num_bytes(self) -> int:
        scales = self.k_scale.nbytes + self.v_scale.nbytes if self.quantized else 0
        return self.k.nbytes + self.v.nbytes + scales

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """K, V ``[kv_heads, slots, head_dim]`` of one layer, and their scales ``[kv_heads, slots]`` (fp8 only)."""
        if not self.quantized:
            return self.k[index], self.v[index], None, None
        return self.k[index], self.v[index], self.k_scale[index], self.v_scale[index]

    def write(self, index: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's new keys and values ``[tokens, kv_heads, head_dim]`` of one layer at their slots."""
        k_cache, v_cache, k_scale, v_scale = self.layer(index)
        if not self.quantized and self.native_store:
            native.store_kv(k_cache, v_cache, slot_mapping, k, v)
            return
        if not self.quantized:
            k_cache.index_copy_(1, slot_mapping, k.transpose(0, 1))
            v_cache.index_copy_(1, slot_mapping, v.transpose(0, 1))
            return
        for cache, scales, new in ((k_cache, k_scale, k), (v_cache, v_scale, v)):
            values, scale = quantize_fp8(new, SCALE_DTYPE)
            cache.index_copy_(1, slot_mapping, values.view(torch.uint8).transpose(0, 1))
            scales.index_copy_(1, slot_mapping, scale.transpose(0, 1))


def dequantize(bits: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 cache rows back to ``dtype``: ``bits [..., D]`` (uint8 e4m3) times ``scale [...]``."""
    return bits.view(torch.float8_e4m3fn).to(dtype) * scale.to(dtype).unsqueeze(-1)
