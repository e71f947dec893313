"""``tiers``: a tiered prefix cache. Full blocks are copied to host memory, and optionally to a directory on
disk; a request whose prefix the device pool has lost loads it from there instead of recomputing it.

Every block that becomes full and final is saved to the host tier (write-through: a device eviction then
costs nothing, and the tier holds what the pool holds and more), and to the disk tier where one is set (by a
thread of the worker's, off the step). Each tier evicts its least recently used blocks past its budget. A
new request keeps the host copies of its prefix until it is admitted (at most half the tier is kept so),
so that the blocks saved meanwhile do not push them out. At admission a device miss that the host tier
holds is copied back into the pool before the request's first step. A miss that only the disk tier holds
makes the request wait at this connector's gate while every worker reads the files into host memory
between steps, each checked against its header (the model's fingerprint, the block's digest, its length
and checksum): a truncated, corrupt or foreign file on any worker is skipped with a warning (``call``
answers its key), the block is not offered (``lookup`` stops before it) and the request computes it. Before
copying a block back into the pool, each worker also checks that its host slot holds that block, and reports
the block from ``apply`` where it does not: the engine then computes it (``KVConnector.load_failed``). Files are
named by the block's digest under a directory named by the fingerprint (one for each worker's rank: a block
is on disk when every rank's file of it is), written whole to a temporary name and renamed, so the disk tier
outlives the server and a crash never leaves half a block under a real name.

Prefill/decode disaggregation goes through the disk tier, on a directory every engine shares (in shared
memory: ``[parallel] prefill_engines``): the prefill engine saves a prompt's blocks as it computes them, and
the decode engine holds the request (``Request.kv_transfer``) at this connector's gate until their files are
there, for at most the transfer's timeout, then loads them as any disk hit; what has not come is computed.

This side (the engine core's) decides every copy and which slot of the host tier each block takes; the
workers (``conveyor.plugins.connector.tier_store``) carry the copies out in the order decided, before the
next step's forward pass, so a slot is never read after it is reused. Like SGLang's HiCache and vLLM's
offloading connector, with two simplifications: copies between the pool and host memory are synchronous,
and a disk read waits for the workers to be idle (as LoRA loads do).
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from pathlib import Path

import msgspec

from conveyor.connector import KVConnector
from conveyor.messages import ConnectorStats
from conveyor.plugins.connector.declarations import TiersOptions
from conveyor.plugins.connector.tier_store import DROP, FETCH, LOAD, SAVE, WRITE, TierSetup, TierWorker, block_dir
from conveyor.request import Request, RequestStatus

logger = logging.getLogger("conveyor")

# files of a block some rank lacks, or temporary ones, older than this at start-up are a stopped writer's leftovers
ORPHAN_AGE_S = 3600.0


class TieredConnector(KVConnector):
    """A tiered prefix cache: blocks the device pool evicted come back from host memory or disk."""

    name = "tiers"
    Options = TiersOptions
    Worker = TierWorker

    def __init__(self, options: TiersOptions, layout, fingerprint, call):
        super().__init__(options, layout, fingerprint, call)
        spec = layout.spec
        # bytes of one block in the worker with the most layers (what the budgets are counted in)
        self.block_bytes = layout.block_size * (spec.bytes_per_token - spec.extra_bytes_per_token)
        self.num_host_blocks = max(1, int(options.host_gb * 2**30 // self.block_bytes))
        # digest -> host slot, least recently used first
        self.host: OrderedDict[bytes, int] = OrderedDict()
        self.free_slots = list(range(self.num_host_blocks - 1, -1, -1))
        # digests on disk, least recently used first (None: no disk tier)
        self.disk: OrderedDict[bytes, None] | None = None
        self.num_disk_blocks = 0
        if options.disk_dir:
            self.num_disk_blocks = max(1, int(options.disk_gb * 2**30 // self.block_bytes))
            # (each worker's files in a directory of its rank's: a block is stored when every rank's file is)
            self.directory = block_dir(options.disk_dir, fingerprint, 0).parent
            _remove_orphans(self.directory, time.time() - ORPHAN_AGE_S)
            self.disk = OrderedDict.fromkeys(_stored_digests(self.directory))
            self.rank_dirs: list[Path] = []
        # what the workers do before the next step, in order
        self.ops: list[tuple[int, int, int, bytes]] = []
        self._trim_disk()
        # the blocks each held request waits for (from disk), and the requests that waited once
        self.fetches: dict[str, list[bytes]] = {}
        self.fetched: set[str] = set()
        # host slots kept for waiting requests (their prefixes), by request; how many requests keep each slot
        self.pins: dict[str, list[int]] = {}
        self.pinned: dict[int, int] = {}
        # blocks read from disk into the host tier and not yet loaded (a load of one is a disk hit)
        self.from_disk: set[bytes] = set()
        # requests waiting for a prefill engine's blocks, by request id
        self.transfers: dict[str, _Transfer] = {}
        self.counters = ConnectorStats(capacity_blocks={"host": self.num_host_blocks, "disk": self.num_disk_blocks},
                                       hit_tokens={"host": 0, "disk": 0}, read_bytes={"host": 0, "disk": 0},
                                       written_bytes={"host": 0, "disk": 0})
        logger.info("KV tiers: host %d blocks (%.2f GiB), disk %s", self.num_host_blocks,
                    self.num_host_blocks * self.block_bytes / 2**30,
                    f"{self.num_disk_blocks} blocks in {options.disk_dir} ({len(self.disk)} stored)"
                    if self.disk is not None else "off")

    @property
    def setup(self) -> bytes:
        return msgspec.msgpack.encode(TierSetup(self.num_host_blocks, self.fingerprint, self.options.disk_dir))

    # the device pool's side

    def lookup(self, request: Request, digests: list[bytes]) -> int | None:
        n = 0
        while n < len(digests) and digests[n] in self.host:
            n += 1
        waits = request.status == RequestStatus.WAITING and request.request_id not in self.fetched
        if self.disk is not None and waits:
            wanted = []
            for digest in digests[n:]:
                if digest not in self.host and not self._on_disk(digest):
                    break
                wanted.append(digest)
            if wanted:  # (once: what a fetch leaves out is computed)
                self.fetches[request.request_id] = wanted
                self.fetched.add(request.request_id)
                return None
        self._unpin(request)  # (admitted: what it loads is queued before any slot is reused)
        return n

    def load(self, digest: bytes, block: int) -> None:
        self.host.move_to_end(digest)
        self.ops.append((LOAD, block, self.host[digest], digest))
        tier = "disk" if digest in self.from_disk else "host"
        self.from_disk.discard(digest)
        self.counters.hit_tokens[tier] += self.layout.block_size
        self.counters.read_bytes["host"] += self.block_bytes

    def save(self, digest: bytes, block: int) -> None:
        if digest in self.host:
            self.host.move_to_end(digest)
            return
        slot = self._take_slot()  # (None: every slot is kept for a waiting request; the disk still gets it)
        write = self.disk is not None and digest not in self.disk
        if slot is None and not write:
            return
        self.ops.append((WRITE if write else SAVE, block, -1 if slot is None else slot, digest))
        if slot is not None:
            self.host[digest] = slot
            self.counters.written_bytes["host"] += self.block_bytes
        if write:
            self.disk[digest] = None
            self.counters.written_bytes["disk"] += self.block_bytes
            self._trim_disk()

    def load_failed(self, digest: bytes, block: int) -> None:
        """A worker's host slot did not hold the block (or the step failed): the host tier drops it (its slot is
        free again); a disk copy stays, checked again when it is read."""
        slot = self.host.pop(digest, None)
        if slot is not None:
            self.free_slots.append(slot)
        self.from_disk.discard(digest)
        self.counters.num_errors += 1

    def _on_disk(self, digest: bytes) -> bool:
        """Whether the disk tier holds the block: indexed, or written since by another engine on the same
        directory (a data-parallel replica; indexed now)."""
        if digest in self.disk:
            return True
        if not self.rank_dirs:  # (every worker has made its own by the first request)
            self.rank_dirs = _rank_dirs(self.directory)
        name = f"{digest.hex()}.kv"
        if self.rank_dirs and all((d / name).is_file() for d in self.rank_dirs):
            self.disk[digest] = None
            self._trim_disk()
            return digest in self.disk
        return False

    def _trim_disk(self) -> None:
        """Drop the least recently used files past the disk tier's budget."""
        while self.disk is not None and len(self.disk) > self.num_disk_blocks:
            dropped, _ = self.disk.popitem(last=False)
            self.ops.append((DROP, -1, -1, dropped))

    def _take_slot(self) -> int | None:
        """A free host slot, else that of the least recently used block no waiting request keeps (dropped from
        the host tier); None when every slot is kept."""
        if self.free_slots:
            return self.free_slots.pop()
        for digest, slot in self.host.items():
            if slot not in self.pinned:
                del self.host[digest]
                self.from_disk.discard(digest)
                return slot
        return None

    def _pin(self, request: Request, slots: list[int], limit: bool = True) -> None:
        """Keep these host slots (a prefix's, in order) for ``request`` until it is admitted or ends; with
        ``limit``, while at most half the host tier is kept (the rest takes new blocks)."""
        kept = self.pins.setdefault(request.request_id, [])
        for slot in slots:
            if limit and slot not in self.pinned and len(self.pinned) >= self.num_host_blocks // 2:
                break
            kept.append(slot)
            self.pinned[slot] = self.pinned.get(slot, 0) + 1

    def _unpin(self, request: Request) -> None:
        for slot in self.pins.pop(request.request_id, ()):
            self.pinned[slot] -= 1
            if not self.pinned[slot]:
                del self.pinned[slot]

    def take_payload(self) -> bytes:
        if not self.ops:
            return b""
        payload = msgspec.msgpack.encode(self.ops)
        self.ops = []
        return payload

    # the gate: a new request keeps the host copies of its prefix until it is admitted; a request whose prefix
    # continues on disk at its admission waits while the workers read those blocks into the host tier

    def holds(self, request: Request) -> bool:
        resident = []
        for digest in self.kvcache.prefix_digests(request):
            if digest in self.host:
                resident.append(self.host[digest])
            elif not self.kvcache.is_cached(digest):
                break
        self._pin(request, resident)
        transfer = request.kv_transfer
        if transfer is None or self.disk is None:
            return False
        digests = self.kvcache.prefix_digests(request)[: transfer.num_blocks]
        if not digests:
            return False
        self.transfers[request.request_id] = _Transfer(digests, time.monotonic() + transfer.timeout)
        return True

    def wants_idle(self, held: list[Request]) -> bool:
        return any(request.request_id in self.fetches for request in held)

    def release(self, held: list[Request], idle: bool) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Let a request waiting for a prefill engine's blocks go on once they are all stored, or its time is up.
        Read every other held request's blocks from disk into the host tier (only while no step is in flight),
        as far as free or unkept slots go, and keep them for it; the rest of them are computed."""
        arrived, fetching = [], []
        for request in held:
            if request.request_id not in self.transfers:
                fetching.append(request)
            elif self._transferred(request):
                arrived.append(request)
        if not idle or not fetching:
            return arrived, []
        fetched: dict[bytes, int] = {}  # digest -> its slot
        for request in fetching:
            slots = []
            for digest in self.fetches.pop(request.request_id, ()):
                if digest in self.host:
                    slots.append(self.host[digest])
                    continue
                if digest not in fetched:
                    if not self._on_disk(digest) or (slot := self._take_slot()) is None:
                        break
                    fetched[digest] = slot
                    self.ops.append((FETCH, -1, slot, digest))
                slots.append(fetched[digest])
            self._pin(request, slots, limit=False)  # (it is admitted at the next step)
        payload = self.take_payload()
        failed = set()
        if payload:
            for answer in self.call(payload):
                failed.update(msgspec.msgpack.decode(answer, type=list[bytes]))
        for digest, slot in fetched.items():
            if digest in failed:  # (its requests' pins on the slot stay until they start: harmless)
                self.disk.pop(digest, None)
                self.free_slots.append(slot)
                self.counters.num_errors += 1
            else:
                self.host[digest] = slot
                if digest in self.disk:  # (the budget may have dropped it meanwhile)
                    self.disk.move_to_end(digest)
                self.from_disk.add(digest)
                self.counters.read_bytes["disk"] += self.block_bytes
        return arrived + fetching, []

    def _transferred(self, request: Request) -> bool:
        """Whether the request's transfer is over: every block it waits for is stored (or cached), or its time
        is up (counted)."""
        transfer = self.transfers[request.request_id]
        digests = transfer.digests
        while transfer.num_found < len(digests):
            digest = digests[transfer.num_found]
            if not (digest in self.host or self.kvcache.is_cached(digest) or self._on_disk(digest)):
                break
            transfer.num_found += 1
        now = time.monotonic()
        complete = transfer.num_found == len(digests)
        if not complete and now < transfer.deadline:
            return False
        del self.transfers[request.request_id]
        outcome = "arrived" if complete else "timed_out"
        self.counters.transfers[outcome] = self.counters.transfers.get(outcome, 0) + 1
        self.counters.transfer_bytes += transfer.num_found * self.block_bytes
        self.counters.transfer_seconds += now - transfer.started
        return True

    def forget(self, request: Request) -> None:
        self.transfers.pop(request.request_id, None)
        self.fetches.pop(request.request_id, None)
        self.fetched.discard(request.request_id)
        self._unpin(request)

    def stats(self) -> ConnectorStats:
        stats = msgspec.structs.replace(self.counters, hit_tokens=dict(self.counters.hit_tokens),
                                        read_bytes=dict(self.counters.read_bytes),
                                        written_bytes=dict(self.counters.written_bytes),
                                        transfers=dict(self.counters.transfers))
        stats.blocks = {"host": len(self.host), "disk": len(self.disk or ())}
        return stats


class _Transfer:
    """A request waiting for a prefill engine's blocks."""

    def __init__(self, digests: list[bytes], deadline: float):
        self.digests = digests
        # its leading blocks found stored so far
        self.num_found = 0
        self.started = time.monotonic()
        # time.monotonic() when it stops waiting
        self.deadline = deadline


