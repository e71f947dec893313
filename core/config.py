"""TOML configuration -> typed msgspec Structs.

A config file has four core tables, ``[model]``, ``[engine]``, ``[server]`` and ``[parallel]``, one table per
plugin kind (``[scheduler]``, ``[kvcache]``, ``[quant]``, ``[[transport]]``)
and a top-level ``plugins = [...]`` list of extra plugin modules. Each plugin
table names its plugin with ``plugin = "name"``; its other keys are that
plugin's own options, validated by the plugin's ``Options`` Struct.

Every error is a :class:`ConfigError` whose message is one line naming the
file (or the ``--set`` override), the table, the key, the bad value and what
is allowed.
"""

from __future__ import annotations

import os
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

if TYPE_CHECKING:
    from conveyor.registry import PluginRegistry

__all__ = [
    "PLUGIN_KINDS",
    "Config",
    "ConfigError",
    "EngineConfig",
    "ModelConfig",
    "ParallelConfig",
    "PluginSpec",
    "ServerConfig",
    "load_config",
]


class ConfigError(ValueError):
    """A configuration problem, described in one line."""


class ModelConfig(msgspec.Struct, forbid_unknown_fields=True):
    # a .gguf file, a Hugging Face directory (config.json + *.safetensors), or an installed alias
    path: str = "smollm2-135m-instruct"
    # tokenizer.json (or a directory holding one); empty: the tokenizer inside the model
    tokenizer: str = ""
    # name clients use for this model; empty: derived from path
    name: str = ""
    # dtype of the weights and activations
    dtype: Literal["float32", "float16", "bfloat16"] = "bfloat16"
    # auto: cuda when available, else cpu
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # longest prompt + output, in tokens; 0: the model's own context length
    max_model_len: Annotated[int, msgspec.Meta(ge=0)] = 2048

    @property
    def served_name(self) -> str:
        """The name clients use: ``name``, else the path's stem (an alias as it is)."""
        if self.name:
            return self.name
        return Path(self.path).stem if os.sep in self.path or "." in self.path else self.path


class EngineConfig(msgspec.Struct, forbid_unknown_fields=True):
    # torch intra-op threads on CPU; 0: one per core
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
    # on CUDA; off on a CPU, where eager with the C++ kernels measured as fast (README). "on" compiles on a
    # CPU too; "off" never. Needs an attention backend over block tables ("cpu" or "triton") and one worker.
    compile: Literal["auto", "on", "off"] = "auto"
    # batch sizes compiled at start-up (capped at [scheduler] max_num_seqs, which is added when missing)
    compile_batch_sizes: Annotated[list[Annotated[int, msgspec.Meta(ge=1)]], msgspec.Meta(min_length=1)] = msgspec.field(
        default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    # speculative decoding: "off"; "ngram" (prompt lookup: the tokens that followed the latest earlier
    # occurrence of a request's last few tokens are proposed); "draft" (a smaller model, draft_model, proposes
    # them greedily). One step checks them all.
    speculative: Literal["off", "ngram", "draft"] = "off"
    # tokens proposed per request and step
    num_speculative_tokens: Annotated[int, msgspec.Meta(ge=1, le=16)] = 4
    # lengths of the n-gram looked up, longest first
    ngram_max: Annotated[int, msgspec.Meta(ge=1)] = 4
    ngram_min: Annotated[int, msgspec.Meta(ge=1)] = 2
    # speculative = "draft": the draft model (a path as [model] path takes), with the same vocabulary
    draft_model: str = ""
    # batch-invariant mode: a request's tokens and logprobs are bit-identical whatever else is in its steps
    # (alone or among many, its prompt in any chunks, preempted or not): every matmul runs in blocks of a fixed
    # number of rows, and every token attends as a decode does. Costs throughput (README, "Batch-invariant
    # mode"); one worker, no speculative decoding, no LoRA, decode steps not compiled.
    batch_invariant: bool = False

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

    def __post_init__(self) -> None:
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
    # the largest adapter rank; the slots are this wide (memory: see README "LoRA adapters")
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
}


class Config(msgspec.Struct, dict=True):
    """A whole validated config. The registry that validated it rides along, unencoded (``PluginRegistry.of``)."""

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)
    scheduler: PluginSpec = msgspec.field(default_factory=lambda: PluginSpec(PLUGIN_KINDS["scheduler"]))
    kvcache: PluginSpec = msgspec.field(default_factory=lambda: PluginSpec(PLUGIN_KINDS["kvcache"]))
    quant: PluginSpec = msgspec.field(default_factory=lambda: PluginSpec(PLUGIN_KINDS["quant"]))
    transport: list[PluginSpec] = msgspec.field(default_factory=list)
    # extra plugin modules to load by import path
    plugins: list[str] = msgspec.field(default_factory=list)
    # where this config came from (for messages); "<defaults>" when built in code
    source: str = "<defaults>"


