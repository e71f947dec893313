"""The KV cache manager interface (plugin kind ``kvcache``).

A KV cache manager decides where each request's keys and values live: it
sizes a pool of blocks of ``block_size`` token slots, hands blocks out as
requests grow (``allocate``), takes them back (``free``), may let a request
reuse the blocks of a prefix computed before (``match_prefix``), and says
which blocks hold a request (``block_ids``). It is bookkeeping only, with no
tensors: the workers allocate the pool that ``layout`` describes and compute
attention over it.

The contract a layout keeps with the scheduler, in the order a request meets it:

- At admission (a new request, or a preempted one coming back with
  ``num_computed_tokens = 0``), the scheduler calls ``match_prefix`` and then, in
  the same step with nothing in between, ``allocate(request, n, prefix)``.
  Requests with ``params.prompt_logprobs`` or ``params.pooling == "mean"`` need
  every prompt token computed: for them it skips ``match_prefix`` and passes an
  empty ``PrefixMatch``.
- Every later step that computes ``n`` more tokens calls ``allocate(request, n)``
  first. Then ``request.num_computed_tokens`` tokens are computed and stored (the
  step before finished): a layout that caches prefixes makes the full blocks
  among them findable here (there is no other "tokens computed" hook), and may
  give back blocks that fall wholly behind ``spec.sliding_window`` of the next
  query (``block_ids`` then still lists a block id in their place: the spare
  block ``num_blocks``, which no kernel reads).
- ``free`` comes once when the request finishes, is aborted or preempted; a
  layout may register its full computed blocks then too.
- With a KV connector attached (``attach``; conveyor.connector), a layout
  extends a prefix match past the pool with the blocks the connector can load
  (``PrefixMatch.external``: their digests), gives each a block in
  ``allocate`` and calls ``connector.load`` for it, and hands every block it
  registers to ``connector.save``. The engine takes the blocks loaded with
  each step it builds (``take_loads``); those the connector's worker side
  could not fill come back through ``loads_failed`` when the step is back,
  and the layout must not serve them again (the engine recomputes the
  requests that hold them).

A layout may read these ``Request`` fields and nothing else: ``request_id``,
``status`` (``WAITING`` at a first admission, ``PREEMPTED`` at a re-admission),
``num_computed_tokens``, ``num_tokens`` and ``num_prompt_tokens``,
``max_total_tokens`` (the most it grows to), ``token_ids(start, end)`` /
``all_token_ids()`` (prompt and outputs so far), ``cache_salt`` (the prefix
cache's namespace: the LoRA adapter) and ``params``.

Any block size the options allow works with every attention backend (torch,
C++ CPU, Triton): they index the block table per token.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

import msgspec

from conveyor.messages import KVCacheStats
from conveyor.request import Request

if TYPE_CHECKING:
    from conveyor.connector import KVConnector

logger = logging.getLogger("conveyor")

# bytes per element of each storage dtype
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1}
# an fp8 cache keeps one bfloat16 scale per token and head
FP8_SCALE_BYTES = 2


class KVCacheSpec(msgspec.Struct, frozen=True):
    """What the model stores per token, in one worker's share of the cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    # the model's activation dtype: "float32", "float16" or "bfloat16"
    dtype: str
    max_model_len: int
    # what K and V are stored as: "auto" (the model dtype) or "fp8" (e4m3, one scale per token and head)
    cache_dtype: Literal["auto", "fp8"] = "auto"
    # every layer attends to the last this-many keys only (a sliding window): what lies behind a request's
    # window may be freed; 0: every key stays
    sliding_window: int = 0
    # bytes per token that another cache with the same blocks takes beside this one (a draft model's)
    extra_bytes_per_token: int = 0

    @property
    def storage_dtype(self) -> str:
        return self.dtype if self.cache_dtype == "auto" else self.cache_dtype

    @property
    def quantized(self) -> bool:
        return self.cache_dtype == "fp8"

    @property
    def bytes_per_head(self) -> int:
        """Bytes one token's K (or V) takes in one KV head: head_dim elements, plus a scale when quantized."""
        return self.head_dim * DTYPE_BYTES[self.storage_dtype] + (FP8_SCALE_BYTES if self.quantized else 0)

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv_heads x bytes per head (+ the extra bytes)."""
        return 2 * self.num_layers * self.num_kv_heads * self.bytes_per_head + self.extra_bytes_per_token


class KVCacheLayout(msgspec.Struct, array_like=True, frozen=True):
    """The pool the workers allocate: ``num_blocks`` blocks of ``block_size`` slots, as ``spec`` stores them,
    and one more, block id ``num_blocks``, that no request owns: compiled steps pad their batches there, and
    block tables point there for the blocks a sliding window has left behind (never read)."""

    spec: KVCacheSpec
    num_blocks: int
    block_size: int


class KVCacheOptions(msgspec.Struct, forbid_unknown_fields=True):
    """Options every built-in layout has; a layout's own Options subclass it."""

    # CPU: memory for the cache, in GiB
    memory_gb: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    # GPU: fraction of the free device memory (measured after the weights load) for the cache
    memory_fraction: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.9
    # what K and V are stored as: "auto" (the model dtype) or "fp8" (e4m3 with a scale per token and head;
    # about twice the blocks in the same memory)
    dtype: Literal["auto", "fp8"] = "auto"


