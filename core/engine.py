"""The engine core: one model, one KV cache, one scheduler, and the step.

``step()`` is schedule -> execute -> update: which requests run and with how
many tokens, one forward pass over all of them, then the sampled tokens go
back to the scheduler, which returns what each request produced.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch

from conveyor.config import Config
from conveyor.kvcache import KVCacheSpec
from conveyor.messages import EngineRequest, RequestOutput
from conveyor.model.loader import DTYPES, load_model, load_tokenizer, model_len, open_model, resolve_device
from conveyor.registry import PluginRegistry
from conveyor.request import FinishReason, Request
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

    def step(self) -> list[RequestOutput]:
        """Run one step; return what every affected request produced."""
        batch = self.scheduler.schedule()
        if not batch.requests:
            return []
        try:
            sampled, logprobs = self.runner.execute(batch)
        except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the engine
            logger.exception("step failed; ending its %d requests with an error", len(batch))
            return self._fail(batch.requests, f"{type(e).__name__}: {e}")
        return self.scheduler.update(batch, sampled, logprobs)

    def _fail(self, requests: list[Request], error: str) -> list[RequestOutput]:
        outputs = self.scheduler.abort(r.request_id for r in requests)
        for output in outputs:
            output.finish_reason = FinishReason.ERROR.value
            output.error = error
        return outputs
