"""``sqlite``: a KV connector that keeps every full KV block in one SQLite file, for Conveyor.

The smallest complete connector: the scheduler side keeps the set of digests the file holds (read once at
start) and lists, for each step, the blocks to save and to load; the worker side runs those statements
before the step's forward pass, and answers the blocks it could not load (a row gone, or of the wrong size:
another process shares the file), which the engine then computes. Blocks are keyed by the engine's
fingerprint, the worker's rank and the block's digest, so one file serves several models, and a server that
starts again finds its blocks.
"""

from __future__ import annotations

import sqlite3

import msgspec

from conveyor.connector import KVConnector, KVConnectorWorker
from conveyor.hookspecs import hookimpl
from conveyor.messages import ConnectorStats

SCHEMA = "CREATE TABLE IF NOT EXISTS blocks (fingerprint TEXT, rank INTEGER, digest BLOB, data BLOB, " \
         "PRIMARY KEY (fingerprint, rank, digest))"


class SqliteOptions(msgspec.Struct, forbid_unknown_fields=True):
    # the database file
    path: str = "conveyor-kv.sqlite"


class SqliteWorker(KVConnectorWorker):
    def __init__(self, options, storage, rank, setup):
        super().__init__(options, storage, rank, setup)
        self.fingerprint = setup.decode()
        self.db = sqlite3.connect(options.path)
        self.db.execute(SCHEMA)
        self.pool = [storage.k, storage.v] + ([storage.k_scale, storage.v_scale] if storage.quantized else [])

    def apply(self, payload: bytes) -> list[int]:
        import torch  # (here, not at the top: the serving process imports this module too, and needs no torch)

        size = self.storage.block_size
        failed = []
        for op, digest, block in msgspec.msgpack.decode(payload, type=list[tuple[str, bytes, int]]):
            views = [t[:, :, block * size : (block + 1) * size] for t in self.pool]
            key = (self.fingerprint, self.rank, digest)
            if op == "save":
                data = b"".join(v.contiguous().view(torch.uint8).numpy().tobytes() for v in views)
                self.db.execute("INSERT OR REPLACE INTO blocks VALUES (?, ?, ?, ?)", (*key, data))
                continue
            row = self.db.execute("SELECT data FROM blocks WHERE fingerprint = ? AND rank = ? AND digest = ?",
                                  key).fetchone()
            if row is None or len(row[0]) != sum(v.numel() * v.element_size() for v in views):
                failed.append(block)  # (the engine computes it instead)
                continue
            offset = 0
            for view in views:
                n = view.numel() * view.element_size()
                chunk = torch.frombuffer(bytearray(row[0][offset : offset + n]), dtype=torch.uint8)
                view.copy_(chunk.view(view.dtype).view(view.shape))
                offset += n
        self.db.commit()
        return failed


class SqliteConnector(KVConnector):
    """Every full KV block in one SQLite file; a prefix the pool lost is read back from it."""

    name = "sqlite"
    Options = SqliteOptions
    Worker = SqliteWorker

    def __init__(self, options, layout, fingerprint, call):
        super().__init__(options, layout, fingerprint, call)
        with sqlite3.connect(options.path) as db:
            db.execute(SCHEMA)
            rows = db.execute("SELECT digest FROM blocks WHERE fingerprint = ? AND rank = 0", (fingerprint,))
            self.stored = {digest for (digest,) in rows}
        self.ops: list[tuple[str, bytes, int]] = []
        self.hit_tokens = 0

    @property
    def setup(self) -> bytes:
        return self.fingerprint.encode()

    def lookup(self, request, digests: list[bytes]) -> int:
        n = 0
        while n < len(digests) and digests[n] in self.stored:
            n += 1
        return n

    def load(self, digest: bytes, block: int) -> None:
        self.ops.append(("load", digest, block))
        self.hit_tokens += self.layout.block_size

    def load_failed(self, digest: bytes, block: int) -> None:
        self.stored.discard(digest)  # (not offered again; the next save of it writes it anew)
        self.hit_tokens -= self.layout.block_size

    def save(self, digest: bytes, block: int) -> None:
        if digest not in self.stored:
            self.stored.add(digest)
            self.ops.append(("save", digest, block))

    def take_payload(self) -> bytes:
        payload, self.ops = (msgspec.msgpack.encode(self.ops) if self.ops else b""), []
        return payload

    def stats(self) -> ConnectorStats:
        return ConnectorStats(blocks={"sqlite": len(self.stored)}, hit_tokens={"sqlite": self.hit_tokens})


@hookimpl
def conveyor_register_connectors(register):
    register(SqliteConnector)
