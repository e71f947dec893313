"""Reading a config: TOML and ``--set`` overrides into the Structs of ``conveyor.config.schema``, with one-line
errors; and the msgpack form a config travels in to other processes."""

from __future__ import annotations

import re
import sys
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgspec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

if TYPE_CHECKING:
    from conveyor.registry import PluginRegistry

from conveyor.config.schema import (
    PLUGIN_KINDS,
    BatchConfig,
    Config,
    ConfigError,
    EngineConfig,
    LoraConfig,
    ModelConfig,
    ParallelConfig,
    PluginSpec,
    ServerConfig,
    table_source,
)

_CORE_TABLES: dict[str, type[msgspec.Struct]] = {
    "model": ModelConfig, "engine": EngineConfig, "server": ServerConfig, "parallel": ParallelConfig,
    "lora": LoraConfig, "batch": BatchConfig,
}
# quantization formats of Hugging Face checkpoints, which the checkpoint names and "auto" serves (a user may
# look for a quant plugin of that name, as other servers have a flag for each)
HF_QUANT_FORMATS = frozenset({"awq", "gptq", "compressed-tensors"})
_TOP_LEVEL_KEYS = ("model", "engine", "server", "parallel", "lora", "batch", "scheduler", "kvcache", "quant",
                   "transport", "connector", "plugins")


class _Origin:
    """Says where a key came from: the file, or a ``--set`` override."""

    def __init__(self, source: str, overridden: set[str]):
        self.source = source
        self.overridden = overridden

    def of(self, table: str, key: str | None = None) -> str:
        """Where a key came from; for a whole table (a check across its keys), the file and any of its keys set
        by ``--set``."""
        if key is None:
            return table_source(self.source, self.overridden, table)
        dotted = f"{table}.{key}"
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
                        ("transport", config.transport), ("connector", [config.connector])):
        for spec in specs:
            options = _plugin_options(registry, kind, spec.plugin, config.source, kind)
            spec.options = msgspec.convert(spec.options or {}, options)
    config._registry = registry
    return config


def _plugin_options(registry: PluginRegistry, kind: str, name: str, origin: str, table: str) -> type[msgspec.Struct]:
    """The Options plugin ``name`` declares (its class is not imported); a ConfigError listing what is installed
    when there is no such plugin."""
    try:
        return registry.declaration(kind, name).options
    except KeyError as e:
        hint = ""
        if kind == "quant" and name.lower().replace("_", "-") in HF_QUANT_FORMATS:
            hint = ("; checkpoints quantized with AWQ, GPTQ or compressed-tensors are served by plugin = 'auto', "
                    "which reads their quantization_config")
        raise ConfigError(f"{origin}: [{table}] plugin = {name!r}: {e.args[0]}{hint}") from None


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
            node = node[_entry_index(node, part, dotted, ".".join(parts[:i]))]
        else:
            node = node.setdefault(part, {})
        if not isinstance(node, (dict, list)):
            raise ConfigError(f"--set {dotted}: {'.'.join(parts[: i + 1])} is not a table")
    if isinstance(node, list):
        raise ConfigError(f"--set {dotted}: name an entry of the list, e.g. transport.0.port")
    node[parts[-1]] = _parse_value(value)


def _entry_index(entries: list[Any], part: str, dotted: str, table: str) -> int:
    """The entry of a list of tables that ``part`` of an override names: by index, or by plugin name (the first
    entry with that plugin: ``transport.http.port``)."""
    if part.isdigit() and int(part) < len(entries):
        return int(part)
    plugins = [entry.get("plugin") if isinstance(entry, dict) else None for entry in entries]
    if not part.isdigit() and part in plugins:
        return plugins.index(part)
    have = ", ".join(f"{i} ({p})" if p else str(i) for i, p in enumerate(plugins)) or "none"
    raise ConfigError(f"--set {dotted}: {table} has {len(entries)} {'entry' if len(entries) == 1 else 'entries'}: "
                      f"{have}; name one by index or by plugin ({table}.http.port), or add a [[{table}]] table to "
                      "a config file")


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
    _check_async_scheduling(tables, origin)
    config = Config(**tables, **specs, plugins=list(plugins), source=origin.source,
                    overridden=sorted(origin.overridden))
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


def _check_async_scheduling(tables: dict[str, Any], origin: _Origin) -> None:
    """Pipeline stages overlap their steps already; a step's sampled token is the next step's input on the
    stage that sampled it, the last, while the first stage takes it in."""
    engine, parallel = tables["engine"], tables["parallel"]
    if engine.async_scheduling == "on" and parallel.pipeline_parallel_size > 1:
        raise ConfigError(f"{origin.of('parallel', 'pipeline_parallel_size')}: [parallel] pipeline_parallel_size = "
                          f"{parallel.pipeline_parallel_size} cannot run with [engine] async_scheduling = 'on' "
                          "(pipeline stages overlap their steps already); allowed with it: 1, or "
                          "async_scheduling = 'auto' or 'off'")


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
        raise ConfigError(f"{origin.of(where)}: [{where}] needs plugin = \"name\"; installed: "
                          f"{', '.join(registry.names(kind))}")
    if not isinstance(name, str):
        raise ConfigError(f"{origin.of(where, 'plugin')}: [{where}] plugin must be a string")
    struct = _plugin_options(registry, kind, name, origin.of(where, "plugin"), where)
    return PluginSpec(name, convert_table(options, struct, where, origin.of))


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
    """What went wrong with a value, in words, e.g. "allowed: 'a', 'b'"; inside a value (a list of tables), where,
    and for an unknown key the keys allowed there."""
    if typing.get_origin(tp) is Literal:
        return "allowed: " + ", ".join(repr(v) for v in typing.get_args(tp))
    message, _, at = str(error).partition(" - at ")
    path = at.strip("`").removeprefix("$")
    if not path:
        return message
    inner = _type_at(tp, path)
    if message.startswith("Object contains unknown field") and isinstance(inner, type) and issubclass(
            inner, msgspec.Struct):
        message += "; allowed: " + ", ".join(f.encode_name for f in msgspec.structs.fields(inner))
    return f"at {path}: {message}"


def _type_at(tp: Any, path: str) -> Any:
    """The type of the part of a value of type ``tp`` at a msgspec error path (``[0].name``); None if unknown."""
    for index, name in re.findall(r"\[(\d+)\]|\.(\w+)", path):
        members = [t for t in typing.get_args(tp) if t is not type(None)] if typing.get_origin(tp) in (
            typing.Union, types.UnionType) else [tp]
        tp = members[0] if len(members) == 1 else None
        if index and typing.get_origin(tp) in (list, tuple):
            tp = typing.get_args(tp)[0]
        elif name and isinstance(tp, type) and issubclass(tp, msgspec.Struct):
            tp = next((f.type for f in msgspec.structs.fields(tp) if f.encode_name == name), None)
        else:
            return None
    return tp
