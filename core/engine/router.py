"""The data-parallel router: which engine replica takes a new request (a pure policy, no processes)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import msgspec


class ReplicaLoad(msgspec.Struct, frozen=True):
    """What the router knows of one live replica when a request comes."""

    # the engine's queues as of its latest step stats
    num_running: int = 0
    num_waiting: int = 0
    # requests the frontend routed to it and has not seen end
    num_in_flight: int = 0
    # fraction of its KV blocks in use, 0..1, as of its latest step stats
    kv_usage: float = 0.0

    @property
    def num_requests(self) -> int:
        """Running + waiting, plus the in-flight requests the latest stats do not reflect yet.

        The frontend's in-flight count already holds every request the engine
        has (its stream ends only after the engine's final output), so this is
        ``max(running + waiting, in_flight)``: a request routed a moment ago
        counts at once, before the engine's next step reports it.
        """
        num_queued = self.num_running + self.num_waiting
        return num_queued + max(0, self.num_in_flight - num_queued)


class Router:
    """Least load, with affinity to the replica that holds a request's prefix.

    Each replica has a bounded LRU of prefix hashes: hash k stands for the
    prompt's first k * ``block_size`` tokens (chained, so equal hashes mean
    equal prefixes), recorded when a request is routed there. Its engine's
    prefix cache most likely still holds those blocks, so a request that
    starts the same way skips their prefill there.

    The rule, for the live replicas:

    1. The least loaded replica L is the one with the fewest requests
       (``ReplicaLoad.num_requests``), then the lowest KV usage, then the
       lowest index.
    2. The prefix holder P is the replica with the longest matching prefix
       (at least one full block), ties going to the least loaded as in 1.
    3. The request goes to P unless P is clearly overloaded: it has more than
       ``max_imbalance`` requests more than L *and* more than ``max_ratio``
       times L's. Otherwise, and when no replica matches, it goes to L.

    A prompt shared by every replica (a chat template's first block) makes
    them all prefix holders, and rule 2 then falls back to least load.

    Args:
        num_replicas: replicas, numbered 0..num_replicas - 1.
        block_size: tokens per hashed block (the KV cache's block size).
        capacity: prefix hashes remembered per replica before the least recently used go.
        max_imbalance: extra requests a prefix holder may have over the least loaded replica.
        max_ratio: how many times the least loaded replica's requests a prefix holder may have.
    """

    def __init__(
        self,
        num_replicas: int,
        *,
        block_size: int = 16,
        capacity: int = 4096,
        max_imbalance: int = 8,
        max_ratio: float = 1.5,
    ):
        if num_replicas < 1:
            raise ValueError(f"num_replicas={num_replicas}: there must be at least one replica")
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: must be at least 1")
        self.block_size = block_size
        self.max_imbalance = max_imbalance
        self.max_ratio = max_ratio
        # replica -> prefix hash -> None, least recently used first
        self._prefixes: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]
        self._capacities = [capacity] * num_replicas

    def prefix_hashes(self, token_ids: Sequence[int]) -> list[int]:
        """Hashes of the first 1, 2, ... full blocks of ``token_ids``, shortest first."""
        hashes: list[int] = []
        digest = 0
        size = self.block_size
        for end in range(size, len(token_ids) + 1, size):
            digest = hash((digest, tuple(token_ids[end - size : end])))
            hashes.append(digest)
        return hashes

    def num_matched_blocks(self, replica: int, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt (its ``prefix_hashes``) ``replica`` served last."""
        prefixes = self._prefixes[replica]
        for k in range(len(hashes), 0, -1):
            if hashes[k - 1] in prefixes:
                return k
        return 0

    def choose(self, hashes: Sequence[int], loads: Sequence[ReplicaLoad | None]) -> int:
        """The replica for a request.

        Args:
            hashes: the request's ``prefix_hashes``.
            loads: per replica, its load, or None while it is down.

        Returns:
            The index of the replica to route to.

        Raises:
            ValueError: no replica is live.
        """
        live = [i for i, load in enumerate(loads) if load is not None]
        if not live:
            raise ValueError("no replica is live")

        def busyness(i: int) -> tuple[int, float, int]:
            load = loads[i]
            assert load is not None
            return load.num_requests, load.kv_usage, i

        least = min(live, key=busyness)
        matched = {i: self.num_matched_blocks(i, hashes) for i in live}
        longest = max(matched.values())
        if longest == 0:
            return least
        holder = min((i for i in live if matched[i] == longest), key=busyness)
        if self.overloaded(busyness(holder)[0], busyness(least)[0]):
            return least
        return holder

    def overloaded(self, num_holder: int, num_least: int) -> bool:
        """Whether a prefix holder with ``num_holder`` requests should lose to one with ``num_least``."""
        return num_holder - num_least > self.max_imbalance and num_holder > self.max_ratio * num_least

    def record(self, replica: int, hashes: Sequence[int]) -> None:
        """Remember that ``replica`` now holds these prefixes (the request was routed there)."""
        prefixes = self._prefixes[replica]
        for digest in reversed(hashes):  # the shortest prefix, which more requests share, is evicted last
            prefixes[digest] = None
            prefixes.move_to_end(digest)
        while len(prefixes) > self._capacities[replica]:
            prefixes.popitem(last=False)

    def forget(self, replica: int, capacity: int | None = None) -> None:
        """Drop what ``replica`` held (its engine restarted with an empty cache); optionally resize its LRU."""
        self._prefixes[replica].clear()
        if capacity is not None:
            self._capacities[replica] = max(1, capacity)
