"""The plugin registry: built-ins, TOML-listed modules, entry points, clear errors."""

from __future__ import annotations

import inspect
import os
import re
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
    assert registry.origins["scheduler", "continuous"] == "conveyor.plugins.schedulers.declarations"
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


# a third-party quant method in two modules: the one its hook is in declares it, the other holds its code
LOCAL_DECLARATION = """
    import msgspec
    from conveyor.hookspecs import Declaration, hookimpl

    class Opts(msgspec.Struct, forbid_unknown_fields=True):
        scale: float = 1.0
        levels: list[int] = msgspec.field(default_factory=lambda: [2, 4])

    @hookimpl
    def conveyor_register_quant_methods(register):
        register(Declaration("scaled", Opts, "local_quant_code:Scaled", "A local test quant method."))
"""
LOCAL_CODE = """
    from conveyor.plugins.quant.none import NoQuant
    from local_quant_plugin import Opts

    class Scaled(NoQuant):
        name = "scaled"
        Options = Opts
"""


def test_toml_plugins_list_loads_a_local_module(tmp_path, monkeypatch):
    """A listed module's declaration is enough to check the config; its code is imported when it is asked for."""
    _module(tmp_path, monkeypatch, "local_quant_plugin", LOCAL_DECLARATION)
    _module(tmp_path, monkeypatch, "local_quant_code", LOCAL_CODE)
    monkeypatch.delitem(sys.modules, "local_quant_code", raising=False)
    config_file = tmp_path / "c.toml"
    config_file.write_text('plugins = ["local_quant_plugin"]\n[quant]\nplugin = "scaled"\nscale = 2.5\n')
    config = load_config(config_file)
    assert config.quant.plugin == "scaled" and config.quant.options.scale == 2.5
    assert "local_quant_code" not in sys.modules
    assert PluginRegistry.of(config).get("quant", "scaled").__module__ == "local_quant_code"
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
    with pytest.raises(PluginError,
                       match="quant 'none' is already registered by conveyor.plugins.quant.declarations"):
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
    registry = PluginRegistry(blocked=["conveyor.plugins.quant.declarations"], load_entry_points=False)
    assert registry.names("quant") == [] and registry.names("scheduler") == ["continuous", "dynamic", "static"]


def test_describe_lists_options_with_defaults_and_types():
    text = PluginRegistry(load_entry_points=False).describe()
    assert "max_num_batched_tokens = 256  (int >= 1)" in text
    assert "policy = 'fcfs'  ('fcfs' | 'priority')" in text
    assert "  http  [conveyor.plugins.transport.declarations] — OpenAI-compatible HTTP.\n" in text
    assert "port = 8000  (int >= 0 and <= 65535)" in text
    assert ("  fp8  [conveyor.plugins.quant.declarations] — e4m3 weights; W8A16 or W8A8.\n"
            "      keeps checkpoints' F8_E4M3 weights as stored\n") in text


TABLED = """
    import msgspec
    from conveyor.hookspecs import hookimpl
    from conveyor.plugins.quant.none import NoQuant

    class Opts(msgspec.Struct, forbid_unknown_fields=True):
        table: str

    class Tabled(NoQuant):
        '''A quant method registered as a class,
        with a required option.'''
        name = "tabled"
        Options = Opts

    @hookimpl
    def conveyor_register_quant_methods(register):
        register(Tabled)
"""


def test_describe_shows_the_defaults_a_config_that_sets_nothing_gets(tmp_path, monkeypatch):
    """Each option's default is the value of the options a config that sets nothing gets (msgspec's own
    conversion), a default_factory's included (the continuous scheduler's slo_classes = []); a required option
    says so, unquoted. A class registered itself is summed up by its docstring's first paragraph."""
    modules = [_module(tmp_path, monkeypatch, "local_quant_plugin", LOCAL_DECLARATION),
               _module(tmp_path, monkeypatch, "tabled_quant_plugin", TABLED)]
    _module(tmp_path, monkeypatch, "local_quant_code", LOCAL_CODE)
    registry = PluginRegistry(modules=modules, load_entry_points=False)
    text = registry.describe()
    assert "      levels = [2, 4]  (list[int])\n" in text and "      table = (required)  (str)\n" in text
    assert "  tabled  [tabled_quant_plugin] — A quant method registered as a class, with a required option.\n" in text
    for kind in KIND_HOOKS:
        for name in [n for n in registry.names(kind) if n != "tabled"]:
            defaults = msgspec.convert({}, registry.declaration(kind, name).options)
            for key, value in msgspec.structs.asdict(defaults).items():
                assert f"      {key} = {value!r}  (" in text, (kind, name, key)
    assert "      slo_classes = []  (" in text


