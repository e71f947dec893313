"""``triton``: the Triton kernels of ``conveyor.attention.kernels``, the CUDA path.

Decodes and prompt chunks both attend over the block tables with an online
softmax, reading an fp8 cache with its scales. On a CPU they run only under
``TRITON_INTERPRET=1`` (slowly: tests use it).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from conveyor.attention.backend import AttentionBackend, DecodeTables, PrefillTables


class TritonAttention(AttentionBackend):
    """Triton kernels over the block tables."""

    name = "triton"
    decode_tables = True

    @classmethod
    def unavailable(cls, device: torch.device) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "the triton package is not installed"
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return (
                f"the Triton kernels need a CUDA GPU and the model is on {device}; "
                "set TRITON_INTERPRET=1 to run them (slowly) on the CPU, or use attention = 'auto'"
            )
        return None

    def _layer(self, layer: int):
        k_cache, v_cache, k_scale, v_scale = self.storage.layer(layer)
        if k_scale is not None:  # the kernels read e4m3 values
            k_cache, v_cache = k_cache.view(torch.float8_e4m3fn), v_cache.view(torch.float8_e4m3fn)
        return k_cache, v_cache, k_scale, v_scale

    def decode(self, layer: int, q: torch.Tensor, plan: DecodeTables, out: torch.Tensor) -> None:
        from conveyor.attention.kernels import paged_decode_attention

        k_cache, v_cache, k_scale, v_scale = self._layer(layer)
        params = self.layers[layer]
        paged_decode_attention(q, k_cache, v_cache, plan.tables, plan.context_lens, self.storage.block_size,
                               k_scale, v_scale, out, params.scale, params.window, params.softcap)

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PrefillTables,
                out: torch.Tensor) -> None:
        from conveyor.attention.kernels import paged_prefill_attention

        k_cache, v_cache, k_scale, v_scale = self._layer(layer)
        params = self.layers[layer]
        paged_prefill_attention(q, k_cache, v_cache, plan.tables, plan.rows, plan.lens, plan.starts,
                                self.storage.block_size, plan.max_len, out, k_scale, v_scale, params.scale,
                                params.window, params.softcap)
