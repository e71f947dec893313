"""The in-process engine client: an engine core stepped on the event loop (what ``LLM`` runs on)."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel

from conveyor.engine.client import EngineClient, EngineUnavailable
from conveyor.engine.core import EngineCore
from conveyor.messages import EngineRequest, MessageType


class InprocClient(EngineClient):
    """Runs an EngineCore's steps in this process, on the event loop.

    Requests and aborts are queued from any task and taken between steps, so
    a step is never interrupted. A step holds the event loop for its forward
    pass and then lets the requests' tasks take their outputs: nothing else
    competes with the forward pass for the CPU (measured: a worker thread for
    the step made offline throughput 20% lower on 2 cores, the tasks'
    detokenizing contending with it). The server, which must answer during a
    step, runs the engine in its own process instead (``MPClient``). When
    ``run()`` ends, the requests still in the engine are aborted and their
    streams end with an error: the engine core is left empty for the next run.
    """

    def __init__(self, core: EngineCore):
        super().__init__()
        self.core = core
        # (ADD, EngineRequest) or (ABORT, request ids), in the order they came
        self._inbox: list[tuple[MessageType, object]] = []
        # made in run(): an event belongs to the event loop it was made in
        self._wakeup: anyio.Event | None = None
        self._stopping = False

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        self._stopping = False
        self._wakeup = anyio.Event()
        core = self.core
        ready = core.ready(0.0)  # (0 s: the engine core was ready before the client ran)
        self._ready(ready)
        task_status.started(ready)
        try:
            while not self._stopping:
                self._take_inbox()
                timeout = core.poll_timeout()
                if timeout is None or timeout > 0:  # idle until a request comes, or a batch is collecting
                    with anyio.move_on_after(timeout if timeout is not None else float("inf")):
                        await self._wakeup.wait()
                    self._wakeup = anyio.Event()
                    self._take_inbox()
                if core.has_unfinished():
                    self._publish(*core.step())
                    await anyio.lowlevel.checkpoint()  # the requests' tasks take their outputs before the next step
        finally:
            self.alive = False
            self._inbox.clear()
            core.abort(list(core.scheduler.requests))
            self._streams.fail_all("the engine stopped", 503)

    async def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        if self._wakeup is not None:
            self._wakeup.set()

    def _submit(self, request: EngineRequest) -> None:
        if self._stopping:
            raise EngineUnavailable("the engine is stopping")
        self._post(MessageType.ADD, request)

    def _abort(self, request_ids: list[str], at_stop_string: bool = False) -> None:
        self._post(MessageType.FINISH if at_stop_string else MessageType.ABORT, request_ids)

    def _configure(self, changes: dict[str, Any]) -> None:
        self._post(MessageType.CONFIGURE, changes)

    def _post(self, kind: MessageType, body: object) -> None:
        self._inbox.append((kind, body))
        if self._wakeup is not None:
            self._wakeup.set()

    def _take_inbox(self) -> None:
        inbox, self._inbox = self._inbox, []
        taken = self.core.apply(inbox)
        if taken is not None:
            self._publish(taken.outputs, taken.stats)
