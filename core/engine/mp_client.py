"""The multi-process engine client: the engine core in a child process, over ZeroMQ (what the server runs on)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import zmq
import zmq.asyncio

from conveyor.config import Config, encode_config
from conveyor.engine.client import EngineClient, EngineFailed, EngineUnavailable
from conveyor.messages import EngineOutputs, EngineRequest, MessageType, decode, encode

logger = logging.getLogger("conveyor")


class MPClient(EngineClient):
    """Runs the engine core in a child process and keeps it alive.

    The child gets the validated config (msgpack, on its stdin) and the
    addresses of two sockets bound here: it PULLs requests and aborts from
    the first and PUSHes outputs to the second. When it dies, every
    in-flight request ends with an error, ``alive`` turns False, and a new
    process starts, unless ``max_restarts`` deaths fell within
    ``restart_window`` seconds, in which case ``run()`` raises EngineFailed.

    Args:
        config: what the engine runs.
        address: "ipc" (Unix sockets in a private temporary directory) or a
            tcp:// host such as "tcp://127.0.0.1" (free ports are chosen).
        replica: its index behind a ``DPClient``; only log lines show it.
    """

    def __init__(
        self,
        config: Config,
        *,
        address: str = "ipc",
        max_restarts: int = 3,
        restart_window: float = 600.0,
        startup_timeout: float = 600.0,
        log_level: str = "INFO",
        replica: int | None = None,
        engine_timeout: float = 0.0,
    ):
        super().__init__()
        self.config = config
        self.address = address
        self.max_restarts = max_restarts
        self.restart_window = restart_window
        self.startup_timeout = startup_timeout
        self.engine_timeout = engine_timeout
        # time.monotonic() when the engine last sent something, or started owing a reply (a request sent to it idle)
        self._heard = 0.0
        self.log_level = log_level
        # appended to log lines: which replica this engine is
        self._tag = "" if replica is None else f" (replica {replica})"
        self.ready = None
        self.num_restarts = 0
        self._push: zmq.Socket | None = None
        self._process: anyio.abc.Process | None = None
        self._stopping = False
        self._sync_context = zmq.Context()
        self._context = zmq.asyncio.Context()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
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
                logger.warning("restarting the engine process (restart %d)%s", self.num_restarts, self._tag)
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
                       "--output", output_address, "--log-level", self.log_level, "--parent", str(os.getpid())]
            self.ready = None
            process = await anyio.open_process(command, stdin=subprocess.PIPE, stdout=None, stderr=None)
            self._process = process
            code: int | None = None
            try:
                async with anyio.create_task_group() as tg:

                    async def watch() -> None:
                        nonlocal code
                        code = await process.wait()
                        if self.ready is None:
                            await anyio.sleep(0.5)  # why it failed may still be on its way
                        tg.cancel_scope.cancel()

                    tg.start_soon(watch)
                    assert process.stdin is not None
                    async with process.stdin:
                        await process.stdin.send(encode_config(self.config))
                    with anyio.fail_after(self.startup_timeout):
                        kind, ready = decode(await pull.recv_multipart())
                        # (the engine connects its input beside its output: READY may arrive before the input
                        # is connected, and a message sent until then would be refused as "not connected")
                        while kind is MessageType.READY and not push.poll(0, zmq.POLLOUT):
                            await anyio.sleep(0.005)
                    if kind is MessageType.FAILED:
                        raise EngineFailed(ready)
                    if kind is not MessageType.READY:
                        raise EngineFailed(f"the engine process sent {kind.name} before READY")
                    self.ready = ready
                    self._push = push
                    logger.info("engine process %d ready in %.1f s%s", ready.pid, ready.load_time, self._tag)
                    self._ready(ready)
                    if task_status is not None:
                        task_status.started(ready)
                    self._heard = time.monotonic()
                    if self.engine_timeout:
                        tg.start_soon(self._watch_stall, process)
                    await self._receive(pull)
            finally:
                self.alive = False
                self._push = None
                with anyio.CancelScope(shield=True):
                    if process.returncode is None:
                        await _stop(process)
                    code = process.returncode
                    message = f"the engine process exited (code {code}){self._tag}"
                    if self._streams and not self._stopping:
                        logger.error("%s; failing %d in-flight requests", message, len(self._streams))
                    self._streams.fail_all(message, 503)
                push.close(linger=0)
                pull.close(linger=0)
            return code

    async def _watch_stall(self, process: anyio.abc.Process) -> None:
        """Kill the engine process when it has sent nothing for ``engine_timeout`` seconds while requests are in
        flight (the process's death then fails them with 503 and restarts it)."""
        while True:
            await anyio.sleep(min(1.0, self.engine_timeout / 4))
            silent = time.monotonic() - self._heard
            if len(self._streams) and silent > self.engine_timeout:
                logger.error("the engine process sent nothing for %.0f s with %d requests in flight (engine_timeout"
                             " = %.0f s): killing it%s", silent, len(self._streams), self.engine_timeout, self._tag)
                process.kill()
                return

    async def _receive(self, pull: zmq.asyncio.Socket) -> None:
        while True:
            frames = await pull.recv_multipart()
            self._heard = time.monotonic()
            try:
                kind, body = decode(frames)
            except ValueError as e:
                logger.error("dropped a message from the engine: %s", e)
                continue
            if kind is MessageType.OUTPUTS:
                assert isinstance(body, EngineOutputs)
                self._publish(body.outputs, body.stats)

    def _send(self, kind: MessageType, body: object) -> None:
        if self._push is None or not self.alive:
            raise EngineUnavailable("the engine is not running (it is starting, restarting or stopping)")
        try:
            self._push.send_multipart(encode(kind, body), flags=zmq.NOBLOCK)
        except zmq.Again:
            raise EngineUnavailable("the engine is not connected yet") from None

    def _submit(self, request: EngineRequest) -> None:
        if len(self._streams) <= 1:  # (an idle engine owes nothing until now)
            self._heard = time.monotonic()
        self._send(MessageType.ADD, request)

    def _abort(self, request_ids: list[str], at_stop_string: bool = False) -> None:
        self._send(MessageType.FINISH if at_stop_string else MessageType.ABORT, request_ids)

    def _configure(self, changes: dict[str, Any]) -> None:
        self._send(MessageType.CONFIGURE, changes)

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

