"""The plugin registry: built-ins, TOML-listed modules, entry points, clear errors."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest

from conveyor import hookspecs
from conveyor.config import load_config
from conveyor.registry import KIND_HOOKS, PluginError, PluginRegistry

TESTS = Path(__file__).parent


def test_builtins_register_through_the_public_hooks():
    registry = PluginRegistry(load_entry_points=False)
    assert registry.get("scheduler", "continuous").__module__ == "conveyor.plugins.schedulers.continuous"
    assert registry.get("kvcache", "paged").__module__ == "conveyor.plugins.kvcache.paged"
    assert registry.get("quant", "none").__module__ == "conveyor.plugins.quant.none"


def test_unknown_name_lists_what_is_installed():
    registry = PluginRegistry(load_entry_points=False)
    with pytest.raises(KeyError, match=r"quant method 'int3' is not available .* installed: 'auto', 'fp8', 'gguf', 'int4', 'int8', 'none'"):
        registry.get("quant", "int3")


def _module(tmp_path, monkeypatch, name: str, body: str) -> str:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


LOCAL_PLUGIN = """
    import msgspec
    from conveyor.hookspecs import hookimpl
    from conveyor.plugins.quant.none import NoQuant

    class Opts(msgspec.Struct, forbid_unknown_fields=True):
        scale: float = 1.0
        levels: list[int] = msgspec.field(default_factory=lambda: [2, 4])

    class Scaled(NoQuant):
        '''A local test quant method.'''
        name = "scaled"
        Options = Opts

    @hookimpl
    def conveyor_register_quant_methods(register):
        register(Scaled)
"""


def test_toml_plugins_list_loads_a_local_module(tmp_path, monkeypatch):
    _module(tmp_path, monkeypatch, "local_quant_plugin", LOCAL_PLUGIN)
    config_file = tmp_path / "c.toml"
    config_file.write_text('plugins = ["local_quant_plugin"]\n[quant]\nplugin = "scaled"\nscale = 2.5\n')
    config = load_config(config_file)
    assert config.quant.plugin == "scaled" and config.quant.options.scale == 2.5
    bad = tmp_path / "bad.toml"
    bad.write_text('plugins = ["local_quant_plugin"]\n[quant]\nplugin = "scaled"\nscale = "big"\n')
    with pytest.raises(ValueError, match=r"\[quant\] scale = 'big': Expected `float`, got `str`"):
        load_config(bad)


def test_duplicate_names_are_an_error(tmp_path, monkeypatch):
    body = """
        from conveyor.hookspecs import hookimpl
        from conveyor.plugins.quant.none import NoQuant

        class Again(NoQuant):
            name = "none"

        @hookimpl
        def conveyor_register_quant_methods(register):
            register(Again)
    """
    _module(tmp_path, monkeypatch, "dup_quant_plugin", body)
    with pytest.raises(PluginError, match="quant 'none' is already registered by conveyor.plugins.quant.none"):
        PluginRegistry(modules=["dup_quant_plugin"], load_entry_points=False)


def test_a_class_without_options_is_refused(tmp_path, monkeypatch):
    body = """
        from conveyor.hookspecs import hookimpl
        from conveyor.scheduler import Scheduler

        class Bare(Scheduler):
            name = "bare"
            Options = dict

        @hookimpl
        def conveyor_register_schedulers(register):
            register(Bare)
    """
    _module(tmp_path, monkeypatch, "bare_plugin", body)
    with pytest.raises(PluginError, match="scheduler 'bare' needs an `Options` msgspec.Struct"):
        PluginRegistry(modules=["bare_plugin"], load_entry_points=False)


def test_blocked_builtin_is_not_loaded():
    registry = PluginRegistry(blocked=["conveyor.plugins.quant.none"], load_entry_points=False)
    assert registry.names("quant") == ["auto", "fp8", "gguf", "int4", "int8"]


def test_describe_lists_options_with_defaults_and_types():
    text = PluginRegistry(load_entry_points=False).describe()
    assert "max_num_batched_tokens = 256  (int >= 1)" in text
    assert "policy = 'fcfs'  ('fcfs' | 'priority')" in text
    assert "  http  [conveyor.plugins.transport.http]" in text
    assert "port = 8000  (int >= 0 and <= 65535)" in text


def test_describe_shows_the_defaults_a_config_that_sets_nothing_gets(tmp_path, monkeypatch):
    """Each option's default is the value of the options a config that sets nothing gets (msgspec's own
    conversion), a default_factory's included (the continuous scheduler's slo_classes = []); a required option
    says so, unquoted."""
    tabled = LOCAL_PLUGIN.replace('"scaled"', '"tabled"').replace("scale: float", "table: str\n        scale: float")
    modules = [_module(tmp_path, monkeypatch, "local_quant_plugin", LOCAL_PLUGIN),
               _module(tmp_path, monkeypatch, "tabled_quant_plugin", tabled)]
    registry = PluginRegistry(modules=modules, load_entry_points=False)
    text = registry.describe()
    assert "      levels = [2, 4]  (list[int])\n" in text and "      table = (required)  (str)\n" in text
    for kind in KIND_HOOKS:
        for name in [n for n in registry.names(kind) if n != "tabled"]:
            defaults = msgspec.convert({}, registry.get(kind, name).Options)
            for key, value in msgspec.structs.asdict(defaults).items():
                assert f"      {key} = {value!r}  (" in text, (kind, name, key)
    assert "      slo_classes = []  (" in text


def test_every_hook_is_documented_and_tested():
    """datasette's meta-test: each hookspec has a docstring and a test that names it."""
    hooks = [name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("conveyor_")]
    assert sorted(hooks) == sorted(KIND_HOOKS.values())
    plugin_guide = (TESTS.parent / "docs" / "plugins.md").read_text()
    for name in hooks:
        assert inspect.getdoc(getattr(hookspecs, name)), f"{name} has no docstring"
        assert name in plugin_guide, f"{name} is missing from docs/plugins.md"
        assert name in HOOK_PLUGINS, f"no test registers a plugin through {name}"


