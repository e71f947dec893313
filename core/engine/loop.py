"""The async step loop: EngineCore.step() over and over, beside asyncio code."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectSendStream

from conveyor.engine.core import EngineCore
from conveyor.messages import EngineRequest, RequestOutput, StepStats
from conveyor.request import FinishReason, RequestRejected


class AsyncEngine:
    """Runs an EngineCore's step loop beside asyncio code.

    Requests and aborts are queued from any task and taken between steps, so
    a step is never blocked; each step runs in a worker thread, so the event
    loop stays responsive during the forward pass; outputs go to one stream
    per request. Leaving a ``generate`` stream early aborts the request.
    """

    def __init__(self, core: EngineCore, on_step: Callable[[StepStats], None] | None = None):
        self.core = core
        self.on_step = on_step
        # ("add", EngineRequest) or ("abort", request id), in arrival order
        self._inbox: list[tuple[str, Any]] = []
        self._streams: dict[str, MemoryObjectSendStream[RequestOutput]] = {}
        self._wakeup = anyio.Event()

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """The step loop; runs until cancelled."""
        task_status.started()
        while True:
            self._take_inbox()
            if not self.core.has_unfinished():
                await self._wakeup.wait()
                self._wakeup = anyio.Event()
                continue
            outputs, stats = await anyio.to_thread.run_sync(self.core.step)
            self._publish(outputs)
            if stats is None:
                await anyio.sleep(0.002)  # a batching scheduler is still collecting requests
            elif self.on_step is not None:
                self.on_step(stats)

    def _take_inbox(self) -> None:
        inbox, self._inbox = self._inbox, []
        aborts = [payload for kind, payload in inbox if kind == "abort"]
        for kind, payload in inbox:
            if kind != "add":
                continue
            if payload.request_id in aborts:  # withdrawn before it reached the engine
                self._publish([RequestOutput(payload.request_id, finish_reason=FinishReason.ABORT.value)])
                continue
            try:
                self.core.add_request(payload)
            except RequestRejected as e:
                rejection = RequestOutput(payload.request_id, finish_reason="error", error=str(e), error_status=e.status)
                self._publish([rejection])
        if aborts:
            self._publish(self.core.abort(aborts))

    def _publish(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            try:
                stream.send_nowait(output)
            except anyio.BrokenResourceError:  # the reader left; its abort is on the way
                del self._streams[output.request_id]
                continue
            if output.finish_reason is not None:
                stream.close()
                del self._streams[output.request_id]

    def _post(self, kind: str, payload: Any) -> None:
        self._inbox.append((kind, payload))
        self._wakeup.set()

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs until the final one.

        Iterate it inside ``contextlib.aclosing`` so that leaving early (a
        client that disconnects) aborts the request at once, not when the
        generator is garbage-collected.
        """
        if request.request_id in self._streams:
            raise RequestRejected(f"request id {request.request_id!r} is already in use")
        # Unbounded: a slow reader must not stall the engine; max_tokens bounds it.
        send, receive = anyio.create_memory_object_stream[RequestOutput](math.inf)
        self._streams[request.request_id] = send
        self._post("add", request)
        finished = False
        try:
            async with receive:
                async for output in receive:
                    finished = output.finish_reason is not None
                    yield output
        finally:
            if not finished:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; its stream ends with an ``abort`` output."""
        if request_id in self._streams:
            self._post("abort", request_id)