# a scheduler declared with a target to fill in
DECLARED_SCHEDULER = """
    from conveyor.hookspecs import Declaration, hookimpl
    from conveyor.scheduler import SchedulerOptions

    class GhostOptions(SchedulerOptions, forbid_unknown_fields=True):
        pass

    @hookimpl
    def conveyor_register_schedulers(register):
        register(Declaration("ghost", GhostOptions, "{target}"))
"""


def test_describe_says_which_plugin_cannot_be_loaded_and_lists_the_rest(tmp_path, monkeypatch):
    body = DECLARED_SCHEDULER.replace("{target}", "no_such_module_xyz:Ghost")
    module = _module(tmp_path, monkeypatch, "ghost_plugin", body)
    text = PluginRegistry(modules=[module], load_entry_points=False).describe()
    assert ("  ghost  [ghost_plugin]\n      cannot be loaded: ghost_plugin: scheduler 'ghost' "
            "(no_such_module_xyz:Ghost) cannot be imported: No module named 'no_such_module_xyz'\n") in text
    assert "  static  [conveyor.plugins.schedulers.declarations]" in text


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
    """A listed module declares a plugin of each kind; a config selects it and sets its option, and the class is
    imported from the other module only when asked for."""
    kind, module, base = HOOK_PLUGINS[hook]
    declaring, code = f"hook_test_{kind}_plugin", f"hook_test_{kind}_code"
    _module(tmp_path, monkeypatch, declaring, f"""
        import msgspec
        from conveyor.hookspecs import Declaration, hookimpl

        class Opts(msgspec.Struct, forbid_unknown_fields=True):
            level: int = 1

        @hookimpl
        def {hook}(register):
            register(Declaration("mine", Opts, "{code}:Mine", "A local {kind}."))
    """)
    _module(tmp_path, monkeypatch, code, f"""
        from {module} import {base}
        from {declaring} import Opts

        class Mine({base}):
            name = "mine"
            Options = Opts

            async def serve(self, engine, *, task_status=None):
                pass
    """)
    monkeypatch.delitem(sys.modules, code, raising=False)
    registry = PluginRegistry(modules=[declaring], load_entry_points=False)
    assert registry.names(kind).count("mine") == 1
    table = "[[transport]]" if kind == "transport" else f"[{kind}]"
    config_file = tmp_path / "c.toml"
    config_file.write_text(f'plugins = ["{declaring}"]\n{table}\nplugin = "mine"\nlevel = 3\n')
    config = load_config(config_file)
    spec = config.transport[0] if kind == "transport" else getattr(config, kind)
    assert (spec.plugin, spec.options.level) == ("mine", 3)
    assert code not in sys.modules
    assert PluginRegistry.of(config).get(kind, "mine").__module__ == code


def test_build_imports_the_declared_class_and_makes_it_with_the_configs_options(tmp_path, monkeypatch):
    _module(tmp_path, monkeypatch, "built_transport_plugin", """
        import msgspec
        from conveyor.hookspecs import Declaration, hookimpl

        class LineOptions(msgspec.Struct, forbid_unknown_fields=True):
            port: int = 1

        @hookimpl
        def conveyor_register_transports(register):
            register(Declaration("lines", LineOptions, "built_transport_code:Lines"))
    """)
    _module(tmp_path, monkeypatch, "built_transport_code", """
        from conveyor.transport import Transport
        from built_transport_plugin import LineOptions

        class Lines(Transport):
            name = "lines"
            Options = LineOptions

            async def serve(self, frontend, *, task_status=None): ...
    """)
    monkeypatch.delitem(sys.modules, "built_transport_code", raising=False)
    (tmp_path / "c.toml").write_text('plugins = ["built_transport_plugin"]\n[[transport]]\nplugin = "lines"\nport = 9')
    config = load_config(tmp_path / "c.toml")
    assert "built_transport_code" not in sys.modules
    transport = PluginRegistry.of(config).build("transport", config.transport[0])
    assert type(transport) is sys.modules["built_transport_code"].Lines and transport.options.port == 9


