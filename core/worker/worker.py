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

from conveyor.config import paths
from conveyor.attention import BackendUnavailable, select_backend
from conveyor.attention.storage import KVStorage
from conveyor.config import Config, ConfigError
from conveyor.connector import KVConnectorWorker
from conveyor.kvcache import KVCacheLayout, KVCacheSpec
from conveyor.messages import RunnerOutput, StepInput
from conveyor.model.decoder_model import DecoderModel
from conveyor.model.invariant import INVARIANT_ROWS
from conveyor.model.layers import LayerOptions
from conveyor.model.loader import DTYPES, load_model, model_len, open_model, requantize_note, resolve_device
from conveyor.model.lora import Adapters
from conveyor.model.parallel import ParallelGroup, Placement, check_divisible
from conveyor.native.gemm_choice import choose_amx_rows
from conveyor.perf.cpus import cpu_limit
from conveyor.quant import QuantMethod
from conveyor.registry import PluginRegistry
from conveyor.worker.compiled import CompiledDecode, use_inductor_cache
from conveyor.worker.drafter import Drafter, scratch_blocks_per_row
from conveyor.worker.rows import BatchRows
from conveyor.worker.rpc import ModelInfo
from conveyor.worker.runner import ModelRunner
from conveyor.worker.sampler import Sampler

logger = logging.getLogger("conveyor")


