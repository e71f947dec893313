"""The built-in KV cache layouts as the registry knows them before their code is imported: their options, and
where each class is (``conveyor.hookspecs.Declaration``)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from conveyor.hookspecs import Declaration, hookimpl
from conveyor.kvcache import KVCacheOptions


class PagedOptions(KVCacheOptions, forbid_unknown_fields=True):
    # tokens per block
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 16
    # a fixed number of blocks instead of sizing from memory; 0: size from memory
    num_blocks: Annotated[int, msgspec.Meta(ge=0)] = 0
    # reuse the blocks of earlier requests that start with the same tokens
    enable_prefix_caching: bool = True


class ContiguousOptions(KVCacheOptions, forbid_unknown_fields=True):
    # slab size: "max_model_len" for every request (classic static serving), or
    # "request": its prompt + max_tokens
    reserve: Literal["max_model_len", "request"] = "max_model_len"
    # a fixed capacity in tokens instead of sizing from memory; 0: size from memory
    num_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0


@hookimpl
def conveyor_register_kvcaches(register):
    register(Declaration("paged", PagedOptions, "conveyor.plugins.kvcache.paged:PagedKVCache",
                         "Paged KV cache: blocks of ``block_size`` tokens handed out as requests grow."))
    register(Declaration("contiguous", ContiguousOptions, "conveyor.plugins.kvcache.contiguous:ContiguousKVCache",
                         "Contiguous KV cache: one slab per request, reserved whole at admission."))
