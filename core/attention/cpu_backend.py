"""``cpu``: the C++ kernels of ``conveyor.native`` (built for this CPU on first use).

Decodes read each key and value row once, in place in its block (float32,
bfloat16, float16 or an fp8 cache). Prompt chunks run in the prefill kernel
where the CPU has AVX-512 BF16, the cache is bfloat16, head_dim is 64 or 128,
and it beats torch's ``scaled_dot_product_attention`` over gathered blocks in
a measurement; elsewhere in torch ops. The measurement is taken once per
machine and shape and kept (``prefill_choice_path``): every process then
computes prompts the same way, so a server and an offline run give the same
tokens, however busy the machine was when each started (the two paths round
differently; a fresh measurement per process flipped on a loaded 2-core
machine). Delete the file to measure again.

NOTE: which prefill wins depends on the CPU. On an Intel Xeon with AMX, SDPA
(its CPU flash attention runs on AMX tiles) took 0.8 ms for a fresh
512-token chunk against the kernel's 2.9 ms, and 2.5 ms against 8.9 ms for
512 tokens over 512 cached ones, gather included; the kernel was written on
an AMD EPYC with AVX-512 BF16 and no AMX.

With this backend the model's norms, rotary embedding and SwiGLU run in the
fused C++ kernels too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from conveyor import native, paths
from conveyor.attention.backend import DecodeTables, LayerAttention, PrefillTables
from conveyor.attention.ops import causal_attention
from conveyor.attention.storage import KVStorage
from conveyor.attention.torch_backend import TorchAttention, gather_slots

logger = logging.getLogger("conveyor")


def prefill_choice_path(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> Path:
    """Where the prompt-chunk path chosen for this machine (its kernels' build) and shape is kept."""
    shape = f"{num_kv_heads}x{head_dim}-{str(dtype).removeprefix('torch.')}"
    return paths.cache_root() / "profiles" / f"prefill-{native.build_name()}-{shape}.txt"


def _best_seconds(fn, repeat: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


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

    def __init__(self, storage: KVStorage, layers: Sequence[LayerAttention] | None = None,
                 batch_invariant: bool = False):
        super().__init__(storage, layers, batch_invariant)
        spec = storage.layout.spec
        # (the prefill kernel has no sliding window or soft cap: models with either prefill in torch ops; in
        # batch-invariant mode every token runs in the decode kernel)
        plain = not any(params.window or params.softcap for params in self.layers)
        self.prefill_kernel = plain and not batch_invariant and native.prefill_supported(
            torch.empty(0, 1, spec.head_dim, dtype=storage.dtype), storage.k[0]
        ) and self._prefill_kernel_chosen(spec.num_kv_heads, spec.head_dim)
        logger.debug("cpu attention: prompt chunks in %s", "the C++ kernel" if self.prefill_kernel else "torch SDPA")

    def _prefill_kernel_chosen(self, num_kv_heads: int, head_dim: int) -> bool:
        """The kept choice for this machine and shape; measured and kept first where there is none. Of two
        processes that measure at once, the one that keeps its choice first wins and the other takes it."""
        path = prefill_choice_path(num_kv_heads, head_dim, self.storage.dtype)
        try:
            return path.read_text().strip() == "kernel"
        except OSError:
            pass
        choice = "kernel" if self._kernel_beats_sdpa(num_kv_heads, head_dim) else "sdpa"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "x") as f:
                f.write(choice + "\n")
        except FileExistsError:
            choice = path.read_text().strip()
        except OSError as e:  # a read-only cache: this process keeps its own measurement
            logger.debug("cannot keep the prefill choice in %s: %s", path, e)
        logger.debug("cpu attention: prefill choice %r kept in %s", choice, path)
        return choice == "kernel"

    def _kernel_beats_sdpa(self, num_kv_heads: int, head_dim: int) -> bool:
        """Time both prefill paths once on a scratch cache: 256 new tokens over 256 cached ones, query heads
        three to a KV head (about 10 ms)."""
        block_size, num_blocks, new, start = 16, 32, 256, 256
        k_cache = torch.randn(num_kv_heads, num_blocks * block_size, head_dim).to(self.storage.dtype)
        v_cache = torch.randn_like(k_cache)
        q = torch.randn(new, 3 * num_kv_heads, head_dim).to(self.storage.dtype)
        out = torch.empty_like(q)
        table = list(range(num_blocks))
        kernel_plan = PrefillTables(torch.tensor([table], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                                    torch.tensor([new], dtype=torch.int32), torch.tensor([start], dtype=torch.int32),
                                    new)
        slots = torch.arange(start + new)

        def kernel() -> None:
            native.paged_prefill_attention(q, k_cache, v_cache, kernel_plan.tables, kernel_plan.rows,
                                           kernel_plan.lens, kernel_plan.starts, block_size, out)

        def sdpa() -> None:
            keys, values = gather_slots(k_cache, None, slots, q.dtype), gather_slots(v_cache, None, slots, q.dtype)
            out.copy_(causal_attention(q, keys, values, start))

        return _best_seconds(kernel) < _best_seconds(sdpa)

    def plan_decodes(self, tables: DecodeTables) -> DecodeTables:
        return tables

    def decode(self, layer: int, q: torch.Tensor, plan: DecodeTables, out: torch.Tensor) -> None:
        k_cache, v_cache, k_scale, v_scale = self.storage.layer(layer)
        params = self.layers[layer]
        native.paged_decode_attention(q, k_cache, v_cache, plan.tables, plan.context_lens, self.storage.block_size,
                                      k_scale, v_scale, out, params.scale, params.window, params.softcap)

    def plan_prefills(self, tables: PrefillTables):
        return tables if self.prefill_kernel else super().plan_prefills(tables)

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan, out: torch.Tensor) -> None:
        if not self.prefill_kernel:
            return super().prefill(layer, q, k, v, plan, out)
        k_cache, v_cache, _, _ = self.storage.layer(layer)
        native.paged_prefill_attention(q, k_cache, v_cache, plan.tables, plan.rows, plan.lens, plan.starts,
                                       self.storage.block_size, out, self.layers[layer].scale)
