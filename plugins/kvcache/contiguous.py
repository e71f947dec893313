"""``contiguous``: the baseline layout: each admitted request reserves one
contiguous slab for the longest it may grow."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import msgspec

from conveyor.kvcache import KVCacheManager, KVCacheSpec, PrefixMatch, blocks_in_budget, log_capacity
from conveyor.messages import KVCacheStats
from conveyor.plugins.kvcache.declarations import ContiguousOptions
from conveyor.request import Request

# Slabs are runs of consecutive blocks of this many tokens in the shared storage.
GRANULE = 16


class ContiguousKVCache(KVCacheManager):
    """Contiguous KV cache: one slab per request, reserved whole at admission.

    Memory reserved for tokens a request never produces is wasted, and free
    space splits into holes between slabs; ``stats()`` reports both.
    """

    name = "contiguous"
    Options = ContiguousOptions

    def __init__(self, options: ContiguousOptions, spec: KVCacheSpec, free_memory: int | None = None):
        super().__init__(options, msgspec.structs.replace(spec, cache_dtype=options.dtype), free_memory)
        self.block_size = GRANULE
        if options.num_tokens:
            num_blocks = -(-options.num_tokens // GRANULE)
        else:
            num_blocks = blocks_in_budget(options, self.spec, GRANULE, free_memory)
        self.num_blocks = num_blocks
        slab = self._slab_blocks_for(self.spec.max_model_len)
        if options.reserve == "max_model_len" and num_blocks < slab:
            raise ValueError(
                f"[kvcache] the cache holds {num_blocks * GRANULE} tokens, less than one slab of max_model_len "
                f"({slab * GRANULE} tokens, reserve = \"max_model_len\"): no request could run; make it larger "
                "(num_tokens, memory_gb or memory_fraction), reserve = \"request\", or [model] max_model_len smaller"
            )
        # free runs as sorted (start block, length)
        self.holes: list[tuple[int, int]] = [(0, num_blocks)]
        # request id -> (first block, number of blocks)
        self.slabs: dict[str, tuple[int, int]] = {}
        # request id -> tokens actually stored
        self.used: dict[str, int] = {}
        log_capacity(self.name, num_blocks, GRANULE, self.spec)

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

    def block_ids(self, request: Request) -> list[int]:
        start, _ = self.slabs[request.request_id]
        # the stored part of the slab, as a run of consecutive blocks
        return list(range(start, start + -(-self.used[request.request_id] // GRANULE)))

    def stats(self) -> KVCacheStats:
        reserved = sum(length for _, length in self.slabs.values()) * GRANULE
        return KVCacheStats(
            usage=self.usage(),
            num_blocks=self.num_blocks,
            num_free_blocks=self.num_free_blocks,
            block_size=GRANULE,
            reserved_tokens=reserved,
            used_tokens=sum(self.used.values()),
            largest_hole_tokens=max((length for _, length in self.holes), default=0) * GRANULE,
        )
