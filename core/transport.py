"""The transport interface (plugin kind ``transport``).

A transport lets clients reach the engine: it accepts their requests in its
own protocol (HTTP, ZeroMQ, ...), submits them to the engine client it is
given, and streams the outputs back. Several transports can serve at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import anyio
import msgspec


class Transport(ABC):
    """Serves clients in one protocol."""

    name: ClassVar[str]
    Options: ClassVar[type[msgspec.Struct]]

    def __init__(self, options: msgspec.Struct):
        self.options = options

    @abstractmethod
    async def serve(self, engine: Any, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled.

        Args:
            engine: the engine client requests are submitted to.
            task_status: ``task_status.started(address)`` once accepting connections.
        """
