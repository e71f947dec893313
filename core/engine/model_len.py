"""``[model] max_model_len = 0``: the model's own context length, or as much of it as the KV cache holds for one
request (a longer one could never be scheduled)."""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from conveyor.kvcache import KVCacheManager, KVCacheSpec
from conveyor.worker.rpc import ModelInfo


def fit_model_len(configured: int, info: ModelInfo, kvcache: KVCacheManager,
                  build: Callable[[KVCacheSpec], KVCacheManager]) -> tuple[ModelInfo, KVCacheManager, str]:
    """The model's info and KV cache manager with the length a request may have, and where that length came from,
    for the banner.

    Args:
        configured: ``[model] max_model_len`` (0: the model's own).
        info: the workers' info, its length the model's own or the configured one.
        kvcache: the manager built for ``info``.
        build: a manager for another spec (the same plugin and options).
    """
    trained = info.max_model_len
    fits = kvcache.capacity_tokens
    window = info.kv_spec.sliding_window
    if configured:
        return info, kvcache, "[model] max_model_len"
    if fits >= trained or (window and fits > window):  # (a window's requests hold its blocks only)
        return info, kvcache, "the model's context length"
    info = msgspec.structs.replace(info, max_model_len=fits,
                                   kv_spec=msgspec.structs.replace(info.kv_spec, max_model_len=fits))
    return info, build(info.kv_spec), (f"the model's context length {trained} capped at the {fits} tokens the KV "
                                       "cache holds for one request; [kvcache] memory_gb or num_blocks raises it")