def _rank_dirs(directory: Path) -> list[Path]:
    """The directories of a fingerprint's workers, one a rank (``block_dir``)."""
    return sorted(directory.glob("rank*")) if directory.is_dir() else []


def _remove_orphans(directory: Path, before: float) -> int:
    """Remove what no index holds and so no budget would ever trim, last modified before ``before`` (newer ones
    may be another engine's writes under way): a block's files that some rank lacks (a worker stopped between
    its own write and another's), and temporary files a stopped writer left. Returns how many."""
    ranks = _rank_dirs(directory)
    try:  # (a rank's directory that cannot be listed would make every block look incomplete: then nothing goes)
        listed = [[entry.name for entry in os.scandir(d)] for d in ranks]
    except OSError as e:
        logger.warning("KV disk tier: cannot list %s (%s); leftover files are kept", directory, e)
        return 0
    names = [{name for name in found if name.endswith(".kv")} for found in listed]
    whole = set.intersection(*names) if names else set()
    removed = 0
    for d, held, found in zip(ranks, names, listed):
        for path in [*(d / name for name in held - whole), *(d / name for name in found if name.endswith(".tmp"))]:
            try:
                if path.stat().st_mtime < before:
                    path.unlink()
                    removed += 1
            except OSError:
                continue  # (removed meanwhile)
    if removed:
        logger.info("KV disk tier: removed %d files of blocks some worker lacks, or left unfinished, in %s", removed,
                    directory)
    return removed


def _stored_digests(directory: Path) -> list[bytes]:
    """The digests of the blocks a fingerprint's disk tier directory holds a file of for every rank, oldest
    first (by the modification time of rank 0's)."""
    ranks = _rank_dirs(directory)
    if not ranks:
        return []
    found = []
    for path in ranks[0].glob("*.kv"):
        try:
            if all((d / path.name).is_file() for d in ranks[1:]):
                found.append((path.stat().st_mtime_ns, bytes.fromhex(path.stem)))
        except (OSError, ValueError):
            continue  # (removed meanwhile, or not a name this tier writes)
    return [digest for _, digest in sorted(found)]