_CORE_TABLES: dict[str, type[msgspec.Struct]] = {
    "model": ModelConfig, "engine": EngineConfig, "server": ServerConfig, "parallel": ParallelConfig,
    "lora": LoraConfig,
}
_TOP_LEVEL_KEYS = ("model", "engine", "server", "parallel", "lora", "scheduler", "kvcache", "quant", "transport", "plugins")


class _Origin:
    """Says where a key came from: the file, or a ``--set`` override."""

    def __init__(self, source: str, overridden: set[str]):
        self.source = source
        self.overridden = overridden

    def of(self, table: str, key: str | None = None) -> str:
        dotted = f"{table}.{key}" if key else table
        if dotted in self.overridden:
            return f"--set {dotted}"
        return self.source


def load_config(
    path: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    registry: PluginRegistry | None = None,
) -> Config:
    """Read a TOML file (or the built-in defaults when ``path`` is None).

    Args:
        path: the TOML file.
        overrides: ``{"section.key": value}``; string values are parsed as
            TOML values when they parse ("8" -> 8, "true" -> True), else kept
            as strings.
        registry: the plugin registry used to validate plugin tables; built
            from the config's ``plugins`` list when not given.

    Returns:
        The validated Config.

    Raises:
        ConfigError: one line naming file, table, key, value and what is allowed.
    """
    source = str(path) if path is not None else "<defaults>"
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"{source}: no such config file") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{source}: not valid TOML: {e}") from None
    # the default transport, materialized so that --set transport.0.port=... works on any file
    raw.setdefault("transport", [{"plugin": "http"}])
    overridden = set()
    for dotted, value in (overrides or {}).items():
        _apply_override(raw, dotted, value, source)
        overridden.add(dotted)
    origin = _Origin(source, overridden)
    return _build(raw, origin, registry)


def encode_config(config: Config) -> bytes:
    """A validated config as msgpack, to hand to another process (``decode_config`` reads it)."""
    return msgspec.msgpack.encode(config)


def decode_config(data: bytes, registry: PluginRegistry | None = None) -> Config:
    """The config ``encode_config`` wrote; plugin options become their plugins' Options Structs again.

    Raises:
        ConfigError: the bytes are not a config, or a plugin it names is not installed here.
    """
    try:
        config = msgspec.msgpack.decode(data, type=Config)
    except msgspec.DecodeError as e:
        raise ConfigError(f"not a Conveyor config: {e}") from None
    if registry is None:
        from conveyor.registry import PluginRegistry

        registry = PluginRegistry(config.plugins, source=config.source)
    for kind, specs in (("scheduler", [config.scheduler]), ("kvcache", [config.kvcache]), ("quant", [config.quant]),
                        ("transport", config.transport)):
        for spec in specs:
            cls = _plugin_class(registry, kind, spec.plugin, config.source, kind)
            spec.options = msgspec.convert(spec.options or {}, cls.Options)
    config._registry = registry
    return config


def _plugin_class(registry: PluginRegistry, kind: str, name: str, origin: str, table: str) -> type:
    """The class of plugin ``name``; a ConfigError listing what is installed when there is none."""
    try:
        return registry.get(kind, name)
    except KeyError as e:
        raise ConfigError(f"{origin}: [{table}] plugin = {name!r}: {e.args[0]}") from None


def parse_override(text: str) -> tuple[str, Any]:
    """Split a CLI ``section.key=value`` into its key and parsed value."""
    key, sep, value = text.partition("=")
    if not sep or "." not in key:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. model.dtype=float32")
    return key.strip(), value.strip()


def _parse_value(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return value


def _apply_override(raw: dict[str, Any], dotted: str, value: Any, source: str) -> None:
    parts = dotted.split(".")
    if len(parts) < 2:
        raise ConfigError(f"--set {dotted}: expected section.key=value, e.g. model.dtype=float32")
    node: Any = raw
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"--set {dotted}: {'.'.join(parts[:i])} has {len(node)} entries")
            node = node[int(part)]
        else:
            node = node.setdefault(part, {})
        if not isinstance(node, (dict, list)):
            raise ConfigError(f"--set {dotted}: {'.'.join(parts[: i + 1])} is not a table")
    if isinstance(node, list):
        raise ConfigError(f"--set {dotted}: name an entry of the list, e.g. transport.0.port")
    node[parts[-1]] = _parse_value(value)