@pytest.mark.parametrize("target, error", [
    ("no_such_module_xyz:Ghost", r"cannot be imported: No module named 'no_such_module_xyz'"),
    ("collections:Ghost", r"cannot be imported: module 'collections' has no attribute 'Ghost'"),
    ("collections:OrderedDict", r"is not a subclass of conveyor\.scheduler\.Scheduler"),
    ("conveyor.plugins.schedulers.static:StaticScheduler",
     (r"its Options is <class 'conveyor\.plugins\.schedulers\.declarations\.StaticOptions'>, not the declared "
      r"ghost_\w+_plugin\.GhostOptions")),
])
def test_a_declared_class_that_cannot_serve_stops_where_it_is_asked_for_naming_plugin_and_target(
        target, error, tmp_path, monkeypatch):
    """The config is checked from the declaration alone (the frontend never imports the class); the process that
    builds the plugin gets one line naming the module that declared it, the plugin and its target."""
    module = _module(tmp_path, monkeypatch, f"ghost_{abs(hash(target))}_plugin",
                     DECLARED_SCHEDULER.replace("{target}", target))
    (tmp_path / "c.toml").write_text(f'plugins = ["{module}"]\n[scheduler]\nplugin = "ghost"\n')
    config = load_config(tmp_path / "c.toml")
    assert config.scheduler.plugin == "ghost"
    with pytest.raises(PluginError, match=rf"^{module}: scheduler 'ghost' \({re.escape(target)}\):? {error}"):
        PluginRegistry.of(config).get("scheduler", "ghost")


@pytest.mark.parametrize("call, error", [
    ('register(Declaration("ghost", SchedulerOptions, "conveyor.plugins.schedulers.static.StaticScheduler"))',
     (r"scheduler 'ghost' has target 'conveyor\.plugins\.schedulers\.static\.StaticScheduler'; expected "
      r"\"package\.module:Class\"$")),
    ('register("my_sched:Ghost")',
     r"registers 'my_sched:Ghost' as a scheduler; expected a conveyor\.hookspecs\.Declaration \(or a class\)$"),
])
def test_a_registration_that_names_no_module_and_class_is_refused(call, error, tmp_path, monkeypatch):
    module = _module(tmp_path, monkeypatch, f"refused_{abs(hash(call))}_plugin", f"""
        from conveyor.hookspecs import Declaration, hookimpl
        from conveyor.scheduler import SchedulerOptions

        @hookimpl
        def conveyor_register_schedulers(register):
            {call}
    """)
    with pytest.raises(PluginError, match=rf"^{module}: {error}"):
        PluginRegistry(modules=[module], load_entry_points=False)


# run in a fresh interpreter where torch and triton cannot be imported, as in the server's frontend process
CHECK_EVERY_BUILTIN = """
import sys
sys.modules["torch"] = sys.modules["triton"] = None
from conveyor.config import decode_config, encode_config, load_config
from conveyor.registry import KIND_HOOKS, PluginRegistry

registry = PluginRegistry(load_entry_points=False)
code = set()
for kind in KIND_HOOKS:
    for name in registry.names(kind):
        table = "transport.0" if kind == "transport" else kind
        config = load_config(None, {f"{table}.plugin": name}, registry=registry)
        decode_config(encode_config(config), registry)
        code.add(registry.declaration(kind, name).target.partition(":")[0])
print(len(code), sorted(module for module in code if module in sys.modules))
"""


def test_checking_a_config_for_every_builtin_plugin_imports_none_of_their_code():
    result = subprocess.run([sys.executable, "-c", CHECK_EVERY_BUILTIN], capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split(" ", 1) == ["14", "[]\n"]  # (the modules of 15 plugins: auto and gguf share one)


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
