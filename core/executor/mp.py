"""``mp``: the engine's workers as processes on this machine, over torch.distributed.

Each worker is ``python -m conveyor.worker.process`` (one per rank: rank =
pipeline stage * tensor_parallel_size + TP rank); it loads only its share
of the model and joins the others on 127.0.0.1 (gloo on CPU, NCCL on CUDA).
Calls go out over one ZeroMQ ROUTER socket, the same bytes to every worker,
and each worker answers every call (``conveyor.worker.rpc``). Steps are
submitted without waiting, up to one per pipeline stage, and collected in
order. A worker that dies, or fails, raises ``ExecutorError`` naming its
rank: the engine process exits and its parent restarts the engine with a
new set of workers (workers die with the engine process: no orphans).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import zmq

from conveyor.config import Config, encode_config
from conveyor.executor import ExecutorError, PipelinedExecutor, decode_result, log_workers
from conveyor.registry import PluginRegistry
from conveyor.worker import rpc

logger = logging.getLogger("conveyor")

# how often a wait for workers checks that they are all alive, ms
LIVENESS_POLL_MS = 200


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class MPExecutor(PipelinedExecutor):
    """Worker processes on this machine."""

    name = "mp"

    def __init__(self, config: Config, registry: PluginRegistry, startup_timeout: float = 600.0):
        super().__init__(config, registry)
        self.world_size = config.parallel.world_size
        # replies that came before their call was waited for: seq -> rank -> reply
        self._early: dict[int, dict[int, rpc.Reply]] = {}
        self._dir = tempfile.mkdtemp(prefix="conveyor-workers-")
        self._context = zmq.Context()
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        address = f"ipc://{self._dir}/workers"
        self._router.bind(address)
        init_method = f"tcp://127.0.0.1:{free_port()}"
        data = encode_config(config)
        self.processes: list[subprocess.Popen] = []
        try:
            for rank in range(self.world_size):
                process = subprocess.Popen(
                    [sys.executable, "-m", "conveyor.worker.process", "--rank", str(rank), "--local-rank", str(rank),
                     "--executor", address, "--init-method", init_method, "--parent", str(os.getpid()),
                     "--log-level", logging.getLevelName(logging.getLogger("conveyor").getEffectiveLevel())],
                    stdin=subprocess.PIPE,
                )
                process.stdin.write(data)
                process.stdin.close()
                self.processes.append(process)
            logger.info("started %d worker processes (TP %d x PP %d), waiting for them to meet on %s",
                        self.world_size, config.parallel.tensor_parallel_size,
                        config.parallel.pipeline_parallel_size, init_method)
            pids = self._results(rpc.HELLO, "start", time.monotonic() + startup_timeout)
            log_workers(pids)
        except BaseException:
            self.shutdown()
            raise

    def _send(self, data: bytes) -> int:
        for rank in range(self.world_size):
            self._router.send_multipart([str(rank).encode(), data])
        return self._seq

    def _results(self, seq: int, method: str, deadline: float | None = None) -> list[Any]:
        """Every worker's result of call ``seq``, by rank (``decode_result`` raises what a worker raised).

        Raises:
            ExecutorError: a worker died, or did not answer by ``deadline``.
        """
        replies = self._early.pop(seq, {})
        while len(replies) < self.world_size:
            if not self._router.poll(LIVENESS_POLL_MS):
                self._check_alive(method)
                if deadline is not None and time.monotonic() > deadline:
                    missing = sorted(set(range(self.world_size)) - set(replies))
                    raise ExecutorError(f"workers {missing} did not {method} in time")
                continue
            _, data = self._router.recv_multipart()
            reply = rpc.decode_reply(data)
            if reply.error_kind:
                decode_result(method, reply)  # raises the worker's error now, whichever call it answers
            if reply.seq == seq:
                replies[reply.rank] = reply
            else:
                self._early.setdefault(reply.seq, {})[reply.rank] = reply
        return [decode_result(method, replies[rank]) for rank in range(self.world_size)]

    def _check_alive(self, method: str) -> None:
        for rank, process in enumerate(self.processes):
            code = process.poll()
            if code is not None:
                raise ExecutorError(f"worker rank {rank} (pid {process.pid}) exited with code {code} during {method}")

    def shutdown(self) -> None:
        """Ask the workers to stop, then kill what is left; wait for every one (no zombies, no orphans).

        When a worker is gone or a step is in flight, the others may be stuck in a collective: they are
        killed at once."""
        if self._router.closed:
            return
        alive = [p for p in self.processes if p.poll() is None]
        deadline = time.monotonic()
        if len(alive) == len(self.processes) and not self._in_flight:
            self._call("shutdown", ())
            deadline += 5.0
        for process in alive:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._router.close(linger=0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)

