"""The engine core: one model, one KV cache, one scheduler, and the step.

``EngineCore.step()`` is schedule -> execute -> update: which requests run
and with how many tokens, one forward pass over all of them, then the sampled
tokens go back to the scheduler, which returns what each request produced.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch

from conveyor.config import Config
from conveyor.engine.runner import ModelRunner
from conveyor.engine.sampler import Sampler
from conveyor.kvcache import KVCacheSpec
from conveyor.messages import EngineRequest, RequestOutput, StepStats
from conveyor.model.loader import DTYPES, load_model, load_tokenizer, model_len, open_model, resolve_device
from conveyor.registry import PluginRegistry
from conveyor.request import FinishReason, Request

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
        now = time.time()
        for request in batch.requests:
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
        num_decode = sum(
            1
            for request in batch.requests[: batch.num_decodes]
            if request.num_output_tokens and request.num_computed_tokens == request.num_tokens - 1
        )
        try:
            sampled, logprobs = self.runner.execute(batch)
        except Exception as e:  # a failed step fails its requests, not the engine
            logger.exception("step failed; ending its %d requests with an error", len(batch))
            return self._fail(batch.requests, f"{type(e).__name__}: {e}"), None
        executed = time.perf_counter()
        outputs = self.scheduler.update(batch, sampled, logprobs)
        self.num_steps += 1
        stats = self.stats(
            num_prefill_tokens=batch.total_tokens - num_decode,
            num_decode_tokens=num_decode,
            schedule_time=scheduled - start,
            forward_time=self.runner.forward_time,
            sample_time=self.runner.sample_time,
            update_time=time.perf_counter() - executed,
        )
        return outputs, stats

    def stats(self, **step: float) -> StepStats:
        """The queues and the KV cache now; ``step`` adds what the last step did (tokens, timings)."""
        scheduler_stats = self.scheduler.stats()
        kv_stats = self.kvcache.stats()
        return StepStats(
            step=self.num_steps,
            timestamp=time.time(),
            num_running=scheduler_stats.num_running,
            num_waiting=scheduler_stats.num_waiting,
            num_prefill_tokens=int(step.pop("num_prefill_tokens", 0)),
            num_decode_tokens=int(step.pop("num_decode_tokens", 0)),
            kv_usage=kv_stats["usage"],
            num_kv_blocks=int(kv_stats.get("num_blocks", 0)),
            num_free_kv_blocks=int(kv_stats.get("num_free_blocks", 0)),
            num_preemptions=scheduler_stats.num_preemptions,
            num_prefix_hit_tokens=int(kv_stats.get("prefix_hits", 0)),
            num_wasted_slots=scheduler_stats.num_wasted_slots,
            **step,
        )

    def _fail(self, requests: list[Request], error: str) -> list[RequestOutput]:
        outputs = self.scheduler.abort(r.request_id for r in requests)
        for output in outputs:
            output.finish_reason = FinishReason.ERROR.value
            output.error = error
        return outputs

