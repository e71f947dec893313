"""``none``: no KV connector; the device pool is the only place KV lives (the default)."""

from __future__ import annotations

from conveyor.connector import KVConnector, KVConnectorWorker
from conveyor.plugins.connector.declarations import NoOptions


class NoConnectorWorker(KVConnectorWorker):
    def apply(self, payload: bytes) -> None:
        pass


class NoConnector(KVConnector):
    """No connector: KV lives in the device pool only (the engine does not consult this one)."""

    name = "none"
    Options = NoOptions
    Worker = NoConnectorWorker

    def lookup(self, request, digests: list[bytes]) -> int:
        return 0

    def load(self, digest: bytes, block: int) -> None:
        raise AssertionError("the none connector holds no block")

    def save(self, digest: bytes, block: int) -> None:
        pass

    def take_payload(self) -> bytes:
        return b""
