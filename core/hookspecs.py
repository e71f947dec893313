"""The pluggy hook specifications of Conveyor.

Hooks only register classes: pluggy is never on the per-step hot path. Each
registration hook receives a ``register`` callable; call it once per class.
A registered class has a class attribute ``name`` (what TOML selects with
``plugin = "name"``) and a class attribute ``Options``, a ``msgspec.Struct``
holding the plugin's own typed options (the other keys of its TOML table).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

PROJECT = "conveyor"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

Register = Callable[[type[Any]], None]


@hookspec
def conveyor_register_schedulers(register: Register) -> None:
    """Register scheduler classes (subclasses of ``conveyor.scheduler.Scheduler``)."""


@hookspec
def conveyor_register_kvcaches(register: Register) -> None:
    """Register KV cache managers (subclasses of ``conveyor.kvcache.KVCacheManager``)."""


@hookspec
def conveyor_register_quant_methods(register: Register) -> None:
    """Register quantization methods (subclasses of ``conveyor.quant.QuantMethod``)."""


@hookspec
def conveyor_register_transports(register: Register) -> None:
    """Register transports (subclasses of ``conveyor.transport.Transport``)."""


@hookspec
def conveyor_register_connectors(register: Register) -> None:
    """Register KV connectors (subclasses of ``conveyor.connector.KVConnector``)."""
