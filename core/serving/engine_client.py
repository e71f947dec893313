"""The frontend's handle on the engine process: start it, talk to it over ZMQ, restart it when it dies."""

from __future__ import annotations

import json
import logging
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import aclosing
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import zmq
import zmq.asyncio

from conveyor.engine.streams import OutputStreams, follow
from conveyor.messages import (
    EngineOutputs,
    EngineReady,
    EngineRequest,
    MessageType,
    RequestOutput,
    StepStats,
    decode,
    encode,
)

logger = logging.getLogger("conveyor")


class EngineUnavailable(RuntimeError):
    """The engine process is not running (starting, restarting or stopped): HTTP 503."""


class EngineFailed(RuntimeError):
    """The engine process could not start, or kept dying: the server must exit."""


class EngineClient:
    """Runs the engine core in a child process and streams each request's outputs back.

    ``run()`` starts the process and keeps it alive: when it dies, every
    in-flight request ends with an error, ``alive`` turns False, and a new
    process starts, unless ``max_restarts`` deaths fell within
    ``restart_window`` seconds, in which case ``run()`` raises EngineFailed.

    Args:
        config_path: the TOML file the engine loads (None: the defaults).
        overrides: ``--set`` overrides, ``{"section.key": value}``.
        address: "ipc" (Unix sockets in a private temporary directory) or a
            tcp:// host such as "tcp://127.0.0.1" (free ports are chosen).
    """

    def __init__(
        self,
        config_path: str | Path | None,
        overrides: Mapping[str, Any] | None = None,
        *,
        address: str = "ipc",
        max_restarts: int = 3,
        restart_window: float = 600.0,
        startup_timeout: float = 600.0,
        log_level: str = "INFO",
    ):
        self.config_path = config_path
        self.overrides = dict(overrides or {})
        self.address = address
        self.max_restarts = max_restarts
        self.restart_window = restart_window
        self.startup_timeout = startup_timeout
        self.log_level = log_level
        self.ready: EngineReady | None = None
        # from the first EngineReady on (0 before); it stays while the engine restarts
        self.max_model_len = 0
        self.alive = False
        self.num_restarts = 0
        # called with every step's stats, and with each new EngineReady
        self.stats_observers: list[Callable[[StepStats], None]] = []
        self.ready_observers: list[Callable[[EngineReady], None]] = []
        self._streams = OutputStreams()
        self._push: zmq.Socket | None = None
        self._process: anyio.abc.Process | None = None
        self._stopping = False
        self._sync_context = zmq.Context()
        self._context = zmq.asyncio.Context()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Start the engine and keep it running until cancelled or ``shutdown()``.

        Raises:
            EngineFailed: the first start failed, or the engine kept dying.
        """
        deaths: list[float] = []
        started = False
        try:
            while True:
                code = await self._run_process(task_status if not started else None)
                if self._stopping:
                    return
                if self.ready is None:
                    raise EngineFailed(f"the engine process exited with code {code} before it was ready")
                started = True
                now = time.monotonic()
                deaths = [t for t in deaths if now - t < self.restart_window] + [now]
                if len(deaths) > self.max_restarts:
                    raise EngineFailed(
                        f"the engine process died {len(deaths)} times in {self.restart_window:.0f} s "
                        f"(last exit code {code}); giving up"
                    )
                self.num_restarts += 1
                logger.warning("restarting the engine process (restart %d)", self.num_restarts)
        finally:
            self._sync_context.destroy(linger=0)
            self._context.destroy(linger=0)

    async def _run_process(self, task_status: anyio.abc.TaskStatus | None) -> int | None:
        """One life of the engine process; returns its exit code."""
        with tempfile.TemporaryDirectory(prefix="conveyor-") as tmp:
            push = self._sync_context.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a send
            pull = self._context.socket(zmq.PULL)
            pull.setsockopt(zmq.RCVHWM, 0)
            input_address = _bind(push, self.address, Path(tmp) / "input")
            output_address = _bind(pull, self.address, Path(tmp) / "output")
            command = [sys.executable, "-m", "conveyor.engine.process", "--input", input_address,
                       "--output", output_address, "--overrides", json.dumps(self.overrides),
                       "--log-level", self.log_level]
            if self.config_path is not None:
                command += ["--config", str(self.config_path)]
            self.ready = None
            process = await anyio.open_process(command, stdin=None, stdout=None, stderr=None)
            self._process = process
            code: int | None = None
            try:
                async with anyio.create_task_group() as tg:

                    async def watch() -> None:
                        nonlocal code
                        code = await process.wait()
                        tg.cancel_scope.cancel()

                    tg.start_soon(watch)
                    with anyio.fail_after(self.startup_timeout):
                        kind, ready = decode(await pull.recv_multipart())
                    if kind is not MessageType.READY:
                        raise EngineFailed(f"the engine process sent {kind.name} before READY")
                    self.ready = ready
                    self.max_model_len = ready.max_model_len
                    self._push = push
                    self.alive = True
                    for observe in self.ready_observers:
                        observe(ready)
                    if task_status is not None:
                        task_status.started(ready)
                    await self._receive(pull)
            finally:
                self.alive = False
                self._push = None
                with anyio.CancelScope(shield=True):
                    if process.returncode is None:
                        await _stop(process)
                    code = process.returncode
                    message = f"the engine process exited (code {code})"
                    if self._streams and not self._stopping:
                        logger.error("%s; failing %d in-flight requests", message, len(self._streams))
                    self._streams.fail_all(message, 503)
                push.close(linger=0)
                pull.close(linger=0)
            return code

    async def _receive(self, pull: zmq.asyncio.Socket) -> None:
        while True:
            frames = await pull.recv_multipart()
            try:
                kind, body = decode(frames)
            except ValueError as e:
                logger.error("dropped a message from the engine: %s", e)
                continue
            if kind is MessageType.OUTPUTS:
                assert isinstance(body, EngineOutputs)
                self._streams.route(body.outputs)
                if body.stats is not None:
                    for observe in self.stats_observers:
                        observe(body.stats)

    def _send(self, kind: MessageType, body: object) -> None:
        if self._push is None or not self.alive:
            raise EngineUnavailable("the engine is not running (it is starting, restarting or stopping)")
        try:
            self._push.send_multipart(encode(kind, body), flags=zmq.NOBLOCK)
        except zmq.Again:
            raise EngineUnavailable("the engine is not connected yet") from None

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
            self._send(MessageType.ADD, request)
        except EngineUnavailable:
            self._streams.route([RequestOutput(request.request_id, finish_reason="abort")])
            receive.close()
            raise
        async with aclosing(follow(receive, lambda: self.abort(request.request_id))) as outputs:
            async for output in outputs:
                yield output

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is (its blocks are freed in the engine's next step)."""
        if self.alive and request_id in self._streams:
            self._send(MessageType.ABORT, [request_id])

    def abort_all(self) -> None:
        if self.alive and len(self._streams):
            self._send(MessageType.ABORT, self._streams.ids())

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the engine to exit (SIGKILL after ``timeout``); ``run()`` then returns."""
        self._stopping = True
        process = self._process
        if process is None or process.returncode is not None:
            return
        if self.alive:
            self._send(MessageType.SHUTDOWN, None)
        else:
            process.terminate()
        with anyio.move_on_after(timeout):
            await process.wait()
        if process.returncode is None:
            process.kill()

    def kill(self) -> None:
        """Kill the engine process at once (tests use this to check recovery)."""
        if self._process is not None and self._process.returncode is None:
            self._process.kill()


def _bind(socket: zmq.Socket, address: str, ipc_path: Path) -> str:
    if address == "ipc":
        endpoint = f"ipc://{ipc_path}"
        socket.bind(endpoint)
        return endpoint
    if not address.startswith("tcp://"):
        raise ValueError(f"engine address {address!r}: use 'ipc' or tcp://HOST")
    port = socket.bind_to_random_port(address)
    return f"{address}:{port}"


async def _stop(process: anyio.abc.Process, timeout: float = 5.0) -> None:
    """SIGTERM (the engine finishes its step and exits), then SIGKILL after ``timeout``."""
    process.terminate()
    with anyio.move_on_after(timeout):
        await process.wait()
    if process.returncode is None:
        process.kill()
        await process.wait()

