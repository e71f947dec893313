"""Executors: how the engine core reaches its workers.

The engine core decides each step (scheduler, KV cache manager: no tensors)
and hands it to an executor; the executor runs the same call on every
worker and brings back what the first worker computed. ``uniproc`` keeps
one worker in the engine core's own process. An executor for workers in
other processes (torch.distributed) or on other machines (Ray) implements
``collective_rpc`` and its own start and stop; the engine core and the
scheduler do not change.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from conveyor.config import Config
from conveyor.kvcache import KVCacheLayout
from conveyor.messages import RunnerOutput, StepInput
from conveyor.registry import PluginRegistry
from conveyor.worker.worker import ModelInfo


class Executor(ABC):
    """Runs worker methods on every worker of one engine."""

    name: ClassVar[str]

    def __init__(self, config: Config, registry: PluginRegistry):
        """Start the workers (each chooses its device and attention backend; nothing is loaded yet)."""
        self.config = config
        self.registry = registry

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call ``Worker.<method>(*args)`` on every worker.

        Returns:
            Each worker's result, by rank.
        """

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and free what they hold."""

    def load_model(self) -> ModelInfo:
        """Load every worker's share of the weights; the first worker's facts come back."""
        return self.collective_rpc("load_model")[0]

    def free_memory(self) -> int | None:
        """Bytes every worker has free for its KV cache (the smallest), or None where that is not measured."""
        free = [f for f in self.collective_rpc("free_memory") if f is not None]
        return min(free) if free else None

    def init_kv_cache(self, layout: KVCacheLayout) -> None:
        """Allocate the KV cache pool the manager sized, on every worker."""
        self.collective_rpc("init_kv_cache", layout)

    def execute(self, step: StepInput) -> RunnerOutput:
        """Run one step on every worker; what the first one sampled comes back."""
        return self.collective_rpc("execute", step)[0]
