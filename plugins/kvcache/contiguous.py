"""``contiguous``: the baseline layout: each admitted request reserves one
contiguous slab for the longest it may grow."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Annotated, Literal

import msgspec

from conveyor.attention.blocks import BlockStorage, blocks_for_budget, log_capacity
from conveyor.hookspecs import hookimpl
from conveyor.kvcache import KVCache, KVCacheSpec, PrefixMatch
from conveyor.model.llama import AttentionFn
from conveyor.request import Request

# Slabs are runs of consecutive blocks of this many tokens in the shared storage.
GRANULE = 16


class ContiguousOptions(msgspec.Struct, forbid_unknown_fields=True):
    # CPU: memory for the cache, in GiB
    memory_gb: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    # GPU: fraction of the free device memory (measured after the weights load) for the cache
    memory_fraction: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.9
    # slab size: "max_model_len" for every request (classic static serving), or
    # "request": its prompt + max_tokens
    reserve: Literal["max_model_len", "request"] = "max_model_len"
    # a fixed capacity in tokens instead of sizing from memory; 0: size from memory
    num_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    # attention implementation: "auto" (Triton kernels on CUDA; on CPU the C++ decode kernel where it builds,
    # torch otherwise), "cpu", "torch" or "triton"
    attention: Literal["auto", "cpu", "torch", "triton"] = "auto"


class ContiguousKVCache(KVCache):
    """Contiguous KV cache: one slab per request, reserved whole at admission.

    Memory reserved for tokens a request never produces is wasted, and free
    space splits into holes between slabs; ``stats()`` reports both.
    """

    name = "contiguous"
    Options = ContiguousOptions

    def __init__(self, options: ContiguousOptions, spec: KVCacheSpec):
        super().__init__(options, spec)
        if options.num_tokens:
            num_blocks = -(-options.num_tokens // GRANULE)
        else:
            num_blocks = blocks_for_budget(spec, GRANULE, options.memory_gb, options.memory_fraction)
        if num_blocks < 1:
            raise ValueError(f"[kvcache] the memory budget holds no block of {GRANULE} tokens")
        self.num_blocks = num_blocks
        self.storage = BlockStorage(spec, num_blocks, GRANULE, options.attention)
        # free runs as sorted (start block, length)
        self.holes: list[tuple[int, int]] = [(0, num_blocks)]
        # request id -> (first block, number of blocks)
        self.slabs: dict[str, tuple[int, int]] = {}
        # request id -> tokens actually stored
        self.used: dict[str, int] = {}
        log_capacity(self.name, num_blocks, GRANULE, spec)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * GRANULE

    def can_fit(self, sizes: Sequence[int]) -> bool:
        return sum(self._slab_blocks_for(n) for n in sizes) <= self.num_blocks

    def _slab_blocks_for(self, max_total_tokens: int) -> int:
        tokens = self.spec.max_model_len if self.options.reserve == "max_model_len" else max_total_tokens
        return -(-tokens // GRANULE)

    def allocate(self, request: Request, num_new_tokens: int, prefix: PrefixMatch | None = None) -> bool:
        rid = request.request_id
        if rid not in self.slabs:
            size = self._slab_blocks_for(request.max_total_tokens)
            for i, (start, length) in enumerate(self.holes):  # first fit
                if length >= size:
                    self.slabs[rid] = (start, size)
                    self.holes[i : i + 1] = [(start + size, length - size)] if length > size else []
                    break
            else:
                return False
        self.used[rid] = request.num_computed_tokens + num_new_tokens
        return True

    def free(self, request: Request) -> None:
        slab = self.slabs.pop(request.request_id, None)
        self.used.pop(request.request_id, None)
        if slab is None:
            return
        i = bisect.bisect(self.holes, slab)
        self.holes.insert(i, slab)
        # merge with the neighbours
        merged: list[tuple[int, int]] = []
        for start, length in self.holes:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self.holes = merged

    @property
    def num_free_blocks(self) -> int:
        return sum(length for _, length in self.holes)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def stats(self) -> dict[str, float]:
        reserved = sum(length for _, length in self.slabs.values()) * GRANULE
        used = sum(self.used.values())
        return {
            "usage": self.usage(),
            "num_blocks": self.num_blocks,
            "num_free_blocks": self.num_free_blocks,
            "reserved_tokens": reserved,
            "used_tokens": used,
            # reserved for tokens that are not there (yet)
            "reserved_unused_tokens": reserved - used,
            "largest_hole_tokens": max((length for _, length in self.holes), default=0) * GRANULE,
        }

    def prepare(self, requests: Sequence[Request], num_tokens: Sequence[int], num_decodes: int) -> AttentionFn:
        tables = []
        for r in requests:
            start, _ = self.slabs[r.request_id]
            # the stored part of the slab, as a run of consecutive blocks
            tables.append(list(range(start, start + -(-self.used[r.request_id] // GRANULE))))
        return self.storage.attention(tables, requests, num_tokens, num_decodes)


@hookimpl
def conveyor_register_kvcaches(register):
    register(ContiguousKVCache)
