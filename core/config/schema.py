"""The config's tables as typed msgspec Structs: every key, its type, its default and what it does."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec


class ConfigError(ValueError):
    """A configuration problem, described in one line."""


class ModelConfig(msgspec.Struct, forbid_unknown_fields=True):
    # a .gguf file, a Hugging Face directory (config.json + *.safetensors), or an installed alias
    path: str = "smollm2-135m-instruct"
    # tokenizer.json (or a directory holding one); empty: the tokenizer inside the model
    tokenizer: str = ""
    # name clients use for this model; empty: derived from path
    name: str = ""
    # other names clients may use for it (a request naming one is served as if it named the model)
    aliases: list[str] = msgspec.field(default_factory=list)
    # dtype of the weights and activations
    dtype: Literal["float32", "float16", "bfloat16"] = "bfloat16"
    # auto: cuda when available, else cpu
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # longest prompt + output, in tokens; 0: the model's own context length, capped at what the KV cache holds
    # for one request (the banner says which)
    max_model_len: Annotated[int, msgspec.Meta(ge=0)] = 0
    # "auto": the weights in path; "dummy": random weights of the shape in path's config.json (benchmarks and
    # checks without the weights; conveyor.model.dummy)
    load_format: Literal["auto", "dummy"] = "auto"
    # a reasoning model's thinking returned apart from its answer: "think" (the text inside <think>...</think>:
    # Qwen3, DeepSeek-R1 and its distills, QwQ) as reasoning_content in chat completions, a reasoning item in
    # Responses, a thinking block in Messages; "" leaves it in the answer
    reasoning_parser: Literal["", "think"] = ""
    # /v1/embeddings: the final hidden states pooled to one vector per input, "last" (the last token's) or
    # "mean" (the mean of every token's)
    pooling: Literal["last", "mean"] = "last"
    # the chat template of every chat-shaped API (a Jinja file, or the template itself when it holds "{%" or
    # "{{"); "": the checkpoint's own
    chat_template: str = ""

    @property
    def served_name(self) -> str:
        """The name clients use: ``name``, else the path's stem (an alias as it is)."""
        if self.name:
            return self.name
        return Path(self.path).stem if os.sep in self.path or "." in self.path else self.path