class Worker:
    """Computes the steps on one device."""

    def __init__(self, config: Config, registry: PluginRegistry, rank: int = 0, init_method: str = "",
                 local_rank: int = 0):
        """Choose the device and the attention backend and join the other workers (cheap; the weights
        load in ``load_model``).

        Args:
            rank: this worker's rank among the engine's ``tensor_parallel_size * pipeline_parallel_size``.
            init_method: where the workers meet (torch.distributed's ``tcp://HOST:PORT``); several workers only.
            local_rank: this worker's number on its machine (its CUDA device).

        Raises:
            ConfigError: the device or the attention backend cannot be used here (the message says why).
        """
        self.config = config
        self.registry = registry
        self.rank = rank
        self.placement = Placement.of(config.parallel, rank)
        self.device = resolve_device(config.model.device)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(self._threads(config.engine.num_threads))
        self.dtype = DTYPES[config.model.dtype]
        try:
            self.backend_class = select_backend(config.engine.attention, self.device)
        except BackendUnavailable as e:
            raise ConfigError(f"{config.source}: [engine] {e}") from None
        self.compile = self._compile_choice()
        self.group = ParallelGroup.init(self.placement, init_method, self.device)
        self.runner: ModelRunner | None = None
        self.adapters: Adapters | None = None
        # speculative = "draft": the draft model and what its KV cache stores per token
        self.draft_model: DecoderModel | None = None
        self.draft_kv_spec: KVCacheSpec | None = None
        self.storage: KVStorage | None = None
        # the KV connector's worker side (conveyor.connector), once the pool exists
        self.kv_connector: KVConnectorWorker | None = None

    def _threads(self, configured: int) -> int:
        """Torch's threads on a CPU: ``[engine] num_threads``, else torch's default (a thread per physical core
        the process may run on) capped by the container's CPU quota, shared by the workers of this host."""
        if configured:
            return configured
        limit = cpu_limit()
        threads = max(1, min(torch.get_num_threads(), limit.usable) // self.placement.world_size)
        if limit.usable < torch.get_num_threads():
            logger.info("%d torch threads: %s", threads, limit.describe())
        return threads

    def _compile_choice(self) -> bool:
        """Whether decode steps run compiled (``[engine] compile``)."""
        config = self.config
        choice = config.engine.compile
        if choice == "off" or (choice == "auto" and self.device.type != "cuda") or config.engine.batch_invariant:
            return False
        reasons = []
        if not self.backend_class.decode_tables:
            reasons.append(f"the {self.backend_class.name!r} attention backend gathers blocks in Python")
        if self.placement.world_size > 1:
            reasons.append("tensor and pipeline parallelism run eagerly for now")
        if config.engine.speculative == "draft":
            reasons.append("a draft model follows every step eagerly")
        if not reasons:
            return True
        if choice == "on":
            raise ConfigError(f"{config.source}: [engine] compile = 'on' cannot run here: {'; '.join(reasons)}; "
                              "allowed here: 'off' ('auto' turns it off where it cannot run)")
        return False

    def load_model(self) -> ModelInfo:
        """Load the weights (quantized by the configured quant method)."""
        config = self.config
        ckpt = open_model(config.model, config.source_of("model"))
        max_model_len = model_len(config.model, ckpt, config.source)
        spec = ckpt.spec
        experts = (spec.moe_intermediate_size, spec.shared_expert_intermediate_size)
        problem = check_divisible(self.placement, spec.num_heads, spec.num_kv_heads, spec.intermediate_size,
                                  spec.num_layers, tuple(w for w in experts if w))
        if problem is not None:
            raise ConfigError(f"{config.source}: [parallel] {problem}")
        quant = self.registry.build("quant", config.quant, self.dtype, self.device)
        self.model = load_model(ckpt, self._layer_options(quant), max_model_len)
        if config.engine.batch_invariant:
            if any(layer.moe is not None for layer in self.model.layers):
                raise ConfigError(f"{config.source}: [engine] batch_invariant = true: {config.model.path} has "
                                  "mixture-of-experts layers, whose routing is not batch-invariant yet; allowed "
                                  "with this model: batch_invariant = false")
            self.model.fix_matmul_rows(INVARIANT_ROWS)
        if self.device.type == "cpu":  # (where both batched packed-block products run: from how many rows AMX's)
            choose_amx_rows(native for linear in self.model.layers[0].linears()
                            if (native := linear.method.native_weight(linear.params)) is not None)
        lora = config.lora
        if lora.max_loras:  # (before the KV cache is sized: the slots take their memory now)
            self.adapters = Adapters(self.model, lora.max_loras, lora.max_lora_rank)
            logger.info("LoRA: %d slots of rank %d, %.1f MiB", lora.max_loras, lora.max_lora_rank,
                        self.adapters.num_bytes() / 2**20)
        # this worker's layers and KV heads; every worker's pool has the same number of blocks
        first = self.model.layers[0]
        windows = {spec.window(layer.index) for layer in self.model.layers}
        kv_spec = KVCacheSpec(len(self.model.layers), first.num_kv_heads, spec.head_dim, config.model.dtype,
                              max_model_len, sliding_window=windows.pop() if len(windows) == 1 else 0)
        if config.engine.speculative == "draft":
            self._load_draft_model(quant, max_model_len)
            kv_spec = msgspec.structs.replace(kv_spec, extra_bytes_per_token=self.draft_kv_spec.bytes_per_token)
        return ModelInfo(max_model_len, kv_spec, str(self.device), self.backend_class.name,
                         self.model.num_weight_bytes(), spec.vocab_size, spec, self.model.weight_formats(),
                         requantize_note(ckpt, quant))

    def _layer_options(self, quant: QuantMethod) -> LayerOptions:
        return LayerOptions(quant, self.dtype, self.device, self.backend_class.fused_layers, self.group)

    def _load_draft_model(self, quant: QuantMethod, max_model_len: int) -> None:
        """The draft model of ``[engine] draft_model`` (its KV cache shares the target's blocks).

        Raises:
            ConfigError: it cannot draft for this model here (the message says why).
        """
        config = self.config
        where = f"{config.source}: [engine] draft_model = {config.engine.draft_model!r}"
        if self.placement.world_size > 1:
            raise ConfigError(f"{where}: a draft model runs on one worker for now (tensor_parallel_size = "
                              "pipeline_parallel_size = 1); allowed here: speculative = 'ngram' or 'off'")
        ckpt = open_model(msgspec.structs.replace(config.model, path=config.engine.draft_model), config.source)
        target_vocab = self.model.spec.vocab_size
        if ckpt.spec.vocab_size != target_vocab:
            raise ConfigError(f"{where}: its vocabulary has {ckpt.spec.vocab_size} tokens, the model's "
                              f"{target_vocab}; a draft model shares the model's tokenizer")
        # (its proposals run up to num_speculative_tokens positions past the last one the model computes)
        self.draft_model = load_model(ckpt, self._layer_options(quant),
                                      max_model_len + config.engine.num_speculative_tokens)
        layers = self.draft_model.layers
        self.draft_kv_spec = KVCacheSpec(len(layers), layers[0].num_kv_heads, ckpt.spec.head_dim,
                                         config.model.dtype, max_model_len)
        logger.info("draft model %s: %d layers, %.1f MB of weights, %d KV bytes per token",
                    config.engine.draft_model, len(layers), self.draft_model.num_weight_bytes() / 1e6,
                    self.draft_kv_spec.bytes_per_token)

    def _drafter(self, layout: KVCacheLayout) -> Drafter:
        """The draft model over a KV storage of its own: the target's blocks (and its spare one), then scratch
        blocks for the proposals of up to ``max_num_seqs`` requests."""
        k = self.config.engine.num_speculative_tokens
        rows = self._max_running() or 256
        first_scratch = layout.num_blocks + 1
        spec = msgspec.structs.replace(self.draft_kv_spec, cache_dtype=layout.spec.cache_dtype)
        storage = KVStorage(KVCacheLayout(spec, first_scratch + rows * scratch_blocks_per_row(k, layout.block_size),
                                          layout.block_size), self.device)
        backend = self.backend_class(storage, self.draft_model.attention_layers())
        return Drafter(self.draft_model, backend, k, first_scratch, rows)

    def _max_running(self) -> int | None:
        """The most requests a step holds, as the configured scheduler says."""
        scheduler = self.config.scheduler
        return self.registry.get("scheduler", scheduler.plugin).max_running(scheduler.options)

    def _compile_batch_sizes(self) -> list[int]:
        """``compile_batch_sizes`` up to ``max_num_seqs``, and ``max_num_seqs`` itself where it falls short of the
        largest (so every step of decodes fits a graph)."""
        sizes = self.config.engine.compile_batch_sizes
        most = self._max_running()
        if most is None:
            return sorted(set(sizes))
        return sorted({s for s in sizes if s <= most} | ({most} if most < max(sizes) else set()))

    def free_memory(self) -> int | None:
        """Bytes free on the device now, or None on a CPU (where the configured budget applies)."""
        if self.device.type == "cuda":
            return torch.cuda.mem_get_info(self.device)[0]
        return None

    def init_kv_cache(self, layout: KVCacheLayout) -> None:
        """Allocate the KV cache pool and set up the backend and the runner over it."""
        storage = self.storage = KVStorage(layout, self.device)
        backend = self.backend_class(storage, self.model.attention_layers(), self.config.engine.batch_invariant)
        compiled = None
        if self.compile:
            use_inductor_cache(paths.cache_root())
            compiled = CompiledDecode(self.model, backend, self._compile_batch_sizes(),
                                      layout.spec.max_model_len)
            compiled.compile_all()
        drafter = self._drafter(layout) if self.draft_model is not None else None
        # one row per running request: what the steps sent of it, and what the runner and sampler keep for it
        rows = BatchRows(storage.pad_block)
        self.runner = ModelRunner(self.model, backend, Sampler(self.config.engine.seed, rows), compiled,
                                  self.adapters, drafter, self.config.engine.native_decode == "auto")
        logger.debug("worker %d: KV cache of %.2f GiB, attention %r", self.rank, storage.num_bytes / 2**30,
                     backend.name)

    def execute(self, step: StepInput) -> RunnerOutput:
        assert self.runner is not None, "init_kv_cache comes before execute"
        rows = self.runner.rows
        if self.placement.tp_size > 1 and any(entry.follows for entry in step.requests):
            # async scheduling: the driver sampled the tokens these entries take in; its TP peers learn them here
            rows.take_followed(step, self.group.broadcast_tokens(rows.followed(step)))
        rows.apply(step)  # (the step's diff into the rows; each entry then refers to its row's parameters)
        failed = None
        if step.kv_connector:  # (blocks moved in or out of the pool before the forward pass reads or writes them)
            failed = self.kv_connector.apply(step.kv_connector)
        output = self.runner.execute(step)
        if failed:
            output.kv_load_failed = list(failed)
        rows.sampled(step, output.sampled)
        return output

    def init_kv_connector(self, setup: bytes) -> None:
        """Build the KV connector's worker side over the pool (``KVConnector.setup``: what its scheduler side
        chose)."""
        spec = self.config.connector
        cls = self.registry.get("connector", spec.plugin)
        self.kv_connector = cls.Worker(spec.options, self.storage, self.rank, setup)

    def kv_connector_call(self, payload: bytes) -> bytes:
        """Between steps: the KV connector's worker side carries out ``payload``; its answer."""
        return self.kv_connector.call(payload)

    def add_lora(self, slot: int, path: str) -> str:
        """Load the LoRA adapter at ``path`` into ``slot``; returns why it cannot be ("" when loaded)."""
        if self.adapters is None:
            return "LoRA is off ([lora] max_loras = 0)"
        try:
            self.adapters.load(slot, path)
        except Exception as e:  # noqa: BLE001 - a bad adapter fails the requests for it, not the worker
            return str(e) if isinstance(e, ValueError) else f"{path}: {type(e).__name__}: {e}"
        return ""

    def shutdown(self) -> None:
        """Free the KV cache and the model, and leave the process group."""
        if self.kv_connector is not None:
            self.kv_connector.close()
        self.runner = None
        self.model = None
        self.group.close()
