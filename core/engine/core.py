"""The engine core: the scheduler, the KV cache manager, an executor, and the step.

``EngineCore.step()`` is schedule -> execute -> update: which requests run
and with how many tokens, one forward pass over all of them on the workers,
then the sampled tokens go back to the scheduler, which returns what each
request produced. The engine core decides and never touches a tensor; the
executor carries each step to the workers.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from conveyor.config import paths
from conveyor.config import Config
from conveyor.connector import build_connector
from conveyor.engine.grammars import GrammarRequests
from conveyor.engine.kv_loads import check_loads, restart
from conveyor.engine.loras import LoraSlots
from conveyor.engine.model_len import fit_model_len
from conveyor.engine.prompt_logprobs import add_prompt_logprobs
from conveyor.engine.rank_stats import add_rank_stats
from conveyor.engine.speculative import DraftModelProposer, NgramProposer
from conveyor.engine.step_input import StepBuilder
from conveyor.executor import Executor, ExecutorError, build_executor, overlaps_steps
from conveyor.kvcache import DTYPE_BYTES, KVCacheManager
from conveyor.messages import (
    EngineOutputs,
    EngineReady,
    EngineRequest,
    KVOwners,
    MessageType,
    RequestOutput,
    RunnerOutput,
    StepInput,
    StepStats,
)
from conveyor.perf.peaks import DevicePeaks, device_peaks
from conveyor.perf.roofline import ModelCosts, step_work, utilization
from conveyor.registry import PluginRegistry
from conveyor.request import FinishReason, Request, RequestRejected, RequestStatus
from conveyor.scheduler import ScheduledBatch, Scheduler

logger = logging.getLogger("conveyor")

# seconds to wait before stepping again while a batching scheduler collects requests (it ran nothing)
COLLECT_WAIT = 0.002
# seconds between the KV cache owner maps the steps carry (for the dashboard)
KV_OWNERS_EVERY_S = 1.0


@dataclass
class InFlight:
    """A step submitted to the workers and not yet back."""

    batch: ScheduledBatch
    step: StepInput
    # entries that are decodes proper (one new token after earlier ones, with any drafts it checks), and their
    # tokens
    num_decode_seqs: int
    num_decode_tokens: int
    # seconds spent choosing and building it
    schedule_time: float
    # blocks a KV connector fills before its forward pass, with their digests (``KVCacheManager.take_loads``)
    loads: dict[int, bytes] = field(default_factory=dict)


class EngineCore:
    """Owns the requests and the batch; knows nothing of HTTP or sockets."""

    def __init__(self, config: Config, registry: PluginRegistry | None = None, executor: Executor | None = None,
                 peaks: DevicePeaks | None = None):
        """
        Args:
            executor: runs the steps (default: the one ``[parallel]`` chooses; the simulator passes its own).
            peaks: the devices' peaks (default: looked up or measured for the device the model is on).
        """
        registry = registry or PluginRegistry.of(config)
        self.config = config
        self.executor = executor or build_executor(config, registry)
        try:
            info = self.executor.load_model()
            free_memory = self.executor.free_memory()
            self.kvcache: KVCacheManager = registry.build("kvcache", config.kvcache, info.kv_spec, free_memory)
            info, self.kvcache, self.max_model_len_note = fit_model_len(
                config.model.max_model_len, info, self.kvcache,
                lambda spec: registry.build("kvcache", config.kvcache, spec, free_memory))
            self.executor.init_kv_cache(self.kvcache.layout)
            self.scheduler: Scheduler = registry.build("scheduler", config.scheduler, self.kvcache,
                                                       info.max_model_len)
            self.connector = build_connector(config, registry, self.executor, self.kvcache, info)
        except BaseException:
            self.executor.shutdown()
            raise
        self.info = info
        self.max_model_len = info.max_model_len
        # the scheduler's gates: adapters loading on the workers, grammars compiling, KV blocks read from disk
        self.loras = None
        if config.lora.max_loras:
            self.loras = LoraSlots(self.executor, config.lora.max_loras, self.scheduler.requests)
            self.scheduler.add_gate(self.loras)
        self.grammars = GrammarRequests(config, info.vocab_size)
        for gate in (self.grammars, self.connector):
            if gate is not None:
                self.scheduler.add_gate(gate)
        proposer = {"ngram": NgramProposer, "draft": DraftModelProposer}.get(config.engine.speculative)
        self.proposer = proposer(config.engine) if proposer is not None else None
        self.num_steps = 0
        # what the schedule and update stages are timed with (the simulator's virtual clock: they cost no time
        # there beyond its cost model's)
        self.timer: Callable[[], float] = time.perf_counter
        self.steps = StepBuilder(self.scheduler, self.kvcache, self.loras, self.grammars, self.connector)
        self._kv_owners_time = 0.0
        # what a step computes and moves, and the peaks it is measured against (all devices together)
        self.costs = None if info.spec is None else ModelCosts.of(
            info.spec, info.weight_bytes, self.kvcache.layout.spec.bytes_per_head, DTYPE_BYTES[config.model.dtype])
        peaks = peaks or device_peaks(info.device, paths.cache_root())
        devices = config.parallel.world_size if info.device.startswith("cuda") else 1
        self.peak_flops = peaks.flops_for_weights(info.weight_formats, config.model.dtype) * devices if peaks else 0.0
        self.peak_bytes_per_second = peaks.bytes_per_second * devices if peaks else 0.0
        # the last step scheduled nothing although requests are pending (a batching scheduler collecting)
        self._collecting = False
        # steps on the workers, oldest first: up to one per pipeline stage where the scheduler allows, or two
        # under async scheduling (the next one waits on the workers while the engine updates the last)
        self._in_flight: deque[InFlight] = deque()
        self.max_in_flight = self.executor.max_in_flight if self.scheduler.pipelined else 1
        if self.max_in_flight < self.executor.max_in_flight:
            logger.warning("scheduler %r runs one batch at a time: %d pipeline stages will idle in turn",
                           self.scheduler.name, self.executor.max_in_flight)
        self.async_scheduling = self._async_scheduling()
        self.scheduler.overlap(self.max_in_flight, self.async_scheduling)
        if self.async_scheduling:
            self.max_in_flight = 2
            self.executor.overlap_steps()

    def _async_scheduling(self) -> bool:
        """Whether steps overlap: where ``[engine] async_scheduling`` asks for it, one pipeline stage runs them
        and the scheduler may schedule while a step is in flight ("auto": on CUDA, where the host's work per step is a
        large share of it)."""
        if not overlaps_steps(self.config, self.info.device) or self.config.parallel.pipeline_parallel_size > 1:
            return False  # (pipeline stages overlap their steps already; the config refuses "on" with them)
        if not self.scheduler.pipelined:
            if self.config.engine.async_scheduling == "on":
                logger.warning("scheduler %r runs one batch at a time: async scheduling is off", self.scheduler.name)
            return False
        return True

    def shutdown(self) -> None:
        """Stop the workers."""
        self.grammars.shutdown()
        self.executor.shutdown()

    def add_request(self, message: EngineRequest) -> RequestOutput | None:
        """Queue a request (the scheduler checks it; its gates hold it while its adapter loads or its grammar
        compiles).

        Returns:
            None; or, for a request it cannot take (too long, queue full, ...), its final error output,
            with the HTTP status that says why.
        """
        try:
            request = Request.from_message(message, self.max_model_len)
            if request.lora is not None and self.loras is None:
                raise RequestRejected(f"the LoRA adapter {request.lora.name!r} cannot run: [lora] max_loras = 0")
            self.scheduler.add(request)
        except RequestRejected as e:
            return self._rejected(message.request_id, e)
        self._collecting = False
        return None

    @staticmethod
    def _rejected(request_id: str, e: RequestRejected) -> RequestOutput:
        return RequestOutput(request_id, finish_reason=FinishReason.ERROR.value, error=str(e), error_status=e.status,
                             retry_after=e.retry_after)

    def abort(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """End requests wherever they are (their clients left); a final ``abort`` output for each unfinished one."""
        return self.scheduler.abort(request_ids)

    def end_at_stop_string(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """The frontend found a stop string in these requests' text (only it detokenizes): they end as ``stop``;
        a final output for each unfinished one."""
        return self.scheduler.abort(request_ids, reason=FinishReason.STOP)

    def apply(self, messages: Iterable[tuple[MessageType, object]]) -> EngineOutputs | None:
        """Take ADD, ABORT, FINISH and CONFIGURE messages (``EngineRequest``, request ids, scheduler options)
        in the order they came.

        Returns:
            What they produced (rejections; an empty output for each request taken, so that a frontend may send
            a stream's status once the request cannot be refused any more; abort outputs), with a stats snapshot
            after an abort so that the freed blocks show at once; None when there is nothing to tell.
        """
        outputs: list[RequestOutput] = []
        aborted = False
        for kind, body in messages:
            if kind is MessageType.ADD:
                rejection = self.add_request(body)
                if rejection is not None:
                    outputs.append(rejection)
                elif self.scheduler.requests[body.request_id].status is RequestStatus.WAITING:
                    outputs.append(RequestOutput(body.request_id))  # taken (one a gate holds: once it passes)
            elif kind is MessageType.ABORT:
                outputs += self.abort(body)
                aborted = True
            elif kind is MessageType.FINISH:
                outputs += self.end_at_stop_string(body)
                aborted = True
            elif kind is MessageType.CONFIGURE:
                try:
                    self.scheduler.reconfigure(body)
                    logger.info("scheduler options changed: %s", body)
                except ValueError as e:  # (the frontend checks first; a third-party client may not)
                    logger.error("scheduler options not changed: %s", e)
        if not outputs and not aborted:
            return None
        if aborted:  # (the last request may have ended: the blocks saved meanwhile reach the store now)
            self._flush_when_idle()
        return EngineOutputs(outputs, self.stats() if aborted else None)

    def has_unfinished(self) -> bool:
        """Whether a request is unfinished or a step is in flight (one scheduled ahead while the last request
        ended: its results, and the blocks the connector saves after it, are still to take)."""
        return self.scheduler.has_unfinished() or bool(self._in_flight)

    def poll_timeout(self) -> float | None:
        """How long a loop around ``step`` may wait for new requests before stepping again:
        0 while there is work, a moment while nothing could run (a batching scheduler collecting,
        requests held by a gate), None (until a request comes) when idle."""
        if not self.has_unfinished():
            return None
        return COLLECT_WAIT if self._collecting else 0.0

    def step(self) -> tuple[list[RequestOutput], StepStats | None]:
        """Run one step: submit batches while the pipeline has room (one per stage; under async scheduling
        two, the second scheduled while the first runs), then take the oldest one's tokens.

        Returns:
            What every affected request produced, and the step's stats (None
            when there was nothing to run).

        Raises:
            ExecutorError: the workers cannot go on (the engine must restart).
        """
        released = self.scheduler.release(idle=not self._in_flight)
        while self._may_submit():
            if not self._submit():
                break
        self._collecting = not self._in_flight
        if not self._in_flight:
            return released, None
        flight = self._in_flight.popleft()
        try:
            result = self.executor.collect()
        except ExecutorError:
            raise
        except Exception as e:  # a failed step fails its requests, not the engine
            logger.exception("step failed; ending its %d requests with an error", len(flight.batch))
            check_loads(self.kvcache, flight.loads, flight.batch, None)  # (they may be filled in part)
            return released + self.scheduler.step_failed(flight.batch, f"{type(e).__name__}: {e}"), None
        executed = self.timer()
        restarts = check_loads(self.kvcache, flight.loads, flight.batch, result)
        outputs = self._update(flight, result)
        restart(self.scheduler, restarts)
        self._flush_when_idle()
        self.num_steps += 1
        stats = self._step_stats(flight, result, executed)
        self.scheduler.observe_step([(r.start, len(r.token_ids)) for r in flight.step.requests],
                                    stats.schedule_time + stats.forward_time + stats.sample_time + stats.update_time)
        return released + outputs, stats

    def _may_submit(self) -> bool:
        """Whether another step may go to the workers now: the pipeline has room, no gate waits for them to be idle,
        and no step in flight loads KV blocks (a step on top of it would read blocks the connector may not fill)."""
        if not self._in_flight:
            return True
        return (len(self._in_flight) < self.max_in_flight and not self.scheduler.wants_idle()
                and not any(flight.loads for flight in self._in_flight))

    def _flush_when_idle(self) -> None:
        """With no step in flight and none to come, the connector carries out now what waits for the next step
        (the blocks the last one filled reach its store; a decode engine may be waiting for them)."""
        if self.connector is not None and not self._in_flight and not self.scheduler.has_unfinished():
            self.connector.flush()

    def _submit(self) -> bool:
        """Schedule a batch and hand it to the workers; False when there is nothing to run."""
        start = self.timer()
        batch = self.scheduler.schedule()
        if not batch.requests:
            return False
        # decodes proper: one new token after earlier ones (not the last token of a prompt chunk), and the drafts
        # it checks
        decodes = [n for r, n in zip(batch.requests, batch.num_tokens)
                   if r.num_output_tokens and r.num_uncomputed_tokens == 1]
        step = self.steps.build(batch)
        self.scheduler.submitted(batch)
        self._in_flight.append(InFlight(batch, step, len(decodes), sum(decodes), self.timer() - start,
                                        self.kvcache.take_loads()))
        self.executor.submit(step)
        return True

    def _update(self, flight: InFlight, result: RunnerOutput) -> list[RequestOutput]:
        """Hand a step's results to the scheduler (it records the tokens and ends requests) and the proposer; what
        the requests produced."""
        outputs = self.scheduler.update(flight.batch, result)
        if self.proposer is not None:
            self.proposer.propose(flight.batch.requests, result)
        if result.prompt_logprobs:
            outputs = add_prompt_logprobs(flight.batch, flight.step, result, outputs)
        return outputs

    def _step_stats(self, flight: InFlight, result: RunnerOutput, executed: float) -> StepStats:
        """The queues now, and what the step ran, how long each stage took and what it used of the devices."""
        batch = flight.batch
        stats = self.stats()
        if self.scheduler.has_unfinished():
            # the running batch is the one this step ran (with any admitted since): read after its finished
            # requests left and before the next step admits, the queue alone is one short for each that ended
            stats.scheduler.num_running = max(stats.scheduler.num_running, len(batch.requests))
        stats.num_prefill_tokens = batch.total_tokens - flight.num_decode_tokens
        stats.num_decode_tokens = flight.num_decode_tokens
        stats.num_decode_seqs = flight.num_decode_seqs
        stats.num_prefill_seqs = len(batch.requests) - flight.num_decode_seqs
        stats.schedule_time = flight.schedule_time
        stats.forward_time = result.forward_time
        stats.sample_time = result.sample_time
        stats.update_time = self.timer() - executed
        if self.costs is not None:
            work = step_work(self.costs, [(r.start, len(r.token_ids)) for r in flight.step.requests],
                             sum(1 + len(r.draft_token_ids) for r in flight.step.requests if r.sample))
            stats.flops, stats.bytes_moved = work.flops, work.bytes
            stats.mfu, stats.mbu = utilization(work, result.forward_time, self.peak_flops, self.peak_bytes_per_second)
        add_rank_stats(stats, result.ranks)
        return stats

    def _kv_owners(self) -> KVOwners | None:
        """The running requests' blocks, every KV_OWNERS_EVERY_S seconds and once none runs."""
        now = time.monotonic()
        running = self.scheduler.running
        if running and now - self._kv_owners_time < KV_OWNERS_EVERY_S:
            return None
        self._kv_owners_time = now
        return KVOwners([r.request_id for r in running], [list(self.kvcache.block_ids(r)) for r in running])

    def ready(self, load_time: float) -> EngineReady:
        """What the engine tells its client once it can serve (``load_time``: seconds it took)."""
        kv = self.kvcache
        return EngineReady(os.getpid(), self.max_model_len, kv.num_blocks, kv.block_size,
                           kv.capacity_tokens / self.max_model_len, load_time, self.info.device, self.info.attention,
                           self.info.weight_bytes, self.peak_flops, self.peak_bytes_per_second,
                           self.config.quant.plugin, self.info.weight_formats,
                           self.config.parallel.tensor_parallel_size, self.config.parallel.pipeline_parallel_size,
                           self.max_model_len_note, self.info.quant_note)

    def stats(self) -> StepStats:
        """The queues and the KV cache now, and who holds its blocks when that is due (a step fills in its tokens
        and timings)."""
        return StepStats(self.num_steps, time.time(), self.scheduler.stats(), self.kvcache.stats(),
                         kv_owners=self._kv_owners(),
                         connector=self.connector.stats() if self.connector is not None else None)
