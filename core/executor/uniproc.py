"""``uniproc``: one worker, in the engine core's process (one device, no parallelism)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from conveyor.config import Config
from conveyor.executor import Executor, overlaps_steps
from conveyor.messages import StepInput
from conveyor.model.loader import resolve_device
from conveyor.registry import PluginRegistry
from conveyor.worker.worker import Worker


class UniprocExecutor(Executor):
    """Calls its one worker directly: a step costs no copy and no message.

    Where async scheduling may be on (``[engine] async_scheduling`` "on", or "auto" on CUDA) the worker lives
    on a thread of its own, built there and called only there, and a step runs on it while the engine core
    schedules the next. Elsewhere it stays on the engine core's thread. Never both: each thread that runs
    parallel regions gets an OpenMP team of its own, and with more OpenMP threads than cores every team's
    barriers sleep instead of spinning (a CPU decode step of 32 requests took 1.6x as long once a second thread
    had run the model).
    """

    name = "uniproc"

    def __init__(self, config: Config, registry: PluginRegistry):
        super().__init__(config, registry)
        own_thread = overlaps_steps(config, resolve_device(config.model.device).type)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="conveyor-worker") if own_thread else None
        self._overlap = False
        self.worker = self._call(Worker, config, registry)

    def _call(self, function, *args: Any) -> Any:
        return function(*args) if self._thread is None else self._thread.submit(function, *args).result()

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [self._call(getattr(self.worker, method), *args)]

    def overlap_steps(self) -> None:
        self._overlap = self._thread is not None

    def submit(self, step: StepInput) -> None:
        if self._overlap:  # (what it raises comes out of collect)
            self._done.append(self._thread.submit(self.worker.execute, step))
        else:
            super().submit(step)

    def shutdown(self) -> None:
        try:
            self._call(self.worker.shutdown)
        finally:
            if self._thread is not None:
                self._thread.shutdown(wait=True, cancel_futures=True)
