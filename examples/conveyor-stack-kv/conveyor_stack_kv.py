"""A paged KV cache layout for Conveyor without prefix caching, written from ``conveyor.kvcache.KVCacheManager``
alone: the smallest complete layout, to start a new one from.

Blocks of ``block_size`` tokens are handed out as requests grow, from a stack:
the block freed last is reused first (it is the likeliest still in the CPU's
caches). The base class and ``conveyor.kvcache`` give the rest: the spec of
what a token stores, the memory budget in blocks, the log line.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from conveyor.hookspecs import hookimpl
from conveyor.kvcache import KVCacheManager, KVCacheOptions, blocks_in_budget, log_capacity
from conveyor.messages import KVCacheStats


class StackOptions(KVCacheOptions, forbid_unknown_fields=True):
    # tokens per block
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 16
    # a fixed number of blocks instead of sizing from memory; 0: size from memory
    num_blocks: Annotated[int, msgspec.Meta(ge=0)] = 0


class StackKVCache(KVCacheManager):
    """Paged KV cache, no prefix caching: the block freed last is handed out first."""

    name = "stack"
    Options = StackOptions

    def __init__(self, options, spec, free_memory=None):
        # the layout decides what a token is stored as: options.dtype "fp8" stores e4m3 with scales
        super().__init__(options, msgspec.structs.replace(spec, cache_dtype=options.dtype), free_memory)
        self.block_size = options.block_size
        self.num_blocks = options.num_blocks or blocks_in_budget(options, self.spec, self.block_size, free_memory)
        self.free_blocks = list(range(self.num_blocks - 1, -1, -1))  # (a stack: block 0 on top)
        self.tables: dict[str, list[int]] = {}
        self.used: dict[str, int] = {}
        log_capacity(self.name, self.num_blocks, self.block_size, self.spec)

    @property
    def num_free_blocks(self):
        return len(self.free_blocks)

    def can_fit(self, sizes):
        return sum(-(-n // self.block_size) for n in sizes) <= self.num_blocks

    def allocate(self, request, num_new_tokens, prefix=None):
        # (prefix is always empty here: match_prefix is the base class's, which finds nothing)
        table = self.tables.get(request.request_id, [])
        tokens = request.num_computed_tokens + num_new_tokens
        needed = -(-tokens // self.block_size) - len(table)
        if needed > len(self.free_blocks):
            return False
        if needed > 0:
            table = table + [self.free_blocks.pop() for _ in range(needed)]
        self.tables[request.request_id] = table
        self.used[request.request_id] = tokens
        return True

    def free(self, request):
        self.used.pop(request.request_id, None)
        self.free_blocks.extend(reversed(self.tables.pop(request.request_id, [])))

    def block_ids(self, request):
        return self.tables.get(request.request_id, [])

    def stats(self):
        return KVCacheStats(self.usage(), self.num_blocks, self.num_free_blocks, self.block_size,
                            reserved_tokens=sum(len(t) for t in self.tables.values()) * self.block_size,
                            used_tokens=sum(self.used.values()))


@hookimpl
def conveyor_register_kvcaches(register):
    register(StackKVCache)
