"""``paged``: fixed-size KV blocks from one pool, per-request block tables,
and automatic prefix caching."""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import msgspec

from conveyor.kvcache import KVCacheManager, KVCacheSpec, PrefixMatch, blocks_in_budget, log_capacity
from conveyor.messages import KVCacheStats
from conveyor.plugins.kvcache.declarations import PagedOptions
from conveyor.request import Request, RequestStatus

if TYPE_CHECKING:
    from conveyor.connector import KVConnector


def block_digest(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Identity of a full block: its tokens and, through the parent, every token before it (and the first
    block's parent: the request's ``cache_salt``, e.g. its LoRA adapter)."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class _Table:
    """A request's blocks and how many of them are registered in the prefix cache."""

    __slots__ = ("blocks", "digest", "num_dropped", "num_hashed", "num_tokens")

    def __init__(self, blocks: list[int], digest: bytes):
        self.blocks = blocks
        self.num_hashed = len(blocks)
        # digest of the last registered block (before the first: the request's cache salt)
        self.digest = digest
        # tokens stored (after this step's allocation)
        self.num_tokens = 0
        # leading blocks given back because they fell behind the sliding window
        self.num_dropped = 0


class PagedKVCache(KVCacheManager):
    """Paged KV cache: blocks of ``block_size`` tokens handed out as requests grow.

    Full blocks are registered under a chained digest of all tokens up to
    their end. A new request whose tokens start the same way shares those
    blocks (ref counts) instead of recomputing them. Freed blocks keep their
    contents and stay findable until they are reused, least recently used first.
    With a sliding window on every layer, blocks that fall wholly behind a
    request's window go back to the pool as it grows (its table points them
    at the spare block), so a request holds about ``window`` tokens of blocks.
    """

    name = "paged"
    Options = PagedOptions

    def __init__(self, options: PagedOptions, spec: KVCacheSpec, free_memory: int | None = None):
        super().__init__(options, msgspec.structs.replace(spec, cache_dtype=options.dtype), free_memory)
        self.block_size = options.block_size
        self.num_blocks = options.num_blocks or blocks_in_budget(options, self.spec, self.block_size, free_memory)
        self.ref_counts = [0] * self.num_blocks
        self.block_digests: list[bytes | None] = [None] * self.num_blocks
        # digest -> block id, for blocks whose contents are known
        self.cached: dict[bytes, int] = {}
        # blocks with no user, least recently used first; cached ones among them can be revived
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.num_blocks))
        self.tables: dict[str, _Table] = {}
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        self.num_evictions = 0
        # blocks handed to ``connector.load`` that no step has taken yet (``take_loads``), with their digests
        self.loading: dict[int, bytes] = {}
        # digests a connector failed to load: not taken from it again until this pool computes them (and saves
        # them anew), so that a store that keeps offering a bad block cannot keep its requests restarting
        self.unloadable: set[bytes] = set()
        log_capacity(self.name, self.num_blocks, self.block_size, self.spec)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def can_fit(self, sizes: Sequence[int]) -> bool:
        return sum(self._blocks_for(n) for n in sizes) <= self.num_blocks

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request: Request) -> list[int]:
        return self.tables[request.request_id].blocks

    def attach(self, connector: KVConnector) -> None:
        if not self.options.enable_prefix_caching:
            raise ValueError("a KV connector needs [kvcache] enable_prefix_caching = true (its blocks are found by "
                             "their digests)")
        self.connector = connector
        connector.kvcache = self

    def prefix_digests(self, request: Request) -> list[bytes]:
        return list(self._digests(request))

    def is_cached(self, digest: bytes) -> bool:
        return digest in self.cached

    def _digests(self, request: Request) -> Iterator[bytes]:
        """The chained digests of the request's full blocks before its last token (whose logits pick the next
        token: it is always computed)."""
        tokens = request.all_token_ids()
        size = self.block_size
        digest = request.cache_salt
        for start in range(0, len(tokens) - size, size):
            digest = block_digest(digest, tokens[start : start + size])
            yield digest

    def match_prefix(self, request: Request) -> PrefixMatch:
        if not self.options.enable_prefix_caching or not (self.cached or self.connector):
            return PrefixMatch()
        blocks: list[int] = []
        digests = self._digests(request)
        for digest in digests:
            block = self.cached.get(digest)
            if block is None:
                break
            blocks.append(block)
        else:
            return PrefixMatch(len(blocks) * self.block_size, blocks)
        external: list[bytes] = []
        if self.connector is not None:  # (the digest that missed, and the rest, up to one that failed to load)
            rest = list(itertools.takewhile(lambda d: d not in self.unloadable, [digest, *digests]))
            n = self.connector.lookup(request, rest)
            if n is None:
                return PrefixMatch(fetching=True)
            external = rest[:n]
        return PrefixMatch((len(blocks) + len(external)) * self.block_size, blocks, external)

    def allocate(self, request: Request, num_new_tokens: int, prefix: PrefixMatch | None = None) -> bool:
        table = self.tables.get(request.request_id)
        if table is None:
            claimed = prefix.blocks if prefix else []
            external = prefix.external if prefix else []
            needed = self._blocks_for((prefix.num_tokens if prefix else 0) + num_new_tokens) - len(claimed)
            revived = sum(1 for b in claimed if self.ref_counts[b] == 0)
            if needed > len(self.free_blocks) - revived:
                return False
            for block in claimed:
                if self.ref_counts[block] == 0:
                    del self.free_blocks[block]
                self.ref_counts[block] += 1
            loaded = self._load(external)
            digest = external[-1] if external else self.block_digests[claimed[-1]] if claimed else request.cache_salt
            table = self.tables[request.request_id] = _Table(claimed + loaded, digest)
            needed -= len(loaded)
            if self.options.enable_prefix_caching and request.status == RequestStatus.WAITING:
                # (a prompt counts once: a preempted request that finds its own blocks again is no cache hit)
                self.num_prefix_queries += request.num_tokens
                self.num_prefix_hits += prefix.num_tokens if prefix else 0
        else:
            self._register_full_blocks(request, table)
            if self.spec.sliding_window:
                self._drop_behind_window(request.num_computed_tokens, table)
            needed = self._blocks_for(request.num_computed_tokens + num_new_tokens) - len(table.blocks)
            if needed > len(self.free_blocks):
                return False
        for _ in range(needed):
            table.blocks.append(self._take_free_block())
        table.num_tokens = (prefix.num_tokens if prefix else request.num_computed_tokens) + num_new_tokens
        return True

    def _load(self, digests: list[bytes]) -> list[int]:
        """Blocks for the connector to fill with ``digests``, registered at once (the step that first reads
        them loads them before its forward pass)."""
        blocks = []
        for digest in digests:
            block = self._take_free_block()
            self.connector.load(digest, block)
            self.loading[block] = digest
            if digest not in self.cached:
                self.cached[digest] = block
                self.block_digests[block] = digest
            blocks.append(block)
        return blocks

    def take_loads(self) -> dict[int, bytes]:
        loads, self.loading = self.loading, {}
        return loads

    def loads_failed(self, loads: dict[int, bytes]) -> None:
        for block, digest in loads.items():
            if self.block_digests[block] == digest:  # (a twin of a block cached already was never registered)
                del self.cached[digest]
                self.block_digests[block] = None
            self.unloadable.add(digest)
            self.connector.load_failed(digest, block)

    def _take_free_block(self) -> int:
        block, _ = self.free_blocks.popitem(last=False)
        digest = self.block_digests[block]
        if digest is not None:
            self.num_evictions += 1
            del self.cached[digest]
            self.block_digests[block] = None
        self.ref_counts[block] = 1
        return block

    def _drop_behind_window(self, first_query: int, table: _Table) -> None:
        """Give back the blocks no query from position ``first_query`` on sees (registered blocks stay
        findable in the prefix cache until they are reused)."""
        # the first key position ``first_query`` sees
        first_key = first_query - self.spec.sliding_window + 1
        for i in range(table.num_dropped, max(0, first_key) // self.block_size):
            self._release(table.blocks[i])
            table.blocks[i] = self.num_blocks  # the spare block: a placeholder no kernel reads
        table.num_dropped = max(table.num_dropped, max(0, first_key) // self.block_size)

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks[block] = None

    def _register_full_blocks(self, request: Request, table: _Table) -> None:
        """Make the request's newly completed blocks findable by later requests."""
        if not self.options.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(table.blocks))
        if num_full <= table.num_hashed:
            return
        size = self.block_size
        tokens = request.token_ids(table.num_hashed * size, num_full * size)
        for i in range(table.num_hashed, num_full):
            offset = (i - table.num_hashed) * size
            table.digest = block_digest(table.digest, tokens[offset : offset + size])
            block = table.blocks[i]
            # A twin computed at the same time stays private; the first one is the cached copy.
            if table.digest not in self.cached:
                self.cached[table.digest] = block
                self.block_digests[block] = table.digest
                self.unloadable.discard(table.digest)
                if self.connector is not None:
                    self.connector.save(table.digest, block)
        table.num_hashed = num_full

    def free(self, request: Request) -> None:
        table = self.tables.pop(request.request_id, None)
        if table is None:
            return
        self._register_full_blocks(request, table)
        # Tail blocks first, so they are evicted before the shared prefix blocks.
        for block in reversed(table.blocks[table.num_dropped :]):
            self._release(block)

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            usage=self.usage(),
            num_blocks=self.num_blocks,
            num_free_blocks=len(self.free_blocks),
            block_size=self.block_size,
            reserved_tokens=(self.num_blocks - len(self.free_blocks)) * self.block_size,
            used_tokens=sum(t.num_tokens for t in self.tables.values()),
            num_cached_blocks=len(self.cached),
            num_prefix_query_tokens=self.num_prefix_queries,
            num_prefix_hit_tokens=self.num_prefix_hits,
            num_evictions=self.num_evictions,
        )
