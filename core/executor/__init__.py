"""Executors: how the engine core reaches its workers.

The engine core decides each step (scheduler, KV cache manager: no tensors)
and hands it to an executor; the executor runs the same call on every
worker and brings back what the driver (the worker that samples) computed.
``uniproc`` keeps one worker in the engine core's own process; ``mp`` runs
``tensor_parallel_size * pipeline_parallel_size`` worker processes on this
machine and ``ray`` runs them as Ray actors, both over torch.distributed.
Each implements ``collective_rpc`` and its own start and stop; ``mp`` and
``ray`` also keep up to ``pipeline_parallel_size`` steps in flight
(``submit`` / ``collect``); under async scheduling ``uniproc`` runs each
step on a thread of its own, so that the engine core works while it runs.
The engine core and the scheduler do not change.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import deque
from concurrent.futures import Future
from typing import Any, ClassVar

import msgspec

from conveyor.config import Config, ConfigError
from conveyor.kvcache import KVCacheLayout
from conveyor.messages import RankTimes, RunnerOutput, StepInput
from conveyor.registry import PluginRegistry
from conveyor.worker import rpc
from conveyor.worker.rpc import ModelInfo

logger = logging.getLogger("conveyor")


class ExecutorError(RuntimeError):
    """The workers cannot go on (one died, failed to start or failed a step): the engine must restart."""


class Executor(ABC):
    """Runs worker methods on every worker of one engine."""

    name: ClassVar[str]

    def __init__(self, config: Config, registry: PluginRegistry):
        """Start the workers (each chooses its device and attention backend; nothing is loaded yet)."""
        self.config = config
        self.registry = registry
        # steps submitted and not collected: their outputs (or what they raised, or the step running), in order
        self._done: deque[RunnerOutput | BaseException | Future[RunnerOutput]] = deque()

    @property
    def driver_rank(self) -> int:
        """The worker that samples: TP rank 0 of the last pipeline stage."""
        parallel = self.config.parallel
        return parallel.world_size - parallel.tensor_parallel_size

    @property
    def max_in_flight(self) -> int:
        """Steps the engine core may submit before it collects the first (one per pipeline stage)."""
        return 1

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
        """Load every worker's share of the weights. The first worker's facts come back (it holds the
        most layers, so its KV spec fits every worker), with the weight bytes of all of them and the
        sliding window they share (0 unless all have the same)."""
        infos = self.collective_rpc("load_model")
        # blocks go back behind a sliding window only where every worker's layers slide by the same one
        windows = {info.kv_spec.sliding_window for info in infos}
        kv_spec = msgspec.structs.replace(infos[0].kv_spec, sliding_window=windows.pop() if len(windows) == 1 else 0)
        formats: dict[str, int] = {}
        for info in infos:
            for format, n in info.weight_formats.items():
                formats[format] = formats.get(format, 0) + n
        return msgspec.structs.replace(infos[0], kv_spec=kv_spec, weight_bytes=sum(info.weight_bytes for info in infos),
                                       weight_formats=formats)

    def free_memory(self) -> int | None:
        """Bytes every worker has free for its KV cache (the smallest), or None where that is not measured."""
        free = [f for f in self.collective_rpc("free_memory") if f is not None]
        return min(free) if free else None

    def init_kv_cache(self, layout: KVCacheLayout) -> None:
        """Allocate the KV cache pool the manager sized, on every worker."""
        self.collective_rpc("init_kv_cache", layout)

    def execute(self, step: StepInput) -> RunnerOutput:
        """Run one step on every worker; what the driver sampled comes back, with every worker's times."""
        return merge_outputs(self.collective_rpc("execute", step), self.driver_rank)

    def overlap_steps(self) -> None:
        """Async scheduling: from now on ``submit`` returns while the step runs, where the executor can (the
        engine core schedules the next step meanwhile). Steps still run one after another, in order. (Here:
        nothing changes; ``uniproc`` runs them on its worker's thread; the process executors' workers run
        elsewhere, so their ``submit`` returns at once already.)"""

    def submit(self, step: StepInput) -> None:
        """Start a step; ``collect`` returns the outputs of submitted steps in order. (Here: run it now.)"""
        try:
            done: RunnerOutput | BaseException = self.execute(step)
        except ExecutorError:
            raise
        except Exception as e:  # noqa: BLE001 - a failed step fails its requests; collect raises it
            done = e
        self._done.append(done)

    def collect(self) -> RunnerOutput:
        """The outputs of the oldest submitted step.

        Raises:
            ExecutorError: the workers cannot go on.
            Exception: the step failed (its requests fail; the workers go on).
        """
        done = self._done.popleft()
        if isinstance(done, Future):
            return done.result()  # (raises what the step raised)
        if isinstance(done, BaseException):
            raise done
        return done


