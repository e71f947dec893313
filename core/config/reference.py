"""The configuration reference (docs/configuration.md), written from the config structs and the built-in plugins'
``Options``: every key with its type, allowed values, default and the comment above it in the source, the one
place a key is documented. ``python -m conveyor.config.reference`` prints it; ``make docs`` writes it.
"""

from __future__ import annotations

import inspect
import re
import sys
from typing import Any

import msgspec

from conveyor.config.schema import (
    PLUGIN_KINDS,
    BatchConfig,
    EngineConfig,
    LoraConfig,
    ModelConfig,
    ParallelConfig,
    ServerConfig,
)
from conveyor.registry import PluginRegistry, _type_name

CORE_TABLES: dict[str, type[msgspec.Struct]] = {
    "model": ModelConfig, "engine": EngineConfig, "parallel": ParallelConfig, "server": ServerConfig,
    "lora": LoraConfig, "batch": BatchConfig,
}
_INTRO = """\
<!-- written by `python -m conveyor.config.reference` (make docs) from the config structs and the built-in
plugins' Options: edit the comments in the source, not this page -->

A config is a TOML file (`conveyor serve FILE`; `configs/default.toml` holds every default). Any key can be set on
the command line with `--set table.key=value`, or from Python with `LLM(overrides={"table.key": value})`; a
`[[transport]]` table is named by its index in the list, from 0 (`--set transport.0.port=8001`), or by its plugin,
the first table of that plugin (`--set transport.http.port=8001`); `transport.port` is refused. A wrong key or value
stops at start-up with one line naming the file, the table, the key and what is allowed.

`conveyor serve MODEL` (and `conveyor generate MODEL`) takes a `.gguf` file, a Hugging Face directory or an
installed model's name as `model.path`; a `.toml` positional is a config file, as `--config FILE` is. The flags
below stand for the keys beside them:
"""
_PLUGINS_LIST = """\
Top level: `plugins = ["module", ...]`, extra plugin modules to import (each registers plugins from a pluggy hook;
installed packages are found through the `conveyor` entry-point group without it)."""
_FIELD = re.compile(r"^    (\w+)\s*:")


def field_docs(struct: type[msgspec.Struct]) -> dict[str, str]:
    """Each field's doc line: the comment lines right above it in its class body (``struct`` or a base)."""
    docs: dict[str, str] = {}
    for cls in reversed(struct.__mro__):
        if not (isinstance(cls, type) and issubclass(cls, msgspec.Struct)) or cls is msgspec.Struct:
            continue
        comment: list[str] = []
        for line in inspect.getsource(cls).splitlines()[1:]:
            stripped = line.strip()
            if stripped.startswith("#") and line.startswith("    ") and not line.startswith("     "):
                comment.append(stripped.lstrip("#").strip())
                continue
            match = _FIELD.match(line)
            if match and comment:
                docs[match.group(1)] = " ".join(comment)
            if not stripped.startswith("#"):
                comment = []
    return docs


def undocumented(struct: type[msgspec.Struct]) -> list[str]:
    """The fields of ``struct`` without a doc line."""
    docs = field_docs(struct)
    return [f.name for f in msgspec.structs.fields(struct) if f.name not in docs]


def _default(field: msgspec.structs.FieldInfo) -> str:
    if field.default is not msgspec.NODEFAULT:
        value = field.default
    elif field.default_factory is not msgspec.NODEFAULT:
        value = field.default_factory()
    else:
        return "(required)"
    return f"`{_toml(value)}`"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _cell(text: str) -> str:
    """Text as a Markdown table cell shows it."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")


def _table(struct: type[msgspec.Struct], skip: tuple[str, ...] = ()) -> list[str]:
    docs = field_docs(struct)
    rows = ["| key | type and allowed values | default | what it does |", "|---|---|---|---|"]
    for field in msgspec.structs.fields(struct):
        if field.name in skip:
            continue
        kind = _cell(_type_name(field.type))
        rows.append(f"| `{field.encode_name}` | {kind} | {_default(field)} | {_cell(docs.get(field.name, ''))} |")
    return rows


def reference_markdown(registry: PluginRegistry | None = None) -> str:
    """The reference page, for the plugins ``registry`` holds (the built-in ones by default)."""
    registry = registry or PluginRegistry()
    from conveyor.config.shortcuts import SHORTCUTS

    flags = [f"| `--{flag.replace('_', '-')}` | `{key}` |" for flag, key in SHORTCUTS.items()]
    flags.insert(2, "| `--served-model-name NAME [ALIAS ...]` | `model.name`, then `model.aliases` |")
    out = ["# Configuration reference", "", _INTRO, "| flag | key |", "|---|---|", *flags, "", _PLUGINS_LIST, ""]
    for table, struct in CORE_TABLES.items():
        out += [f"## [{table}]", "", *_table(struct), ""]
    for kind, default in PLUGIN_KINDS.items():
        header = f"[[{kind}]]" if default is None else f"[{kind}]"
        chosen = ("one table per transport; none: HTTP on 127.0.0.1:8000" if default is None
                  else f"`plugin = \"{default}\"` when the table names none")
        out += [f"## {header}", "",
                f"`plugin` chooses the {kind} plugin ({chosen}); the table's other keys are that plugin's options.", ""]
        for name in registry.names(kind):
            declared = registry.declaration(kind, name)
            out += [f"### {kind} plugin = \"{name}\"", "", declared.summary, "", *_table(declared.options), ""]
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(reference_markdown())
