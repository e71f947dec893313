"""``uniproc``: one worker, in the engine core's process (one device, no parallelism)."""

from __future__ import annotations

from typing import Any

from conveyor.config import Config
from conveyor.executor import Executor
from conveyor.registry import PluginRegistry
from conveyor.worker.worker import Worker


class UniprocExecutor(Executor):
    """Calls its one worker directly: a step costs no copy and no message."""

    name = "uniproc"

    def __init__(self, config: Config, registry: PluginRegistry):
        super().__init__(config, registry)
        self.worker = Worker(config, registry)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def shutdown(self) -> None:
        self.worker.shutdown()