class PipelinedExecutor(Executor):
    """An executor whose workers run elsewhere (processes, Ray actors) and answer calls in order: up to one
    step per pipeline stage is in flight. Subclasses send a call to every worker (``_send`` returns a
    handle) and wait for every worker's result of one (``_results``)."""

    def __init__(self, config: Config, registry: PluginRegistry):
        super().__init__(config, registry)
        self._seq = 0
        # handles of the steps submitted and not collected, oldest first
        self._in_flight: deque[Any] = deque()

    @property
    def max_in_flight(self) -> int:
        return self.config.parallel.pipeline_parallel_size

    @abstractmethod
    def _send(self, data: bytes) -> Any:
        """Send an encoded call to every worker; a handle for ``_results``."""

    @abstractmethod
    def _results(self, handle: Any, method: str) -> list[Any]:
        """Every worker's result of one call, by rank.

        Raises:
            ConfigError: a worker found a configuration problem.
            ExecutorError: a worker raised or died.
        """

    def _call(self, method: str, args: tuple[Any, ...]) -> Any:
        self._seq += 1
        return self._send(rpc.encode_call(self._seq, method, args))

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        if self._in_flight:
            raise ExecutorError(f"{method} called while {len(self._in_flight)} steps are in flight")
        return self._results(self._call(method, args), method)

    def submit(self, step: StepInput) -> None:
        self._in_flight.append(self._call("execute", (step,)))

    def collect(self) -> RunnerOutput:
        return merge_outputs(self._results(self._in_flight.popleft(), "execute"), self.driver_rank)


def log_workers(pids: list[int]) -> None:
    """One line naming every worker's process (tests and operators find them by it)."""
    logger.info("workers ready: %s", ", ".join(f"rank {rank} pid {pid}" for rank, pid in enumerate(pids)))


def merge_outputs(outputs: list[RunnerOutput], driver_rank: int) -> RunnerOutput:
    """Every worker's output of one step, by rank -> the driver's (the only one with tokens) with each
    worker's times in ``ranks``, and the KV blocks any worker could not load (each holds a share of a block)."""
    if len(outputs) == 1:
        return outputs[0]
    driver = outputs[driver_rank]
    driver.ranks = [RankTimes(o.forward_time + o.sample_time, o.comm_time, o.wait_time, o.num_collectives,
                              o.collective_bytes) for o in outputs]
    driver.kv_load_failed = sorted({block for o in outputs for block in o.kv_load_failed})
    return driver


def overlaps_steps(config: Config, device: str) -> bool:
    """Whether ``[engine] async_scheduling`` asks for overlapped steps on ``device`` ("cpu", "cuda:0"): "on", or
    "auto" with CUDA (docs/performance.md, "Async scheduling", has the CPU's numbers). The engine core still
    needs one worker and a scheduler that schedules while a step is in flight."""
    mode = config.engine.async_scheduling
    return mode == "on" or (mode == "auto" and device.startswith("cuda"))


def build_executor(config: Config, registry: PluginRegistry) -> Executor:
    """The executor ``[parallel] executor`` names (``auto``: uniproc for one worker, else mp).

    Raises:
        ConfigError: the model cannot be split as ``[parallel]`` asks (before any worker starts).
    """
    name = config.parallel.executor_name
    if name != "uniproc":
        _check_split(config)
    if name == "uniproc":
        from conveyor.executor.uniproc import UniprocExecutor

        return UniprocExecutor(config, registry)
    if name == "mp":
        from conveyor.executor.mp import MPExecutor

        return MPExecutor(config, registry)
    from conveyor.executor.ray import RayExecutor

    return RayExecutor(config, registry)


def _check_split(config: Config) -> None:
    """Refuse a split the model's shape does not allow, naming the sizes that work, before workers start (each
    would fail alone, after loading). A checkpoint this process cannot open is left to the workers."""
    from conveyor.model.loader import open_model
    from conveyor.model.parallel import Placement, check_divisible

    try:
        spec = open_model(config.model, config.source_of("model")).spec
    except Exception:  # noqa: BLE001 - a checkpoint this process cannot read: each worker reports why it cannot
        return
    experts = tuple(w for w in (spec.moe_intermediate_size, spec.shared_expert_intermediate_size) if w)
    problem = check_divisible(Placement.of(config.parallel, 0), spec.num_heads, spec.num_kv_heads,
                              spec.intermediate_size, spec.num_layers, experts)
    if problem is not None:
        raise ConfigError(f"{config.source}: [parallel] {problem}")


def decode_result(method: str, reply: rpc.Reply) -> Any:
    """What a call returned; for the first message (``method`` "start"), the worker's pid.

    Raises:
        ConfigError: the worker found a configuration problem (the text names the key).
        ExecutorError: the worker raised.
    """
    if reply.error_kind == "config":
        raise ConfigError(reply.error)
    if reply.error_kind:
        raise ExecutorError(f"worker rank {reply.rank} failed to {method}: {reply.error}")
    return msgspec.msgpack.decode(reply.result, type=int if method == "start" else rpc.METHODS[method][1])