class EngineConfig(msgspec.Struct, forbid_unknown_fields=True):
    # torch intra-op threads on CPU; 0: one per core the process may use (a container's CPU quota caps it)
    num_threads: Annotated[int, msgspec.Meta(ge=0)] = 0
    # seed of the sampler for requests that bring no seed of their own
    seed: int = 0
    # attention backend: "auto" (Triton on CUDA; on a CPU the C++ kernels where they build, else torch),
    # "cpu" (the C++ kernels, with the model's norms, rotary and SwiGLU fused in C++ too), "torch" (torch ops
    # only) or "triton" (CUDA; on a CPU only under TRITON_INTERPRET=1). A choice that cannot run here stops
    # the engine at start-up with the reason.
    attention: Literal["auto", "cpu", "torch", "triton"] = "auto"
    # decode steps through torch.compile (inductor), one graph per batch size in compile_batch_sizes (a step
    # of decodes runs in the smallest that holds it, padded); prefill and mixed steps stay eager. "auto":
    # on CUDA; off on a CPU, where eager with the C++ kernels measured as fast (docs/performance.md). "on" compiles on a
    # CPU too; "off" never. Needs an attention backend over block tables ("cpu" or "triton") and one worker.
    compile: Literal["auto", "on", "off"] = "auto"
    # batch sizes compiled at start-up (capped at [scheduler] max_num_seqs, which is added when missing)
    compile_batch_sizes: Annotated[list[Annotated[int, msgspec.Meta(ge=1)]], msgspec.Meta(min_length=1)] = msgspec.field(
        default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    # steps of decodes on a CPU: "auto" runs every layer in one C++ call (the same kernels, in the same order)
    # where the model allows it (Llama's plain block over GGUF blocks or fp8, one worker, attention "cpu", no LoRA);
    # "off" runs them layer by layer from Python
    native_decode: Literal["auto", "off"] = "auto"
    # speculative decoding: "off"; "ngram" (prompt lookup: the tokens that followed the latest earlier
    # occurrence of a request's last few tokens are proposed); "draft" (a smaller model, draft_model, proposes
    # them greedily). One step checks them all.
    speculative: Literal["off", "ngram", "draft"] = "off"
    # tokens proposed per request and step
    num_speculative_tokens: Annotated[int, msgspec.Meta(ge=1, le=16)] = 4
    # the longest n-gram looked up (then shorter ones, down to ngram_min)
    ngram_max: Annotated[int, msgspec.Meta(ge=1)] = 4
    # the shortest n-gram looked up
    ngram_min: Annotated[int, msgspec.Meta(ge=1)] = 2
    # speculative = "draft": the draft model (a path as [model] path takes), with the same vocabulary
    draft_model: str = ""
    # batch-invariant mode: a request's tokens and logprobs are bit-identical whatever else is in its steps
    # (alone or among many, its prompt in any chunks, preempted or not): every matmul runs in blocks of a fixed
    # number of rows, and every token attends as a decode does. Costs throughput (docs/correctness.md,
    # "Batch-invariant mode"); one worker, no speculative decoding, no LoRA, decode steps not compiled.
    batch_invariant: bool = False
    # overlapped steps: while the worker runs step N the engine core schedules step N+1 (a request's next input
    # is the token step N samples, which the worker feeds in itself) and publishes step N-1's outputs. "auto":
    # on where it measured faster (docs/performance.md, "Async scheduling"); "on" needs pipeline_parallel_size = 1
    # (pipeline stages overlap their steps already); with tensor parallelism the driver shares the tokens it fed in.
    async_scheduling: Literal["auto", "on", "off"] = "auto"

    def __post_init__(self) -> None:
        if (self.speculative == "draft") != bool(self.draft_model):
            raise ValueError("speculative = 'draft' and draft_model go together: set both, or neither "
                             f"(speculative = {self.speculative!r}, draft_model = {self.draft_model!r})")


class ParallelConfig(msgspec.Struct, forbid_unknown_fields=True):
    # devices (processes on a CPU) one layer's matmuls are split over: heads, MLP columns and the vocabulary
    tensor_parallel_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    # stages the layers are split into, one after another
    pipeline_parallel_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    # engine replicas behind one frontend, each with its own workers and KV cache
    data_parallel_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    # how the engine reaches its workers: "uniproc" (in its own process; TP = PP = 1 only), "mp" (worker
    # processes on this machine), "ray" (Ray actors); "auto": uniproc when TP * PP = 1, else mp
    executor: Literal["auto", "uniproc", "mp", "ray"] = "auto"
    # Ray: "" starts a local Ray instance; "auto" or "HOST:PORT" joins a running cluster
    ray_address: str = ""
    # prefill/decode disaggregation: engines that only prefill prompts (0 with decode_engines = 0: every engine
    # does both); the prompts' KV moves to the decode engines through the "tiers" connector
    prefill_engines: Annotated[int, msgspec.Meta(ge=0)] = 0
    # engines that take the prompts' KV from the prefill engines and decode
    decode_engines: Annotated[int, msgspec.Meta(ge=0)] = 0
    # the directory the prefill engines store the KV blocks in for the decode engines; "": a new one in shared
    # memory (/dev/shm where there is one), removed when the server stops (after a kill, by the next server)
    kv_transfer_dir: str = ""
    # seconds a decode engine waits for a prompt's blocks before it computes what has not come
    kv_transfer_timeout: Annotated[float, msgspec.Meta(gt=0)] = 30.0

    def __post_init__(self) -> None:
        if (self.prefill_engines == 0) != (self.decode_engines == 0):
            raise ValueError(
                f"prefill_engines = {self.prefill_engines}, decode_engines = {self.decode_engines}: set both (each "
                "at least 1) to disaggregate prefill from decode, or neither"
            )
        if self.prefill_engines and self.data_parallel_size > 1:
            raise ValueError(
                f"data_parallel_size = {self.data_parallel_size} with prefill_engines and decode_engines: the "
                "prefill and decode engines are the replicas; allowed: data_parallel_size = 1"
            )
        if self.executor == "uniproc" and self.world_size > 1:
            raise ValueError(
                f"executor = 'uniproc' runs one worker, but tensor_parallel_size * pipeline_parallel_size = "
                f"{self.world_size}; allowed: 'auto', 'mp', 'ray'"
            )

    @property
    def world_size(self) -> int:
        """Workers of one engine: TP * PP."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor_name(self) -> str:
        """The executor ``auto`` stands for here."""
        if self.executor != "auto":
            return self.executor
        return "uniproc" if self.world_size == 1 else "mp"


class ServerConfig(msgspec.Struct, forbid_unknown_fields=True):
    # frontend <-> engine sockets: "ipc" (Unix sockets in a private directory) or "tcp://HOST" (free ports)
    engine_address: str = "ipc"
    # on SIGINT/SIGTERM: seconds to let in-flight requests finish before aborting them
    drain_timeout: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    # seconds between status lines while busy; 0: none
    status_interval: Annotated[float, msgspec.Meta(ge=0)] = 10.0
    # engine process deaths tolerated within ten minutes before the server exits non-zero
    max_engine_restarts: Annotated[int, msgspec.Meta(ge=0)] = 3
    # seconds the engine may send nothing while requests are in flight (it reports after every step) before
    # the frontend declares it stalled: in-flight requests get 503 and the engine is killed and restarted; 0: never
    engine_timeout: Annotated[float, msgspec.Meta(ge=0)] = 120.0

    def __post_init__(self) -> None:
        if self.engine_address != "ipc" and not self.engine_address.startswith("tcp://"):
            raise ValueError(f"engine_address = {self.engine_address!r}: allowed: 'ipc' or 'tcp://HOST'")


class LoraConfig(msgspec.Struct, forbid_unknown_fields=True):
    # LoRA adapters (PEFT format) the workers hold at once, each in a slot of its own; 0: LoRA off. A request
    # for an adapter not held waits until a slot frees (the least recently used adapter no request holds
    # goes first)
    max_loras: Annotated[int, msgspec.Meta(ge=0, le=64)] = 0
    # the largest adapter rank; the slots are this wide (memory: docs/lora.md)
    max_lora_rank: Annotated[int, msgspec.Meta(ge=1, le=256)] = 16
    # adapters served from start-up: name -> directory (adapter_config.json, adapter_model.safetensors);
    # requests choose one with "model": "NAME" or "BASE:NAME"
    adapters: dict[str, str] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.adapters and not self.max_loras:
            raise ValueError(f"adapters names {len(self.adapters)} adapters but max_loras = 0 turns LoRA off; "
                             "allowed: max_loras >= 1")
        bad = [name for name in self.adapters if not name or ":" in name]
        if bad:
            raise ValueError(f"adapters: the name {bad[0]!r} is not allowed (non-empty, no ':')")


class BatchConfig(msgspec.Struct, forbid_unknown_fields=True):
    # where the Batch API keeps its files and their records (an SQLite database beside a files/ folder), kept
    # across restarts; "": off (/v1/files answers 404 naming this key)
    dir: str = ""
    # the largest file /v1/files takes, in MiB (OpenAI's limit for batch input files is 200 MB)
    max_file_mb: Annotated[int, msgspec.Meta(ge=1)] = 200


class PluginSpec(msgspec.Struct):
    """One plugin table after validation."""

    # the plugin's registered name
    plugin: str
    # an instance of the plugin's Options Struct
    options: Any = None


# plugin table (named after its kind) -> the plugin used when the table names none
PLUGIN_KINDS: dict[str, str | None] = {
    "scheduler": "continuous",
    "kvcache": "paged",
    "quant": "auto",
    "transport": None,
    "connector": "none",
}


class Config(msgspec.Struct, dict=True):
    """A whole validated config. The registry that validated it rides along, unencoded (``PluginRegistry.of``)."""

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)
    batch: BatchConfig = msgspec.field(default_factory=BatchConfig)
    scheduler: PluginSpec = msgspec.field(default_factory=lambda: PluginSpec(PLUGIN_KINDS["scheduler"]))
    kvcache: PluginSpec = msgspec.field(default_factory=lambda: PluginSpec(PLUGIN_KINDS["kvcache"]))
    quant: PluginSpec = msgspec.field(default_factory=lambda: PluginSpec(PLUGIN_KINDS["quant"]))
    transport: list[PluginSpec] = msgspec.field(default_factory=list)
    connector: PluginSpec = msgspec.field(default_factory=lambda: PluginSpec(PLUGIN_KINDS["connector"]))
    # extra plugin modules to load by import path
    plugins: list[str] = msgspec.field(default_factory=list)
    # where this config came from (for messages); "<defaults>" when built in code
    source: str = "<defaults>"
    # the keys set by --set (or the command line's shortcuts), "table.key", for messages
    overridden: list[str] = msgspec.field(default_factory=list)

    def source_of(self, table: str) -> str:
        """Where a table's keys came from, for a message about them (``table_source``)."""
        return table_source(self.source, self.overridden, table)


def table_source(source: str, overridden: Iterable[str], table: str) -> str:
    """Where a table's keys came from: the file, and any of its keys set by --set ("configs/default.toml with --set
    model.path")."""
    keys = sorted(k for k in overridden if k == table or k.startswith(f"{table}."))
    return f"{source} with --set {', '.join(keys)}" if keys else source
