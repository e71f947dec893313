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

from conveyor.config.loading import decode_config, encode_config, load_config, parse_override
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
)

__all__ = [
    "PLUGIN_KINDS",
    "BatchConfig",
    "Config",
    "ConfigError",
    "EngineConfig",
    "LoraConfig",
    "ModelConfig",
    "ParallelConfig",
    "PluginSpec",
    "ServerConfig",
    "decode_config",
    "encode_config",
    "load_config",
    "parse_override",
]