def _build(raw: dict[str, Any], origin: _Origin, registry: PluginRegistry | None) -> Config:
    for key in raw:
        if key not in _TOP_LEVEL_KEYS:
            raise ConfigError(
                f"{origin.of(key)}: unknown key {key!r}; allowed: {', '.join(_TOP_LEVEL_KEYS)}"
            )
    tables: dict[str, Any] = {}
    for name, struct_type in _CORE_TABLES.items():
        table = raw.get(name, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{origin.of(name)}: [{name}] must be a table")
        tables[name] = convert_table(table, struct_type, name, origin.of)

    plugins = raw.get("plugins", [])
    if not isinstance(plugins, list) or not all(isinstance(p, str) for p in plugins):
        raise ConfigError(f"{origin.of('plugins')}: plugins must be a list of module names")
    if registry is None:
        from conveyor.registry import PluginRegistry

        registry = PluginRegistry(modules=plugins, source=origin.source)

    specs: dict[str, Any] = {}
    for kind, default in PLUGIN_KINDS.items():
        value = raw.get(kind)
        if kind == "transport":
            entries = value if value is not None else []
            if isinstance(entries, dict):
                entries = [entries]
            if not isinstance(entries, list):
                raise ConfigError(f"{origin.of(kind)}: [[transport]] must be a list of tables")
            specs[kind] = [
                _plugin_spec(entry, kind, None, f"transport.{i}", origin, registry) for i, entry in enumerate(entries)
            ]
        else:
            specs[kind] = _plugin_spec(value or {}, kind, default, kind, origin, registry)
    _check_batch_invariant(tables, origin)
    config = Config(**tables, **specs, plugins=list(plugins), source=origin.source)
    config._registry = registry
    return config


def _check_batch_invariant(tables: dict[str, Any], origin: _Origin) -> None:
    """``[engine] batch_invariant`` runs one worker per engine, without the features that change a step's
    arithmetic by what else is in it."""
    engine, lora, parallel = tables["engine"], tables["lora"], tables["parallel"]
    if not engine.batch_invariant:
        return
    conflicts = [
        (engine.speculative != "off", "engine", "speculative", repr(engine.speculative), "'off'"),
        (engine.compile == "on", "engine", "compile", "'on'", "'auto' or 'off'"),
        (lora.max_loras > 0, "lora", "max_loras", lora.max_loras, "0"),
        (parallel.tensor_parallel_size > 1, "parallel", "tensor_parallel_size", parallel.tensor_parallel_size, "1"),
        (parallel.pipeline_parallel_size > 1, "parallel", "pipeline_parallel_size", parallel.pipeline_parallel_size,
         "1"),
    ]
    for conflict, table, key, value, allowed in conflicts:
        if conflict:
            raise ConfigError(f"{origin.of(table, key)}: [{table}] {key} = {value} cannot run with [engine] "
                              f"batch_invariant = true; allowed with it: {allowed}")


def _plugin_spec(
    table: Any,
    kind: str,
    default: str | None,
    where: str,
    origin: _Origin,
    registry: PluginRegistry,
) -> PluginSpec:
    if not isinstance(table, dict):
        raise ConfigError(f"{origin.of(where)}: [{where}] must be a table")
    options = dict(table)
    name = options.pop("plugin", default)
    if name is None:
        raise ConfigError(f"{origin.of(where)}: [{where}] needs plugin = \"name\"")
    if not isinstance(name, str):
        raise ConfigError(f"{origin.of(where, 'plugin')}: [{where}] plugin must be a string")
    cls = _plugin_class(registry, kind, name, origin.of(where, "plugin"), where)
    return PluginSpec(name, convert_table(options, cls.Options, where, origin.of))


def convert_table(
    table: Mapping[str, Any],
    struct_type: type[msgspec.Struct],
    where: str,
    origin_of: typing.Callable[[str, str | None], str] = lambda t, k=None: "<config>",
) -> Any:
    """Validate one table against a Struct, key by key, with one-line errors."""
    fields = {f.encode_name: f for f in msgspec.structs.fields(struct_type)}
    for key, value in table.items():
        field = fields.get(key)
        if field is None:
            allowed = ", ".join(fields) if fields else "(this table takes no keys)"
            raise ConfigError(f"{origin_of(where, key)}: [{where}] unknown key {key!r}; allowed: {allowed}")
        try:
            msgspec.convert(value, field.type)
        except msgspec.ValidationError as e:
            raise ConfigError(
                f"{origin_of(where, key)}: [{where}] {key} = {value!r}: {describe_type(field.type, e)}"
            ) from None
    try:
        return msgspec.convert(dict(table), struct_type)
    except (msgspec.ValidationError, ValueError) as e:
        # cross-field checks in __post_init__
        raise ConfigError(f"{origin_of(where, None)}: [{where}] {e}") from None


def describe_type(tp: Any, error: Exception) -> str:
    """What went wrong with a value, in words, e.g. "allowed: 'a', 'b'"."""
    if typing.get_origin(tp) is Literal:
        return "allowed: " + ", ".join(repr(v) for v in typing.get_args(tp))
    return str(error).split(" - at ")[0]
