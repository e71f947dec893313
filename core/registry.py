"""The plugin registry: built-ins, entry points and TOML-listed modules.

Load order follows pytest and tox: blocked names first, then the entry
points of group ``conveyor``, then the built-in plugin modules (ordinary
hookimpl modules under ``conveyor.plugins``), then the modules named in the
config's ``plugins = [...]`` list. Each registration hook is called once and
the classes it registers are kept by kind and name.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
import pluggy

from conveyor import hookspecs

if TYPE_CHECKING:
    from conveyor.config import Config, PluginSpec

DEFAULT_PLUGINS: tuple[str, ...] = (
    "conveyor.plugins.quant.none",
    "conveyor.plugins.quant.int8",
    "conveyor.plugins.quant.int4",
    "conveyor.plugins.quant.fp8",
    "conveyor.plugins.quant.gguf",
    "conveyor.plugins.kvcache.paged",
    "conveyor.plugins.kvcache.contiguous",
    "conveyor.plugins.schedulers.continuous",
    "conveyor.plugins.schedulers.static",
    "conveyor.plugins.schedulers.dynamic",
    "conveyor.plugins.transport.http",
    "conveyor.plugins.transport.zmq",
    "conveyor.plugins.connector.none",
    "conveyor.plugins.connector.tiers",
)

# kind -> registration hook name
KIND_HOOKS: dict[str, str] = {
    "scheduler": "conveyor_register_schedulers",
    "kvcache": "conveyor_register_kvcaches",
    "quant": "conveyor_register_quant_methods",
    "transport": "conveyor_register_transports",
    "connector": "conveyor_register_connectors",
}

KIND_NOUNS = {"scheduler": "scheduler", "kvcache": "KV cache", "quant": "quant method", "transport": "transport",
              "connector": "KV connector"}

# kind -> the base class its plugins subclass (imported when a plugin registers)
KIND_BASES: dict[str, tuple[str, str]] = {
    "scheduler": ("conveyor.scheduler", "Scheduler"),
    "kvcache": ("conveyor.kvcache", "KVCacheManager"),
    "quant": ("conveyor.quant", "QuantMethod"),
    "transport": ("conveyor.transport", "Transport"),
    "connector": ("conveyor.connector", "KVConnector"),
}


class PluginError(RuntimeError):
    """A plugin could not be loaded or registers something malformed."""


class PluginRegistry:
    """Every plugin class Conveyor can select, by kind and name."""

    def __init__(
        self,
        modules: Iterable[str] = (),
        blocked: Iterable[str] = (),
        load_entry_points: bool = True,
        source: str = "<config>",
    ):
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        for name in blocked:
            self.pm.set_blocked(name)
        if load_entry_points:
            self.pm.load_setuptools_entrypoints(hookspecs.PROJECT)
        for module_name in DEFAULT_PLUGINS:
            if not self.pm.is_blocked(module_name):
                self.pm.register(importlib.import_module(module_name), module_name)
        for module_name in modules:
            module = _import_listed(module_name, source)
            if self.pm.get_plugin(module_name) is None:
                self.pm.register(module, module_name)
        self.pm.check_pending()
        self.classes: dict[str, dict[str, type[Any]]] = {kind: {} for kind in KIND_HOOKS}
        self.origins: dict[tuple[str, str], str] = {}
        for kind, hook_name in KIND_HOOKS.items():
            hook = getattr(self.pm.hook, hook_name)
            for impl in hook.get_hookimpls():
                impl.function(register=self._registrar(kind, self._origin(impl.plugin_name)))

    def _origin(self, plugin_name: str) -> str:
        dist = {plugin: d for plugin, d in self.pm.list_plugin_distinfo()}.get(self.pm.get_plugin(plugin_name))
        return f"{dist.project_name} {dist.version}" if dist else plugin_name

    @classmethod
    def of(cls, config: Config) -> PluginRegistry:
        """The registry that validated ``config`` (built from its ``plugins`` list if it has none yet)."""
        registry = getattr(config, "_registry", None)
        if registry is None:
            registry = config._registry = cls(config.plugins, source=config.source)
        return registry

    def _registrar(self, kind: str, origin: str):
        module_name, base_name = KIND_BASES[kind]

        def register(cls: type[Any]) -> None:
            base = getattr(importlib.import_module(module_name), base_name)
            if not (isinstance(cls, type) and issubclass(cls, base)):
                what = f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else repr(cls)
                raise PluginError(
                    f"{origin}: {what} is registered as a {KIND_NOUNS[kind]} but is not a subclass of "
                    f"{module_name}.{base_name}"
                )
            name = getattr(cls, "name", None)
            if not isinstance(name, str) or not name:
                raise PluginError(f"{origin}: {cls!r} registered as a {kind} has no `name`")
            options = getattr(cls, "Options", None)
            if not (isinstance(options, type) and issubclass(options, msgspec.Struct)):
                raise PluginError(f"{origin}: {kind} {name!r} needs an `Options` msgspec.Struct class")
            if name in self.classes[kind] and self.classes[kind][name] is not cls:
                raise PluginError(
                    f"{origin}: {kind} {name!r} is already registered by {self.origins[kind, name]}"
                )
            self.classes[kind][name] = cls
            self.origins[kind, name] = origin

        return register

    def build(self, kind: str, spec: PluginSpec, *args: Any) -> Any:
        """An instance of the plugin ``spec`` selects: ``cls(options, *args)`` (default options if none)."""
        cls = self.get(kind, spec.plugin)
        return cls(spec.options if spec.options is not None else cls.Options(), *args)

    def names(self, kind: str) -> list[str]:
        return sorted(self.classes[kind])

    def get(self, kind: str, name: str) -> type[Any]:
        """The class registered as ``name``.

        Raises:
            KeyError: with a message listing the installed plugins of that kind.
        """
        try:
            return self.classes[kind][name]
        except KeyError:
            installed = ", ".join(repr(n) for n in self.names(kind)) or "none"
            raise KeyError(
                f"{KIND_NOUNS[kind]} {name!r} is not available (plugin may not be installed); "
                f"installed: {installed}"
            ) from None

    def describe(self) -> str:
        """Every installed plugin by kind, with its options and their defaults."""
        lines: list[str] = []
        for kind in KIND_HOOKS:
            lines.append(f"{KIND_NOUNS[kind]}s:")
            if not self.classes[kind]:
                lines.append("  (none installed)")
            for name in self.names(kind):
                cls = self.classes[kind][name]
                doc = (cls.__doc__ or "").strip().splitlines()
                summary = f" — {doc[0]}" if doc else ""
                lines.append(f"  {name}  [{self.origins[kind, name]}]{summary}")
                if formats := sorted(getattr(cls, "packed_formats", ())):  # (a quant method's stored formats)
                    lines.append(f"      keeps checkpoints' {', '.join(formats)} weights as stored")
                for field in msgspec.structs.fields(cls.Options):
                    lines.append(f"      {field.encode_name} = {_default(field)}  ({_type_name(field.type)})")
        return "\n".join(lines)


def _import_listed(module_name: str, source: str) -> Any:
    """A module the config's ``plugins`` list names: from sys.path, else from the config file's folder.

    Raises:
        PluginError: it cannot be imported (naming where it was looked for).
    """
    folder = Path(source).resolve().parent if Path(source).is_file() else None
    top = module_name.split(".")[0]
    if folder is not None and str(folder) not in sys.path and importlib.util.find_spec(top) is None \
            and ((folder / f"{top}.py").is_file() or (folder / top).is_dir()):
        sys.path.append(str(folder))
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        where = f"on sys.path and beside the config in {folder}" if folder is not None else "on sys.path"
        raise PluginError(f"{source}: plugins = [{module_name!r}] cannot be imported: {e} (looked for {where}; "
                          "install the package, or set PYTHONPATH)") from None


def _default(field: msgspec.structs.FieldInfo) -> str:
    """An option's default as Python writes it (a ``default_factory``'s value, e.g. ``[]``), or ``(required)``."""
    if field.default is not msgspec.NODEFAULT:
        return repr(field.default)
    if field.default_factory is not msgspec.NODEFAULT:
        return repr(field.default_factory())
    return "(required)"


def _type_name(tp: Any) -> str:
    """A type as a reader would write it: ``int >= 1``, ``'fcfs' | 'priority'``."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(v) for v in typing.get_args(tp))
    if origin is Annotated:
        base, *extras = typing.get_args(tp)
        bounds = [
            f"{symbol} {getattr(meta, attr)}"
            for meta in extras
            if isinstance(meta, msgspec.Meta)
            for attr, symbol in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
            if getattr(meta, attr) is not None
        ]
        return " ".join([_type_name(base), " and ".join(bounds)]).strip()
    if isinstance(tp, type):
        return tp.__name__
    return repr(tp).replace("typing.", "")
