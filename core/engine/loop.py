"""The async step loop: EngineCore.step() over and over, beside asyncio code."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import anyio
import anyio.abc

from conveyor.engine.core import EngineCore
from conveyor.engine.streams import OutputStreams, follow
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
        self._streams = OutputStreams()
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
            self._streams.route(outputs)
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
                self._streams.route([RequestOutput(payload.request_id, finish_reason=FinishReason.ABORT.value)])
                continue
            try:
                self.core.add_request(payload)
            except RequestRejected as e:
                rejection = RequestOutput(payload.request_id, finish_reason="error", error=str(e), error_status=e.status)
                self._streams.route([rejection])
        if aborts:
            self._streams.route(self.core.abort(aborts))

    def _post(self, kind: str, payload: Any) -> None:
        self._inbox.append((kind, payload))
        self._wakeup.set()

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs until the final one.

        Iterate it inside ``contextlib.aclosing`` so that leaving early (a
        client that disconnects) aborts the request at once, not when the
        generator is garbage-collected.
        """
        receive = self._streams.open(request.request_id)
        self._post("add", request)
        async with aclosing(follow(receive, lambda: self.abort(request.request_id))) as outputs:
            async for output in outputs:
                yield output

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; its stream ends with an ``abort`` output."""
        if request_id in self._streams:
            self._post("abort", request_id)
