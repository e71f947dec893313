"""The data-parallel engine client: several engine replicas behind one frontend."""

from __future__ import annotations

import logging
import sys
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import aclosing
from functools import partial
from typing import Any

import anyio
import anyio.abc

from conveyor.config import Config
from conveyor.engine.client import EngineClient, EngineFailed, EngineUnavailable
from conveyor.engine.mp_client import MPClient
from conveyor.engine.router import ReplicaLoad, Router
from conveyor.messages import EngineReady, EngineRequest, RequestOutput, StepStats
from conveyor.request import RequestRejected

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

logger = logging.getLogger("conveyor")


class DPClient(EngineClient):
    """Several engine replicas behind one frontend, as one engine client.

    The server runs ``config.parallel.data_parallel_size`` replicas, each an
    ``MPClient`` (``DPClient.from_config``): its own engine process and KV
    cache, all on the same config. A new request goes to the replica the
    ``Router`` picks (least load, or the one holding its prefix), and its
    outputs stream back from that replica alone. Each replica restarts its
    own process when it dies; meanwhile requests go to the others, and
    ``alive`` stays True while any replica is up. ``run()`` is ready when
    every replica is; a replica that keeps dying ends ``run()`` with
    EngineFailed, as one engine would.

    Observers: ``stats_observers`` and ``ready_observers`` get every replica's
    StepStats and EngineReady; ``replica_stats_observers`` and
    ``replica_ready_observers`` get them with the replica's index as well
    (``observe(stats, replica)``), for per-replica metrics.

    Args:
        replicas: the engine clients to route over (replica i is ``replicas[i]``).
        router: the routing policy (default: a ``Router`` over 16-token blocks).
    """

    # why a new request gets 503 while ``alive`` is False
    down = "no engine replica is running (starting, restarting or stopping)"

    def __init__(self, replicas: Sequence[EngineClient], router: Router | None = None):
        super().__init__()
        if not replicas:
            raise ValueError("a DPClient needs at least one replica")
        self.replicas = list(replicas)
        self.router = router or Router(len(self.replicas))
        self.replica_stats_observers: list[Callable[[StepStats, int], None]] = []
        self.replica_ready_observers: list[Callable[[EngineReady, int], None]] = []
        # per replica: its engine's latest EngineReady (None before the first) and step stats (None until a step)
        self.readies: list[EngineReady | None] = [None] * len(self.replicas)
        self._stats: list[StepStats | None] = [None] * len(self.replicas)
        # request id -> the replica serving it
        self._owners: dict[str, int] = {}
        for index, replica in enumerate(self.replicas):
            replica.stats_observers.append(partial(self._replica_step, index))
            replica.ready_observers.append(partial(self._replica_ready, index))

    @classmethod
    def from_config(cls, config: Config, **options: Any) -> DPClient:
        """``config.parallel.data_parallel_size`` engine processes (``MPClient``, with ``options`` as there),
        routed over the KV cache's blocks (their size as the first replica to start reports it)."""
        num_replicas = config.parallel.data_parallel_size
        replicas = [MPClient(config, replica=index, **options) for index in range(num_replicas)]
        return cls(replicas, Router(num_replicas))

    @property
    def alive(self) -> bool:
        """Whether any replica takes requests now."""
        return any(replica.alive for replica in self.replicas)

    @alive.setter
    def alive(self, value: bool) -> None:
        pass  # EngineClient.__init__ sets it; here it follows the replicas

    @property
    def num_in_flight(self) -> int:
        return sum(replica.num_in_flight for replica in self.replicas)

    def loads(self) -> list[ReplicaLoad | None]:
        """What the router weighs now: per replica, its load, or None while it is down."""
        loads: list[ReplicaLoad | None] = []
        for replica, stats in zip(self.replicas, self._stats):
            if not replica.alive:
                loads.append(None)
            elif stats is None:
                loads.append(ReplicaLoad(num_in_flight=replica.num_in_flight))
            else:
                loads.append(ReplicaLoad(stats.scheduler.num_running, stats.scheduler.num_waiting,
                                         replica.num_in_flight, stats.kv.usage))
        return loads

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Run every replica until cancelled or ``shutdown()``; ``task_status.started`` with replica 0's
        EngineReady once all are ready.

        Raises:
            EngineFailed: a replica could not start, or kept dying (the message names it).
        """
        readies: list[EngineReady | None] = [None] * len(self.replicas)
        try:
            async with anyio.create_task_group() as tg:

                async def start(index: int) -> None:
                    readies[index] = await tg.start(self._run_replica, index)

                async with anyio.create_task_group() as starting:
                    for index in range(len(self.replicas)):
                        starting.start_soon(start, index)
                task_status.started(readies[0])
        except BaseExceptionGroup as group:
            failed = group.subgroup(EngineFailed)
            if failed is None:
                raise
            while isinstance(failed, BaseExceptionGroup):
                failed = failed.exceptions[0]
            raise failed from None

    async def _run_replica(self, index: int, *, task_status: anyio.abc.TaskStatus) -> None:
        try:
            await self.replicas[index].run(task_status=task_status)
        except EngineFailed as e:
            raise EngineFailed(f"replica {index}: {e}") from None

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every replica; ``run()`` then returns."""
        async with anyio.create_task_group() as tg:
            for replica in self.replicas:
                tg.start_soon(replica.shutdown, timeout)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Route a request to a replica; yield its outputs until the final one (see ``EngineClient.generate``).

        Raises:
            EngineUnavailable: no replica is running.
            RequestRejected: the request id is in flight already.
        """
        hashes = self._admit(request)
        index = self._choose(range(len(self.replicas)), hashes)
        self._owners[request.request_id] = index
        try:
            # NOTE: the replica counts the request in flight before this yields, so the next one routed sees it.
            async with aclosing(self.replicas[index].generate(request)) as outputs:
                async for output in outputs:
                    yield output
        finally:
            del self._owners[request.request_id]

    def _admit(self, request: EngineRequest) -> list[int]:
        """Check a new request before it is routed; its prompt's prefix hashes.

        Raises:
            EngineUnavailable: no engine that could serve it is running (``down``).
            RequestRejected: its id is in flight already.
        """
        if not self.alive:
            raise EngineUnavailable(self.down)
        if request.request_id in self._owners:
            raise RequestRejected(f"request id {request.request_id!r} is already in use")
        return self.router.prefix_hashes(request.prompt_token_ids)

    def _choose(self, indices: Iterable[int], hashes: list[int]) -> int | None:
        """The live replica among ``indices`` the router picks, now recorded as holding the prefix (None when none
        is live)."""
        wanted = set(indices)
        loads = [load if index in wanted else None for index, load in enumerate(self.loads())]
        if not any(load is not None for load in loads):
            return None
        index = self.router.choose(hashes, loads)
        self.router.record(index, hashes)
        return index

    def replica_of(self, request_id: str) -> int | None:
        """The replica serving a request in flight, or None."""
        return self._owners.get(request_id)

    def abort(self, request_id: str) -> None:
        index = self._owners.get(request_id)
        if index is not None:
            self.replicas[index].abort(request_id)

    def end_at_stop_string(self, request_id: str) -> None:
        index = self._owners.get(request_id)
        if index is not None:
            self.replicas[index].end_at_stop_string(request_id)

    def abort_all(self) -> None:
        for replica in self.replicas:
            replica.abort_all()

    def reconfigure_scheduler(self, changes: dict[str, Any]) -> None:
        self.scheduler_changes.update(changes)
        for replica in self.replicas:
            replica.reconfigure_scheduler(changes)

    def _submit(self, request: EngineRequest) -> None:
        raise NotImplementedError("DPClient.generate hands each request to a replica's own generate")

    def _abort(self, request_ids: list[str], at_stop_string: bool = False) -> None:
        for request_id in request_ids:
            (self.end_at_stop_string if at_stop_string else self.abort)(request_id)

    def _replica_step(self, index: int, stats: StepStats) -> None:
        self._stats[index] = stats
        for observe in self.stats_observers:
            observe(stats)
        for observe_replica in self.replica_stats_observers:
            observe_replica(stats, index)

    def _replica_ready(self, index: int, ready: EngineReady) -> None:
        # a new engine process: its stats and its prefix cache start empty; remember as many prefixes as it has blocks
        self.readies[index] = ready
        self._stats[index] = None
        self.router.forget(index, capacity=ready.num_kv_blocks)
        self.router.block_size = ready.block_size  # (each replica's, from the same config; set before any request)
        self.max_model_len = ready.max_model_len
        for observe in self.ready_observers:
            observe(ready)
        for observe_replica in self.replica_ready_observers:
            observe_replica(ready, index)
