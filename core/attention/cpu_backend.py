"""``cpu``: the C++ kernels of ``conveyor.native`` (built for this CPU on first use).

Decodes read each key and value row once, in place in its block (float32,
bfloat16, float16 or an fp8 cache). Prompt chunks run in the prefill kernel
where the CPU has AVX-512 BF16, the cache is bfloat16 and head_dim is 64 or
128; elsewhere in torch ops. With this backend the model's norms, rotary
embedding and SwiGLU run in the fused C++ kernels too.
"""

from __future__ import annotations

import torch

from conveyor import native
from conveyor.attention.backend import DecodeTables, PrefillTables
from conveyor.attention.storage import KVStorage
from conveyor.attention.torch_backend import TorchAttention


class CpuAttention(TorchAttention):
    """C++ kernels over the block tables (decodes always, prompt chunks where the CPU allows)."""

    name = "cpu"
    fused_layers = True
    decode_tables = True

    @classmethod
    def unavailable(cls, device: torch.device) -> str | None:
        if device.type != "cpu":
            return f"the C++ kernels run on the CPU, and the model is on {device}"
        if not native.load():
            return "the C++ kernels could not be built on this machine (see the warning above)"
        return None

    def __init__(self, storage: KVStorage):
        super().__init__(storage)
        self.prefill_kernel = native.prefill_supported(
            torch.empty(0, 1, storage.layout.spec.head_dim, dtype=storage.dtype), storage.k[0]
        )

    def plan_decodes(self, tables: list[list[int]], context_lens: list[int]) -> DecodeTables:
        return DecodeTables.build(tables, context_lens, self.storage.device)

    def decode(self, layer: int, q: torch.Tensor, plan: DecodeTables, out: torch.Tensor) -> None:
        k_cache, v_cache, k_scale, v_scale = self.storage.layer(layer)
        native.paged_decode_attention(
            q, k_cache, v_cache, plan.tables, plan.context_lens, self.storage.block_size, k_scale, v_scale, out=out
        )

    def plan_prefills(self, tables: list[list[int]], starts: list[int], lens: list[int], first_row: int):
        if not self.prefill_kernel:
            return super().plan_prefills(tables, starts, lens, first_row)
        return PrefillTables.build(tables, starts, lens, first_row, self.storage.device)

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan, out: torch.Tensor) -> None:
        if not self.prefill_kernel:
            return super().prefill(layer, q, k, v, plan, out)
        k_cache, v_cache, _, _ = self.storage.layer(layer)
        native.paged_prefill_attention(
            q, k_cache, v_cache, plan.tables, plan.rows, plan.lens, plan.starts, self.storage.block_size, out
        )
