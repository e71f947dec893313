"""The pluggy hook specifications of Conveyor, and the declaration a plugin registers.

Hooks only register plugins: pluggy is never on the per-step hot path. Each registration hook receives a
``register`` callable; call it once per plugin with a ``Declaration``: its name (what TOML selects with
``plugin = "name"``), its ``Options`` (a ``msgspec.Struct`` of the plugin's own typed options: the other keys of
its TOML table) and where its class is. Every process builds the registry, and the frontend validates a config
from declarations alone; the class is imported where the plugin runs (the engine, a worker, the frontend for a
transport). A class registered itself (``register(MyScheduler)``) is its own declaration: for a plugin whose hook
lives in its implementation's module, which importing the hook imports anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import msgspec

PROJECT = "conveyor"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@dataclass(frozen=True)
class Declaration:
    """A plugin as the registry knows it before its code is imported.

    The module that declares it, and the one ``options`` comes from, should import nothing heavy (no torch):
    the server's frontend process imports them to check a config.
    """

    # what a config selects it by: plugin = "name" (the class's ``name`` must be the same)
    name: str
    # the Struct its TOML table is validated against (the class's ``Options`` must be this one)
    options: type[msgspec.Struct]
    # "package.module:Class", imported where the plugin runs
    target: str
    # one line for ``conveyor plugins`` and the configuration reference
    summary: str = ""


Register = Callable[[Declaration | type[Any]], None]


@hookspec
def conveyor_register_schedulers(register: Register) -> None:
    """Register schedulers (their classes subclass ``conveyor.scheduler.Scheduler``)."""


@hookspec
def conveyor_register_kvcaches(register: Register) -> None:
    """Register KV cache managers (their classes subclass ``conveyor.kvcache.KVCacheManager``)."""


@hookspec
def conveyor_register_quant_methods(register: Register) -> None:
    """Register quantization methods (their classes subclass ``conveyor.quant.QuantMethod``)."""


@hookspec
def conveyor_register_transports(register: Register) -> None:
    """Register transports (their classes subclass ``conveyor.transport.Transport``)."""


@hookspec
def conveyor_register_connectors(register: Register) -> None:
    """Register KV connectors (their classes subclass ``conveyor.connector.KVConnector``)."""