HOOK_PLUGINS = {
    "conveyor_register_schedulers": ("scheduler", "conveyor.plugins.schedulers.continuous", "ContinuousScheduler"),
    "conveyor_register_kvcaches": ("kvcache", "conveyor.plugins.kvcache.paged", "PagedKVCache"),
    "conveyor_register_quant_methods": ("quant", "conveyor.plugins.quant.none", "NoQuant"),
    "conveyor_register_transports": ("transport", "conveyor.transport", "Transport"),
    "conveyor_register_connectors": ("connector", "conveyor.plugins.connector.tiers", "TieredConnector"),
}


@pytest.mark.parametrize("hook", sorted(HOOK_PLUGINS))
def test_each_hook_registers_a_local_plugin_that_toml_can_select(hook, tmp_path, monkeypatch):
    kind, module, base = HOOK_PLUGINS[hook]
    body = f"""
        import msgspec
        from conveyor.hookspecs import hookimpl
        from {module} import {base}

        class Opts(msgspec.Struct, forbid_unknown_fields=True):
            level: int = 1

        class Mine({base}):
            '''A local {kind}.'''
            name = "mine"
            Options = Opts

            async def serve(self, engine, *, task_status=None):
                pass

        @hookimpl
        def {hook}(register):
            register(Mine)
    """
    module_name = _module(tmp_path, monkeypatch, f"hook_test_{kind}_plugin", body)
    registry = PluginRegistry(modules=[module_name], load_entry_points=False)
    assert registry.names(kind).count("mine") == 1
    table = "[[transport]]" if kind == "transport" else f"[{kind}]"
    config_file = tmp_path / "c.toml"
    config_file.write_text(f'plugins = ["{module_name}"]\n{table}\nplugin = "mine"\nlevel = 3\n')
    config = load_config(config_file)
    spec = config.transport[0] if kind == "transport" else getattr(config, kind)
    assert (spec.plugin, spec.options.level) == ("mine", 3)


WRONG_KIND = """
    from conveyor.hookspecs import hookimpl
    from conveyor.scheduler import Scheduler

    class Misfiled(Scheduler):
        '''A scheduler, registered as a KV cache by mistake.'''
        name = "misfiled"

    @hookimpl
    def conveyor_register_kvcaches(register):
        register(Misfiled)
"""


def test_a_class_registered_under_the_wrong_kind_stops_the_server_at_start_with_one_line(tmp_path):
    (tmp_path / "wrong_kind_plugin.py").write_text(textwrap.dedent(WRONG_KIND))
    config = tmp_path / "serve.toml"
    config.write_text('plugins = ["wrong_kind_plugin"]\n[[transport]]\nplugin = "http"\nport = 0\n')
    result = subprocess.run(
        [sys.executable, "-m", "conveyor", "serve", str(config)], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(tmp_path)}, check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        (
            "error: wrong_kind_plugin: wrong_kind_plugin.Misfiled is registered as a KV cache but is not a "
            "subclass of conveyor.kvcache.KVCacheManager"
        )
    ]


def test_the_registry_that_validated_a_config_is_the_one_used_after(monkeypatch):
    config = load_config()
    built = []
    original = PluginRegistry.__init__

    def counting(self, *args, **kwargs):
        built.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(PluginRegistry, "__init__", counting)
    first = PluginRegistry.of(config)
    assert PluginRegistry.of(config) is first and not built
    from conveyor.config import decode_config, encode_config

    decoded = decode_config(encode_config(config))  # another process's view: one registry, built once
    assert len(built) == 1 and PluginRegistry.of(decoded) is built[0]
