"""The plugin registry: built-ins, entry points and TOML-listed modules.

Load order follows pytest and tox: blocked names first, then the entry
points of group ``conveyor``, then the built-in plugin modules (the
``declarations`` module of each package under ``conveyor.plugins``, ordinary
hookimpl modules), then the modules named in the config's ``plugins = [...]``
list. Each registration hook is called once and the declarations it registers
are kept by kind and name; a plugin's class is imported the first time a
process asks for it (``get``, ``build``), so that the frontend checks a config
without importing the engine's and the workers' code.
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
from conveyor.hookspecs import Declaration

if TYPE_CHECKING:
    from conveyor.config import Config, PluginSpec

DEFAULT_PLUGINS: tuple[str, ...] = (
    "conveyor.plugins.quant.declarations",
    "conveyor.plugins.kvcache.declarations",
    "conveyor.plugins.schedulers.declarations",
    "conveyor.plugins.transport.declarations",
    "conveyor.plugins.connector.declarations",
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

# kind -> the base class its plugins subclass (imported when a plugin's class is)
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
    """Every plugin Conveyor can select, by kind and name: its declaration, and its class once asked for."""

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
        self.declarations: dict[str, dict[str, Declaration]] = {kind: {} for kind in KIND_HOOKS}
        self.origins: dict[tuple[str, str], str] = {}
        # (kind, name) -> the class, once imported (or registered itself)
        self.classes: dict[tuple[str, str], type[Any]] = {}
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
        def register(plugin: Declaration | type[Any]) -> None:
            cls = plugin if isinstance(plugin, type) else None
            if cls is not None:
                if not _is_plugin_class(kind, cls):
                    raise PluginError(f"{origin}: {_dotted(cls)} is registered as a {KIND_NOUNS[kind]} but is not "
                                      f"a subclass of {_base_name(kind)}")
                plugin = _declaration_of(cls)
            if not isinstance(plugin, Declaration):
                raise PluginError(f"{origin}: registers {plugin!r} as a {KIND_NOUNS[kind]}; expected a "
                                  "conveyor.hookspecs.Declaration (or a class)")
            _check_declaration(kind, plugin, origin)
            known = self.declarations[kind].get(plugin.name)
            if known is not None and known.target != plugin.target:
                raise PluginError(
                    f"{origin}: {kind} {plugin.name!r} is already registered by {self.origins[kind, plugin.name]}"
                )
            self.declarations[kind][plugin.name] = plugin
            self.origins[kind, plugin.name] = origin
            if cls is not None:
                self.classes[kind, plugin.name] = cls

        return register

    def build(self, kind: str, spec: PluginSpec, *args: Any) -> Any:
        """An instance of the plugin ``spec`` selects: ``cls(options, *args)`` (default options if none)."""
        cls = self.get(kind, spec.plugin)
        return cls(spec.options if spec.options is not None else cls.Options(), *args)

    def names(self, kind: str) -> list[str]:
        return sorted(self.declarations[kind])

    def declaration(self, kind: str, name: str) -> Declaration:
        """What plugin ``name`` declared (its options, summary and target), without importing its class.

        Raises:
            KeyError: with a message listing the installed plugins of that kind.
        """
        try:
            return self.declarations[kind][name]
        except KeyError:
            installed = ", ".join(repr(n) for n in self.names(kind)) or "none"
            raise KeyError(
                f"{KIND_NOUNS[kind]} {name!r} is not available (plugin may not be installed); "
                f"installed: {installed}"
            ) from None

    def get(self, kind: str, name: str) -> type[Any]:
        """The class of plugin ``name``, imported here the first time it is asked for.

        Raises:
            KeyError: no such plugin (the message lists the installed plugins of that kind).
            PluginError: its target cannot be imported, is not a subclass of the kind's base class, or its
                ``name`` or ``Options`` are not the declared ones.
        """
        declared = self.declaration(kind, name)
        cls = self.classes.get((kind, name))
        if cls is None:
            cls = self.classes[kind, name] = _load(kind, declared, self.origins[kind, name])
        return cls

    def describe(self) -> str:
        """Every installed plugin by kind, with its options and their defaults.

        A quant method's stored formats are its class's, so this imports each plugin (and says so where one
        cannot be imported)."""
        lines: list[str] = []
        for kind in KIND_HOOKS:
            lines.append(f"{KIND_NOUNS[kind]}s:")
            if not self.declarations[kind]:
                lines.append("  (none installed)")
            for name in self.names(kind):
                declared = self.declarations[kind][name]
                summary = f" — {declared.summary}" if declared.summary else ""
                lines.append(f"  {name}  [{self.origins[kind, name]}]{summary}")
                try:
                    formats = sorted(getattr(self.get(kind, name), "packed_formats", ()))
                except PluginError as e:
                    lines.append(f"      cannot be loaded: {e}")
                    formats = []
                if formats:
                    lines.append(f"      keeps checkpoints' {', '.join(formats)} weights as stored")
                for field in msgspec.structs.fields(declared.options):
                    lines.append(f"      {field.encode_name} = {_default(field)}  ({_type_name(field.type)})")
        return "\n".join(lines)


def _dotted(cls: type[Any]) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _declaration_of(cls: type[Any]) -> Declaration:
    """A class registered itself: its ``name``, its ``Options``, and its docstring's first paragraph."""
    summary = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
    return Declaration(getattr(cls, "name", None), getattr(cls, "Options", None),
                       f"{cls.__module__}:{cls.__qualname__}", summary)


def _check_declaration(kind: str, declared: Declaration, origin: str) -> None:
    name = declared.name
    if not isinstance(name, str) or not name:
        raise PluginError(f"{origin}: {declared.target} registered as a {kind} has no `name`")
    if not (isinstance(declared.options, type) and issubclass(declared.options, msgspec.Struct)):
        raise PluginError(f"{origin}: {kind} {name!r} needs an `Options` msgspec.Struct class")
    module_name, colon, class_name = declared.target.partition(":")
    if not (module_name and colon and class_name):
        raise PluginError(f"{origin}: {kind} {name!r} has target {declared.target!r}; expected "
                          "\"package.module:Class\"")


def _is_plugin_class(kind: str, cls: Any) -> bool:
    module_name, base_name = KIND_BASES[kind]
    return isinstance(cls, type) and issubclass(cls, getattr(importlib.import_module(module_name), base_name))


def _base_name(kind: str) -> str:
    return ".".join(KIND_BASES[kind])


def _load(kind: str, declared: Declaration, origin: str) -> type[Any]:
    """The class a declaration names, imported now and checked against it."""
    plugin = f"{origin}: {KIND_NOUNS[kind]} {declared.name!r} ({declared.target})"
    module_name, _, qualname = declared.target.partition(":")
    try:
        found: Any = importlib.import_module(module_name)
        for attribute in qualname.split("."):
            found = getattr(found, attribute)
    except Exception as e:  # (an import may fail in any way: a missing library, a module that raises)
        raise PluginError(f"{plugin} cannot be imported: {e}") from e
    if not _is_plugin_class(kind, found):
        raise PluginError(f"{plugin} is not a subclass of {_base_name(kind)}")
    if getattr(found, "Options", None) is not declared.options:
        raise PluginError(f"{plugin}: its Options is {getattr(found, 'Options', None)!r}, not the declared "
                          f"{_dotted(declared.options)}")
    if getattr(found, "name", None) != declared.name:
        raise PluginError(f"{plugin}: its name is {getattr(found, 'name', None)!r}, not the declared "
                          f"{declared.name!r}")
    return found


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
