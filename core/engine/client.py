"""The engine client interface: how a frontend submits requests to an engine core and streams their outputs.

Four implementations: ``InprocClient`` (``conveyor.engine.inproc``) steps an
engine core in this process, on the event loop; ``MPClient``
(``conveyor.engine.mp_client``) runs it in a child process over ZeroMQ and
restarts it when it dies; ``DPClient`` (``conveyor.engine.dp_client``) puts
``data_parallel_size`` ``MPClient`` replicas behind a router; ``PDClient``
(``conveyor.engine.pd_client``, a ``DPClient``) runs prefill engines and
decode engines and sends each request through one of each. All route each
output to the stream of its request; the last three keep torch out of the
frontend's process.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from conveyor.messages import EngineReady, EngineRequest, RequestOutput, StepStats
from conveyor.request import FinishReason, RequestRejected

logger = logging.getLogger("conveyor")


class EngineUnavailable(RuntimeError):
    """The engine is not running (starting, restarting or stopped): HTTP 503."""


class EngineFailed(RuntimeError):
    """The engine could not start, or kept dying: the server must exit."""


class EngineClient(ABC):
    """Submits requests to one engine core and streams each one's outputs back."""

    def __init__(self) -> None:
        # prompt + output tokens a request may have; 0 until the engine is ready (it stays while it restarts)
        self.max_model_len = 0
        # whether the engine takes requests now
        self.alive = False
        # called with every step's stats, and with each EngineReady
        self.stats_observers: list[Callable[[StepStats], None]] = []
        self.ready_observers: list[Callable[[EngineReady], None]] = []
        self._streams = OutputStreams()
        # scheduler options changed at run time: a restarted engine gets them again
        self.scheduler_changes: dict[str, Any] = {}

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not finished."""
        return len(self._streams)

    @abstractmethod
    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Run the engine until cancelled or ``shutdown()``; ``task_status.started(EngineReady)`` once it is ready.

        Raises:
            EngineFailed: it could not start (the message says why), or kept dying.
        """

    @abstractmethod
    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine; ``run()`` then returns."""

    @abstractmethod
    def _submit(self, request: EngineRequest) -> None:
        """Hand a request to the engine (raises EngineUnavailable)."""

    @abstractmethod
    def _abort(self, request_ids: list[str], at_stop_string: bool = False) -> None:
        """Ask the engine to end these requests (their final outputs come back as usual); ``at_stop_string``: the
        frontend found a stop string in their text, so they end as ``stop``, not ``abort``."""

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Submit a request; yield its outputs until the final one.

        Iterate it inside ``contextlib.aclosing``: leaving early aborts the
        request in the engine at once. When the engine dies, the stream ends
        with an error output (``error_status`` 503).

        Raises:
            EngineUnavailable: the engine is not running.
            RequestRejected: the request id is in flight already.
        """
        if not self.alive:
            raise EngineUnavailable("the engine is not running (it is starting, restarting or stopping)")
        receive = self._streams.open(request.request_id)
        try:
            self._submit(request)
        except EngineUnavailable:
            self._streams.route([RequestOutput(request.request_id, finish_reason=FinishReason.ABORT.value)])
            receive.close()
            raise
        async with aclosing(follow(receive, lambda: self.abort(request.request_id))) as outputs:
            async for output in outputs:
                yield output

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; its stream ends with an ``abort`` output."""
        if self.alive and request_id in self._streams:
            self._abort([request_id])

    def end_at_stop_string(self, request_id: str) -> None:
        """The frontend found a stop string in the request's text: the engine ends it as ``stop`` (its last
        output says so)."""
        if self.alive and request_id in self._streams:
            self._abort([request_id], at_stop_string=True)

    def abort_all(self) -> None:
        if self.alive and len(self._streams):
            self._abort(self._streams.ids())

    def reconfigure_scheduler(self, changes: dict[str, Any]) -> None:
        """Change scheduler options while the engine runs (``Scheduler.reconfigure``; the caller checked them);
        they outlive a restart of the engine."""
        self.scheduler_changes.update(changes)
        if self.alive:
            self._configure(changes)

    def _configure(self, changes: dict[str, Any]) -> None:
        """Send scheduler option changes to the engine."""
        raise NotImplementedError(f"{type(self).__name__} cannot change scheduler options at run time")

    def _publish(self, outputs: list[RequestOutput], stats: StepStats | None) -> None:
        """Route what the engine produced to the requests' streams and the observers."""
        self._streams.route(outputs)
        if stats is not None:
            for observe in self.stats_observers:
                observe(stats)

    def _ready(self, ready: EngineReady) -> None:
        self.max_model_len = ready.max_model_len
        self.alive = True
        if self.scheduler_changes:  # (a restarted engine read the config file's options)
            try:
                self._configure(self.scheduler_changes)
            except EngineUnavailable as e:
                logger.warning("the scheduler's run-time changes did not reach the new engine: %s", e)
        for observe in self.ready_observers:
            observe(ready)


class OutputStreams:
    """Routes each RequestOutput to the stream of its request; a final output closes the stream."""

    def __init__(self) -> None:
        self._streams: dict[str, MemoryObjectSendStream[RequestOutput]] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def ids(self) -> list[str]:
        return list(self._streams)

    def open(self, request_id: str) -> MemoryObjectReceiveStream[RequestOutput]:
        """A new stream for ``request_id``.

        Raises:
            RequestRejected: the id is already in flight.
        """
        if request_id in self._streams:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        # Unbounded: a slow reader must not stall the engine; max_tokens bounds it.
        send, receive = anyio.create_memory_object_stream[RequestOutput](math.inf)
        self._streams[request_id] = send
        return receive

    def route(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:  # its reader left already
                continue
            try:
                stream.send_nowait(output)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                del self._streams[output.request_id]
                continue
            if output.finish_reason is not None:
                stream.close()
                del self._streams[output.request_id]

    def fail_all(self, error: str, status: int) -> None:
        """End every stream with an error output (the engine is gone)."""
        self.route(
            [
                RequestOutput(request_id, finish_reason=FinishReason.ERROR.value, error=error, error_status=status)
                for request_id in list(self._streams)
            ]
        )


async def follow(
    receive: MemoryObjectReceiveStream[RequestOutput], on_early_exit: Callable[[], None]
) -> AsyncIterator[RequestOutput]:
    """Yield a request's outputs until the final one; leaving early calls ``on_early_exit`` (an abort)."""
    finished = False
    try:
        async with receive:
            async for output in receive:
                finished = output.finish_reason is not None
                yield output
    finally:
        if not finished:
            on_early_exit()
