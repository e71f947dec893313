"""A worker: one device, its share of the model, its KV cache tensors, the attention backend and the runner.

The executor calls the same methods on every worker, in this order:
``load_model`` (weights on the device; the model's facts come back),
``free_memory`` (what is left for the KV cache), ``init_kv_cache`` (the
pool the KV cache manager sized), then ``execute`` once per step.
"""

from __future__ import annotations

import logging

import msgspec
import torch

from conveyor.attention import BackendUnavailable, select_backend
from conveyor.attention.storage import KVStorage
from conveyor.config import Config, ConfigError
from conveyor.kvcache import KVCacheLayout, KVCacheSpec
from conveyor.messages import RunnerOutput, StepInput
from conveyor.model.loader import DTYPES, load_model, model_len, open_model, resolve_device
from conveyor.registry import PluginRegistry
from conveyor.worker.runner import ModelRunner
from conveyor.worker.sampler import Sampler

logger = logging.getLogger("conveyor")


class ModelInfo(msgspec.Struct, array_like=True, frozen=True):
    """What a worker tells the engine core once its share of the model is loaded."""

    max_model_len: int
    # what one token takes in this worker's KV cache (cache_dtype "auto"; the KV cache manager decides)
    kv_spec: KVCacheSpec
    # e.g. "cpu", "cuda:0"
    device: str
    # the attention backend chosen for it
    attention: str
    # bytes of the weights as stored (quantized layers at their packed size)
    weight_bytes: int


class Worker:
    """Computes the steps on one device."""

    def __init__(self, config: Config, registry: PluginRegistry, rank: int = 0):
        """Choose the device and the attention backend (cheap; the weights load in ``load_model``).

        Raises:
            ConfigError: the device or the attention backend cannot be used here (the message says why).
        """
        self.config = config
        self.registry = registry
        self.rank = rank
        self.device = resolve_device(config.model.device)
        if self.device.type == "cpu" and config.engine.num_threads:
            torch.set_num_threads(config.engine.num_threads)
        self.dtype = DTYPES[config.model.dtype]
        try:
            self.backend_class = select_backend(config.engine.attention, self.device)
        except BackendUnavailable as e:
            raise ConfigError(f"{config.source}: [engine] {e}") from None
        self.runner: ModelRunner | None = None

    def load_model(self) -> ModelInfo:
        """Load the weights (quantized by the configured quant method)."""
        config = self.config
        ckpt = open_model(config.model, config.source)
        max_model_len = model_len(config.model, ckpt, config.source)
        quant = self.registry.build("quant", config.quant, self.dtype, self.device)
        self.model = load_model(ckpt, quant, self.dtype, self.device, max_model_len, self.backend_class.fused_layers)
        spec = self.model.spec
        kv_spec = KVCacheSpec(spec.num_layers, spec.num_kv_heads, spec.head_dim, config.model.dtype, max_model_len)
        return ModelInfo(max_model_len, kv_spec, str(self.device), self.backend_class.name,
                         self.model.num_weight_bytes())

    def free_memory(self) -> int | None:
        """Bytes free on the device now, or None on a CPU (where the configured budget applies)."""
        if self.device.type == "cuda":
            return torch.cuda.mem_get_info(self.device)[0]
        return None

    def init_kv_cache(self, layout: KVCacheLayout) -> None:
        """Allocate the KV cache pool and set up the backend and the runner over it."""
        storage = KVStorage(layout, self.device)
        backend = self.backend_class(storage)
        self.runner = ModelRunner(self.model, backend, Sampler(self.config.engine.seed))
        logger.debug("worker %d: KV cache of %.2f GiB, attention %r", self.rank, storage.num_bytes / 2**30,
                     backend.name)

    def execute(self, step: StepInput) -> RunnerOutput:
        assert self.runner is not None, "init_kv_cache comes before execute"
        return self.runner.execute(step)
