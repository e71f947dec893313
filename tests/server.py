"""The real server for end-to-end tests: ``conveyor serve`` on free ports of 127.0.0.1."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from contextlib import contextmanager

from conveyor.bench.server import Server as BenchServer

__all__ = ["Server", "http_config"]


class Server(BenchServer):
    """The benchmark's server harness, plus control over its engine process."""

    @property
    def worker_pids(self) -> list[int]:
        """The engine's worker processes now (tensor/pipeline parallelism), by rank."""
        line = re.findall(r"workers ready: (.*)", self.output)[-1]
        return [int(pid) for pid in re.findall(r"pid (\d+)", line)]

    def num_finished(self, finish_reason: str) -> float:
        """Requests the frontend saw end with ``finish_reason`` (0 before the first)."""
        try:
            return self.metric("conveyor_requests_total", finish_reason=finish_reason)
        except KeyError:  # none has ended that way yet
            return 0.0

    def engine_aborts(self) -> float:
        """Requests the engine itself ended early (aborted or failed)."""
        return self.metric("conveyor_engine_aborted_requests_total")

    def pause_engine(self) -> None:
        """Stop the engine process (SIGSTOP): it takes no message and makes no token until ``resume_engine``,
        however fast the device."""
        os.kill(self.engine_pid, signal.SIGSTOP)

    def resume_engine(self) -> None:
        os.kill(self.engine_pid, signal.SIGCONT)

    @contextmanager
    def paused_engine(self) -> Iterator[None]:
        """The engine process stopped while the block runs."""
        self.pause_engine()
        try:
            yield
        finally:
            self.resume_engine()


def http_config(**server: object) -> str:
    """A config serving HTTP on a free port, with extra ``[server]`` keys."""
    lines = ["[server]"] + [f"{k} = {_toml(v)}" for k, v in {"status_interval": 1.0, **server}.items()]
    return "\n".join(lines) + '\n\n[[transport]]\nplugin = "http"\nport = 0\n'


def _toml(value: object) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)
