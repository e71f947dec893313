"""The engine: one model, one KV cache, one scheduler, and the step loop.

``EngineCore.step()`` is schedule -> execute -> update: which requests run
and with how many tokens, one forward pass over all of them, then the sampled
tokens go back to the scheduler, which returns what each request produced.
``AsyncEngine`` runs that step in a loop and publishes the outputs.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import anyio
import anyio.abc
import torch
from anyio.streams.memory import MemoryObjectSendStream

from conveyor.config import Config
from conveyor.kvcache import KVCacheSpec
from conveyor.messages import EngineRequest, RequestOutput, StepStats
from conveyor.model.loader import DTYPES, load_model, load_tokenizer, model_len, open_model, resolve_device
from conveyor.registry import PluginRegistry
from conveyor.request import FinishReason, Request, RequestRejected
from conveyor.runner import ModelRunner
from conveyor.sampler import Sampler

logger = logging.getLogger("conveyor")


class EngineCore:
    """Owns the model and the batch; knows nothing of HTTP or sockets."""

    def __init__(self, config: Config, registry: PluginRegistry | None = None):
        registry = registry or PluginRegistry(config.plugins, source=config.source)
        self.config = config
        self.device = resolve_device(config.model.device)
        if self.device.type == "cpu" and config.engine.num_threads:
            torch.set_num_threads(config.engine.num_threads)
        dtype = DTYPES[config.model.dtype]
        ckpt = open_model(config.model, config.source)
        self.max_model_len = model_len(config.model, ckpt, config.source)
        self.tokenizer = load_tokenizer(config.model, ckpt, config.source)
        self.eos_token_ids = self.tokenizer.eos_token_ids

        def plugin(kind: str, spec):
            cls = registry.get(kind, spec.plugin)
            return cls, spec.options if spec.options is not None else cls.Options()

        quant_cls, quant_options = plugin("quant", config.quant)
        self.model = load_model(ckpt, quant_cls(quant_options, dtype, self.device), dtype, self.device, self.max_model_len)
        del ckpt
        spec = self.model.spec
        kv_spec = KVCacheSpec(spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype, self.device, self.max_model_len)
        kv_cls, kv_options = plugin("kvcache", config.kvcache)
        self.kvcache = kv_cls(kv_options, kv_spec)
        scheduler_cls, scheduler_options = plugin("scheduler", config.scheduler)
        self.scheduler = scheduler_cls(scheduler_options, self.kvcache, self.max_model_len)
        self.runner = ModelRunner(self.model, self.kvcache, Sampler(config.engine.seed))
        self.num_steps = 0

    def add_request(self, message: EngineRequest) -> None:
        """Queue a request.

        Raises:
            RequestRejected: it cannot run here (too long, queue full, ...).
        """
        request = Request.from_message(message, self.max_model_len, self.eos_token_ids)
        self.scheduler.add(request)

    def abort(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        return self.scheduler.abort(request_ids)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> tuple[list[RequestOutput], StepStats | None]:
        """Run one step.

        Returns:
            What every affected request produced, and the step's stats (None
            when there was nothing to run).
        """
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch.requests:
            return [], None
        scheduled = time.perf_counter()
        num_decode = sum(
            1
            for request in batch.requests[: batch.num_decodes]
            if request.num_output_tokens and request.num_computed_tokens == request.num_tokens - 1
        )
        try:
            sampled, logprobs = self.runner.execute(batch)
        except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the engine
            logger.exception("step failed; ending its %d requests with an error", len(batch))
            return self._fail(batch.requests, f"{type(e).__name__}: {e}"), None
        executed = time.perf_counter()
        outputs = self.scheduler.update(batch, sampled, logprobs)
        self.num_steps += 1
        scheduler_stats = self.scheduler.stats()
        kv_stats = self.kvcache.stats()
        stats = StepStats(
            step=self.num_steps,
            timestamp=time.time(),
            num_running=scheduler_stats.num_running,
            num_waiting=scheduler_stats.num_waiting,
            num_prefill_tokens=batch.total_tokens - num_decode,
            num_decode_tokens=num_decode,
            kv_usage=kv_stats["usage"],
            num_preemptions=scheduler_stats.num_preemptions,
            num_prefix_hit_tokens=int(kv_stats.get("prefix_hits", 0)),
            num_wasted_slots=scheduler_stats.num_wasted_slots,
            schedule_time=scheduled - start,
            forward_time=self.runner.forward_time,
            sample_time=self.runner.sample_time,
            update_time=time.perf_counter() - executed,
        )
        return outputs, stats

    def _fail(self, requests: list[Request], error: str) -> list[RequestOutput]:
        outputs = self.scheduler.abort(r.request_id for r in requests)
        for output in outputs:
            output.finish_reason = FinishReason.ERROR.value
            output.error = error
        return outputs


class AsyncEngine:
    """Runs an EngineCore's step loop beside asyncio code.

    Requests and aborts are queued from any task and taken between steps, so
    a step is never blocked; each step runs in a worker thread, so the event
    loop stays responsive during the forward pass; outputs go to one stream
    per request. Leaving a ``generate`` stream early aborts the request.
    """

    def __init__(self, core: EngineCore, on_step: Callable[[StepStats], None] | None = None):
        self.core = core
        self.on_step = on_step
        # ("add", EngineRequest) or ("abort", request id), in arrival order
        self._inbox: list[tuple[str, Any]] = []
        self._streams: dict[str, MemoryObjectSendStream[RequestOutput]] = {}
        self._wakeup = anyio.Event()
        self.running = False

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """The step loop; runs until cancelled."""
        self.running = True
        task_status.started()
        try:
            while True:
                self._take_inbox()
                if not self.core.has_unfinished():
                    await self._wakeup.wait()
                    self._wakeup = anyio.Event()
                    continue
                outputs, stats = await anyio.to_thread.run_sync(self.core.step)
                self._publish(outputs)
                if stats is None:
                    await anyio.sleep(0.002)  # a batching scheduler is still collecting requests
                elif self.on_step is not None:
                    self.on_step(stats)
        finally:
            self.running = False

    def _take_inbox(self) -> None:
        inbox, self._inbox = self._inbox, []
        aborts = [payload for kind, payload in inbox if kind == "abort"]
        for kind, payload in inbox:
            if kind != "add":
                continue
            if payload.request_id in aborts:  # withdrawn before it reached the engine
                self._publish([RequestOutput(payload.request_id, finish_reason=FinishReason.ABORT.value)])
                continue
            try:
                self.core.add_request(payload)
            except RequestRejected as e:
                rejection = RequestOutput(payload.request_id, finish_reason="error", error=str(e), error_status=e.status)
                self._publish([rejection])
        if aborts:
            self._publish(self.core.abort(aborts))

    def _publish(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            try:
                stream.send_nowait(output)
            except anyio.BrokenResourceError:  # the reader left; its abort is on the way
                del self._streams[output.request_id]
                continue
            if output.finish_reason is not None:
                stream.close()
                del self._streams[output.request_id]

    def _post(self, kind: str, payload: Any) -> None:
        self._inbox.append((kind, payload))
        self._wakeup.set()

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs until the final one."""
        if request.request_id in self._streams:
            raise RequestRejected(f"request id {request.request_id!r} is already in use")
        # Unbounded: a slow reader must not stall the engine; max_tokens bounds it.
        send, receive = anyio.create_memory_object_stream[RequestOutput](math.inf)
        self._streams[request.request_id] = send
        self._post("add", request)
        finished = False
        try:
            async with receive:
                async for output in receive:
                    finished = output.finish_reason is not None
                    yield output
        finally:
            if not finished:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; its stream ends with an ``abort`` output."""
        if request_id in self._streams:
            self._post("abort", request_id)
