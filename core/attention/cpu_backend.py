"""``cpu``: the C++ kernels of ``conveyor.native`` (built for this CPU on first use).

Decodes read each key and value row once, in place in its block (float32,
bfloat16, float16 or an fp8 cache). Prompt chunks take the fastest in a
measurement of: the prefill kernel (where the CPU has AVX-512 BF16, the cache
is bfloat16 and head_dim is 64 or 128), the decode kernel with a row per
token (``prefills_as_decodes``: the input buffers write a chunk's token at
position p as a decode over the p + 1 keys cached by then; a step of them
then runs where steps of decodes do), and torch's
``scaled_dot_product_attention`` over gathered blocks; models with sliding
windows or soft caps, and fp8 caches, take the last. The measurement is taken once per machine and shape
and kept (``prefill_choice_path``): every process then computes prompts the
same way, so a server and an offline run give the same tokens, however busy
the machine was when each started (the paths round differently; a fresh
measurement per process flipped on a loaded 2-core machine). Delete the file
to measure again.

The prefill kernel packs every (sequence, KV head)'s keys and values into
tiles first, once a layer and step: for a short chunk over a long context
that packing is most of the time. On a 2-core AMD EPYC (Zen 4), 8 KV heads
of 64, a layer: 16 tokens over 16,384 cached took 17-25 ms in the kernel and
10 ms as decode rows; 256 over 256, 4.7 ms against 3.1 (docs/performance.md,
"Prompt chunks as decode rows").

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

from conveyor import native
from conveyor.config import paths
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
        # (the prefill kernel has no sliding window or soft cap: models with either prefill in torch ops, and so
        # do fp8 caches; in batch-invariant mode every token runs in the decode kernel)
        plain = not any(params.window or params.softcap for params in self.layers)
        choices = ["sdpa"]
        if plain and not batch_invariant and not storage.quantized:
            choices.append("rows")
            if native.prefill_supported(torch.empty(0, 1, spec.head_dim, dtype=storage.dtype), storage.k[0]):
                choices.append("kernel")
        self.prefill_path = self._prefill_choice(spec.num_kv_heads, spec.head_dim, choices)
        logger.debug("cpu attention: prompt chunks by %r", self.prefill_path)

    @property
    def prefills_as_decodes(self) -> bool:
        return self.batch_invariant or self.prefill_path == "rows"

    def _prefill_choice(self, num_kv_heads: int, head_dim: int, choices: list[str]) -> str:
        """The kept choice for this machine and shape; measured and kept first where there is none. Of two
        processes that measure at once, the one that keeps its choice first wins and the other takes it."""
        if len(choices) == 1:
            return choices[0]
        path = prefill_choice_path(num_kv_heads, head_dim, self.storage.dtype)
        try:
            kept = path.read_text().strip()
            if kept in choices:
                return kept
        except OSError:
            pass
        choice = self._fastest_prefill(num_kv_heads, head_dim, choices)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "x") as f:
                f.write(choice + "\n")
        except FileExistsError:
            kept = path.read_text().strip()
            choice = kept if kept in choices else choice
        except OSError as e:  # a read-only cache: this process keeps its own measurement
            logger.debug("cannot keep the prefill choice in %s: %s", path, e)
        logger.debug("cpu attention: prefill choice %r kept in %s", choice, path)
        return choice

    def _fastest_prefill(self, num_kv_heads: int, head_dim: int, choices: list[str]) -> str:
        """Time each path of ``choices`` once on a scratch cache: 256 new tokens over 256 cached ones, query heads
        three to a KV head (about 10 ms each)."""
        block_size, num_blocks, new, start = 16, 32, 256, 256
        generator = torch.Generator().manual_seed(0)  # (a backend made leaves torch's global generator alone)
        k_cache = torch.randn(num_kv_heads, num_blocks * block_size, head_dim, generator=generator)
        k_cache = k_cache.to(self.storage.dtype)
        v_cache = torch.randn(k_cache.shape, generator=generator).to(self.storage.dtype)
        q = torch.randn(new, 3 * num_kv_heads, head_dim, generator=generator).to(self.storage.dtype)
        out = torch.empty_like(q)
        table = list(range(num_blocks))
        plan = PrefillTables(torch.tensor([table], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                             torch.tensor([new], dtype=torch.int32), torch.tensor([start], dtype=torch.int32), new)
        # (as the input buffers write a chunk's tokens as decodes: its table each, and the keys up to each)
        rows = DecodeTables(torch.tensor([table] * new, dtype=torch.int32),
                            torch.arange(start + 1, start + new + 1, dtype=torch.int32))
        slots = torch.arange(start + new)

        def kernel() -> None:
            native.paged_prefill_attention(q, k_cache, v_cache, plan.tables, plan.rows, plan.lens, plan.starts,
                                           block_size, out)

        def by_rows() -> None:
            native.paged_decode_attention(q, k_cache, v_cache, rows.tables, rows.context_lens, block_size, out=out)

        def sdpa() -> None:
            keys, values = gather_slots(k_cache, None, slots, q.dtype), gather_slots(v_cache, None, slots, q.dtype)
            out.copy_(causal_attention(q, keys, values, start))

        paths = {"kernel": kernel, "rows": by_rows, "sdpa": sdpa}
        return min(choices, key=lambda choice: _best_seconds(paths[choice]))

    def plan_decodes(self, tables: DecodeTables) -> DecodeTables:
        return tables

    def decode(self, layer: int, q: torch.Tensor, plan: DecodeTables, out: torch.Tensor) -> None:
        k_cache, v_cache, k_scale, v_scale = self.storage.layer(layer)
        params = self.layers[layer]
        native.paged_decode_attention(q, k_cache, v_cache, plan.tables, plan.context_lens, self.storage.block_size,
                                      k_scale, v_scale, out, params.scale, params.window, params.softcap)

    def plan_prefills(self, tables: PrefillTables):
        return tables if self.prefill_path == "kernel" else super().plan_prefills(tables)

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan, out: torch.Tensor) -> None:
        if self.prefill_path != "kernel":
            return super().prefill(layer, q, k, v, plan, out)
        k_cache, v_cache, _, _ = self.storage.layer(layer)
        native.paged_prefill_attention(q, k_cache, v_cache, plan.tables, plan.rows, plan.lens, plan.starts,
                                       self.storage.block_size, out, self.layers[layer].scale)