@dataclass
class PrefixMatch:
    """The start of a request found in the cache (see ``KVCacheManager.match_prefix``)."""

    # tokens whose K and V are already stored (a multiple of the block size)
    num_tokens: int = 0
    # the manager's own handle on them (block ids for the built-in layouts)
    blocks: list[Any] = field(default_factory=list)
    # after those, the digests of the blocks a KV connector loads (counted in num_tokens)
    external: list[bytes] = field(default_factory=list)
    # the KV connector is fetching more of the prefix: the scheduler holds the request at the connector's gate
    # (``KVConnector.lookup`` said None) and admits it once they are in
    fetching: bool = False


class KVCacheManager(ABC):
    """Hands out KV cache blocks to requests; the workers hold the tensors."""

    name: ClassVar[str]
    Options: ClassVar[type[msgspec.Struct]] = KVCacheOptions

    def __init__(self, options: msgspec.Struct, spec: KVCacheSpec, free_memory: int | None = None):
        """Size the pool: set ``num_blocks`` and ``block_size`` (``blocks_in_budget`` turns the memory budget
        into blocks; ``log_capacity`` logs the result as the built-in layouts do).

        Args:
            options: an instance of ``Options``.
            spec: what the model stores per token, with ``cache_dtype`` "auto". A layout that honours
                ``options.dtype`` (every ``KVCacheOptions`` has it) passes
                ``msgspec.structs.replace(spec, cache_dtype=options.dtype)`` on to this method: the workers
                then store fp8 with its scales, and ``bytes_per_token`` (so the budget) counts them.
            free_memory: bytes the device has free once the weights are loaded, or None where that is
                not measured (CPU: the configured budget applies).
        """
        self.options = options
        self.spec = spec
        # set by the layout
        self.num_blocks = 0
        self.block_size = 0
        # a KV connector's scheduler side (``attach``), or None
        self.connector: KVConnector | None = None

    def attach(self, connector: KVConnector) -> None:
        """Consult ``connector`` from now on (see conveyor.connector for what a layout owes it).

        Args:
            connector: a KV connector's scheduler side; the layout sets its ``kvcache`` to itself.

        Raises:
            ValueError: this layout cannot (why, in one line).
        """
        raise ValueError(f"[kvcache] plugin = {self.name!r} cannot use a KV connector (it keeps no block digests); "
                         "allowed with one: a layout with prefix caching, e.g. 'paged'")

    def prefix_digests(self, request: Request) -> list[bytes]:
        """The keys a connector knows the request's blocks by.

        Args:
            request: a request (its tokens and ``cache_salt``).

        Returns:
            The digests of its full blocks before its last token, in order (none for a layout without them).
        """
        return []

    def is_cached(self, digest: bytes) -> bool:
        """Whether the pool holds a block.

        Args:
            digest: a digest ``prefix_digests`` gave.

        Returns:
            True when the block is computed here and ``match_prefix`` would find it.
        """
        return False

    def take_loads(self) -> dict[int, bytes]:
        """The blocks handed to ``connector.load`` since the last call; the engine calls it once per step it builds,
        the step whose forward pass first reads them.

        Returns:
            Each block's digest, by block id (none for a layout without a connector).
        """
        return {}

    def loads_failed(self, loads: dict[int, bytes]) -> None:
        """The connector's worker side could not fill these blocks (``KVConnectorWorker.apply`` said so, or the
        step that carried them failed): forget them as cached, so that no prefix match finds them, and tell the
        connector (``KVConnector.load_failed``). Their requests are recomputed by the engine (their blocks are
        freed as they are preempted).

        Args:
            loads: some of what ``take_loads`` returned for one step.
        """

    @property
    def layout(self) -> KVCacheLayout:
        """What the workers allocate for this manager."""
        return KVCacheLayout(self.spec, self.num_blocks, self.block_size)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole cache holds at once."""
        return self.num_blocks * self.block_size

    @property
    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached prefix blocks count: they are reused when needed).

        Returns:
            0 .. ``num_blocks``; ``usage()`` and /metrics' free blocks come from it.
        """

    @abstractmethod
    def can_fit(self, sizes: Sequence[int]) -> bool:
        """Whether requests growing to these numbers of tokens fit in the empty cache together.

        Args:
            sizes: tokens each request grows to at most (``max_total_tokens``).

        Returns:
            False for a request that can never fit: the scheduler rejects it at admission (400).
        """

    def match_prefix(self, request: Request) -> PrefixMatch:
        """Find the longest start of the request's tokens already in the cache.

        Matching runs over ``request.all_token_ids()``: a preempted request's own outputs may match too. It
        must leave at least the last token unmatched (its logits pick the next token; a match that covers
        every token never gets a step). Tokens match only under the same ``request.cache_salt`` (their KV
        depends on it too: the request's LoRA adapter). Layouts without prefix caching find nothing.

        Args:
            request: a request being admitted.

        Returns:
            The matched tokens (a multiple of ``block_size``) and their blocks. Nothing is reserved: the
            scheduler passes the result to ``allocate`` right after, in the same step, before any other
            allocation, so matched blocks cannot be evicted in between.
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
        """Release everything held for ``request`` (finished, aborted or preempted).

        Args:
            request: a request this manager allocated for; called once for it (a preempted one is
                allocated for again from scratch when it comes back).
        """

    @abstractmethod
    def block_ids(self, request: Request) -> list[int]:
        """The blocks holding ``request``'s tokens, in order (after this step's ``allocate``).

        Args:
            request: a running request.

        Returns:
            Block ids in ``0 .. num_blocks - 1`` (or ``num_blocks``, the spare, for a block given back behind
            a sliding window), covering every position up to ``num_computed_tokens`` + this step's tokens.
        """

    @abstractmethod
    def stats(self) -> KVCacheStats:
        """The blocks now, and the layout's counters.

        Returns:
            A ``KVCacheStats``; a layout leaves at 0 what it does not have. The prefix-cache counters are
            cumulative and count each prompt once, at its first admission (``status`` ``WAITING``), so
            that hit tokens never exceed the prompt tokens served: ``num_prefix_query_tokens`` its tokens,
            ``num_prefix_hit_tokens`` those matched; ``num_evictions`` counts a cached block reused for
            another request's tokens, when it is handed out.
        """

    def usage(self) -> float:
        """How full the cache is.

        Returns:
            The fraction of the blocks in use, 0..1 (from ``num_free_blocks``).
        """
        return 1.0 - self.num_free_blocks / self.num_blocks


def blocks_in_budget(options: KVCacheOptions, spec: KVCacheSpec, block_size: int, free_memory: int | None) -> int:
    """How many blocks the memory budget holds: a fraction of the measured free memory, else ``memory_gb``
    (less the one block the workers add to pad compiled steps)."""
    budget = free_memory * options.memory_fraction if free_memory is not None else options.memory_gb * 2**30
    blocks = int(budget // (block_size * spec.bytes_per_token)) - 1
    if blocks < 1:
        raise ValueError(f"[kvcache] the memory budget ({budget / 2**30:.3g} GiB) holds no block of {block_size} tokens")
    return blocks


def log_capacity(name: str, num_blocks: int, block_size: int, spec: KVCacheSpec) -> None:
    capacity = num_blocks * block_size
    logger.info(
        "KV cache (%s, %s): %d blocks x %d tokens = %d tokens, %.2f GiB (%d B/token = 2 x %d layers x %d kv heads x %s);"
        " max concurrency at max_model_len %d: %.1f",
        name, spec.storage_dtype, num_blocks, block_size, capacity,
        capacity * spec.bytes_per_token / 2**30, spec.bytes_per_token, spec.num_layers, spec.num_kv_heads,
        f"({spec.head_dim} x 1 B + {FP8_SCALE_BYTES} B scale)" if spec.quantized
        else f"{spec.head_dim} x {DTYPE_BYTES[spec.dtype]} B",
        spec.max_model_len, capacity / spec.max_model_len,
    )
