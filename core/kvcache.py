"""The KV cache interface (plugin kind ``kvcache``).

A KV cache owns the K and V tensors of every running request and the
attention over its own layout. The scheduler asks it for room
(``allocate``), gives room back (``free``) and reads its usage; the runner
asks it, once per step, for the attention function of that step's batch
(``prepare``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec
import torch

from conveyor.model.llama import AttentionFn
from conveyor.request import Request

# the per-token, per-head scale of an fp8 cache
SCALE_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class KVCacheSpec:
    """What the model needs stored per token, and where."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    # the model's activation dtype
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    # what K and V are stored as: None (the model dtype) or torch.float8_e4m3fn (with one scale per token and head)
    cache_dtype: torch.dtype | None = None

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.cache_dtype or self.dtype

    @property
    def quantized(self) -> bool:
        return self.storage_dtype == torch.float8_e4m3fn

    @property
    def bytes_per_head(self) -> int:
        """Bytes one token's K (or V) takes in one KV head: head_dim elements, plus a scale when quantized."""
        return self.head_dim * self.storage_dtype.itemsize + (SCALE_DTYPE.itemsize if self.quantized else 0)

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv_heads x bytes per head."""
        return 2 * self.num_layers * self.num_kv_heads * self.bytes_per_head


@dataclass
class PrefixMatch:
    """The start of a request found in the cache (see ``KVCache.match_prefix``)."""

    # tokens whose K and V are already stored (a multiple of the block size)
    num_tokens: int = 0
    # the cache's own handle on them (block ids for the built-in layouts)
    blocks: list[Any] = field(default_factory=list)


class KVCache(ABC):
    """Stores K and V for running requests and computes attention over them."""

    name: ClassVar[str]
    Options: ClassVar[type[msgspec.Struct]]

    def __init__(self, options: msgspec.Struct, spec: KVCacheSpec):
        self.options = options
        self.spec = spec

    @property
    @abstractmethod
    def capacity_tokens(self) -> int:
        """Tokens the whole cache holds at once."""

    @abstractmethod
    def can_fit(self, sizes: Sequence[int]) -> bool:
        """Whether requests growing to these numbers of tokens fit in the empty
        cache together (a request that never fits is rejected at admission)."""

    def match_prefix(self, request: Request) -> PrefixMatch:
        """Find the longest start of the request's tokens already in the cache.

        Reserves nothing: pass the result to ``allocate`` in the same step.
        Layouts without prefix caching find nothing.
        """
        return PrefixMatch()

    @abstractmethod
    def allocate(self, request: Request, num_new_tokens: int, prefix: PrefixMatch | None = None) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``request``.

        Args:
            request: room is made for ``request.num_computed_tokens +
                num_new_tokens`` tokens; on its first allocation with a
                ``prefix``, for ``prefix.num_tokens + num_new_tokens``.
            num_new_tokens: tokens this step computes.
            prefix: what ``match_prefix`` found, claimed now (first allocation only).

        Returns:
            False, changing nothing, when there is not enough free memory.
        """

    @abstractmethod
    def free(self, request: Request) -> None:
        """Release everything held for ``request`` (finished, aborted or preempted)."""

    @abstractmethod
    def usage(self) -> float:
        """Fraction of the cache in use, 0..1."""

    def stats(self) -> dict[str, float]:
        """Numbers for metrics and logs: ``usage`` always; block layouts add
        ``num_blocks`` and ``num_free_blocks``; other names are the layout's own."""
        return {"usage": self.usage()}

    @abstractmethod
    def prepare(self, requests: Sequence[Request], num_tokens: Sequence[int], num_decodes: int) -> AttentionFn:
        """The attention function for one forward pass.

        Args:
            requests: the batch in forward order: first ``num_decodes``
                single-token decodes, then prefill chunks.
            num_tokens: tokens computed for each request this step, starting
                at its ``num_computed_tokens``.
            num_decodes: how many leading entries are decodes.

        Returns:
            ``attention(layer, q, k, v)``: stores the new K, V and returns
            attention over everything the request has stored.
        """
