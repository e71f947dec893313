"""The ``tiers`` connector's worker side: the host tier's memory, the disk tier's files, and the copies
between them and the device pool that the scheduler side orders (``conveyor.plugins.connector.tiers``).

A block file is a header, then the block's bytes: K, V (and an fp8 cache's scales) of every layer this
worker holds, each ``[layers, kv_heads, block_size, ...]`` as the host tier stores it. The header names the
format, the fingerprint of what the blocks belong to (model, quant method, KV dtype and layout), the block's
digest, the worker's rank, the payload's length and its CRC-32; a file is loaded only if all of them match.
"""

from __future__ import annotations

import logging
import os
import queue
import struct
import tempfile
import threading
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from conveyor.connector import KVConnectorWorker

if TYPE_CHECKING:  # (torch is imported in the worker only: the serving process registers this plugin too)
    import torch

logger = logging.getLogger("conveyor")

# the operations a payload lists, in order: (kind, device block, host slot, key); ``key`` is the block's digest
SAVE = 0  # device block -> host slot (slot -1: none)
LOAD = 1  # host slot -> device block, if the slot holds the block (``apply`` answers the blocks it did not)
FETCH = 2  # disk file ``key`` -> host slot (checked; ``call`` answers the keys that failed)
DROP = 3  # delete disk file ``key``
WRITE = 4  # as SAVE, and -> disk file ``key``

MAGIC = b"CVKV1\0"
# magic, fingerprint (hex, padded), digest, rank, payload bytes, CRC-32 of the payload
HEADER = struct.Struct("<6s32s16sHQI")
# disk writes and deletions queued for the writer thread at most (a step waits beyond)
MAX_DISK_JOBS = 256


class TierSetup(msgspec.Struct, array_like=True):
    num_host_blocks: int
    fingerprint: str
    # "": no disk tier
    disk_dir: str


def block_dir(disk_dir: str, fingerprint: str, rank: int) -> Path:
    """Where a worker keeps its blocks' files."""
    return Path(disk_dir) / fingerprint / f"rank{rank}"


class TierWorker(KVConnectorWorker):
    """The host tier (one slot per block, each tensor of the pool in its block's shape) and the disk files."""

    def __init__(self, options, storage, rank: int, setup: bytes):
        import torch

        super().__init__(options, storage, rank, setup)
        self.setup = msgspec.msgpack.decode(setup, type=TierSetup)
        self.block_size = storage.block_size
        pool = [storage.k, storage.v] + ([storage.k_scale, storage.v_scale] if storage.quantized else [])
        # (K and V: [layers, kv_heads, slots, head_dim]; scales: [layers, kv_heads, slots])
        self.pool = pool
        pin = storage.device.type == "cuda"
        self.host = [torch.empty((self.setup.num_host_blocks, t.shape[0], t.shape[1], self.block_size, *t.shape[3:]),
                                 dtype=t.dtype, pin_memory=pin) for t in pool]
        self.payload_bytes = sum(h[0].nbytes for h in self.host)
        # the digest of the block each host slot holds (b"": none), as this worker filled it
        self.slot_keys = [b""] * self.setup.num_host_blocks
        self.directory = None
        # (key, block bytes) to write, or (key, None) to delete: a thread does it, in order, off the step
        self.disk_jobs: queue.Queue[tuple[bytes, bytes | None]] = queue.Queue(MAX_DISK_JOBS)
        if self.setup.disk_dir:
            self.directory = block_dir(self.setup.disk_dir, self.setup.fingerprint, rank)
            self.directory.mkdir(parents=True, exist_ok=True)
            threading.Thread(target=self._disk_writer, name="kv-disk-writer", daemon=True).start()

    def _blocks(self, block: int) -> list[torch.Tensor]:
        rows = slice(block * self.block_size, (block + 1) * self.block_size)
        return [t[:, :, rows] for t in self.pool]

    def apply(self, payload: bytes) -> list[int]:
        """Carry out a step's operations in order; the device blocks a LOAD could not fill."""
        return self._run(payload)[1]

    def call(self, payload: bytes) -> bytes:
        """Carry out the operations in order; the keys of the files that could not be fetched (msgpack)."""
        return msgspec.msgpack.encode(self._run(payload)[0])

    def _run(self, payload: bytes) -> tuple[list[bytes], list[int]]:
        """The operations in order; the keys FETCH could not read, and the blocks LOAD could not fill."""
        import torch

        failed_keys, failed_blocks = [], []
        flushed = False
        for kind, block, slot, key in msgspec.msgpack.decode(payload, type=list[tuple[int, int, int, bytes]]):
            if kind == SAVE or kind == WRITE:
                copies = self._blocks(block)
                if slot >= 0:
                    for host, device in zip(self.host, copies):
                        host[slot].copy_(device)
                    copies = [host[slot] for host in self.host]
                    self.slot_keys[slot] = key
                if kind == WRITE:  # (the block may be reused before the thread writes it: its bytes now)
                    self.disk_jobs.put((key, b"".join(c.contiguous().cpu().view(torch.uint8).numpy().tobytes()
                                                      for c in copies)))
            elif kind == LOAD:
                # (a slot that does not hold the block on this worker is not copied: whatever it holds would be
                # served as the block; the engine computes the block instead)
                if self.slot_keys[slot] != key:
                    logger.warning("KV host tier: slot %d does not hold block %s on rank %d", slot, key.hex(),
                                   self.rank)
                    failed_blocks.append(block)
                    continue
                for host, device in zip(self.host, self._blocks(block)):
                    device.copy_(host[slot])
            elif kind == FETCH:
                if not flushed:  # (every write and deletion ordered before it is on disk)
                    self.disk_jobs.join()
                    flushed = True
                read = self._read(key, slot)
                self.slot_keys[slot] = key if read else b""
                if not read:
                    failed_keys.append(key)
            elif kind == DROP:
                self.disk_jobs.put((key, None))
        return failed_keys, failed_blocks

    def close(self) -> None:
        """Finish the queued disk writes (a server that starts again finds them)."""
        if self.directory is not None:
            self.disk_jobs.join()

    def _disk_writer(self) -> None:
        while True:
            key, payload = self.disk_jobs.get()
            try:
                if payload is None:
                    self._path(key).unlink(missing_ok=True)
                else:
                    self._write(key, payload)
            except Exception:  # noqa: BLE001 - the thread must go on: the steps wait on its queue
                logger.exception("KV disk tier: %s failed", self._path(key))
            finally:
                self.disk_jobs.task_done()

    def _path(self, key: bytes) -> Path:
        return self.directory / f"{key.hex()}.kv"

    def _write(self, key: bytes, payload: bytes) -> None:
        """A block's bytes to its file, whole or not at all (a temporary file renamed)."""
        header = HEADER.pack(MAGIC, self.setup.fingerprint.encode(), key, self.rank, len(payload),
                             zlib.crc32(payload))
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(header + payload)
            os.replace(tmp, self._path(key))
        except OSError as e:  # (a full or read-only disk: the block stays in host memory only)
            logger.warning("KV disk tier: cannot write %s: %s", self._path(key), e)
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)

    def _read(self, key: bytes, slot: int) -> bool:
        """The block's file into the slot, if it is whole and this model's; False (with a warning) if not."""
        import torch

        path = self._path(key)
        try:
            data = path.read_bytes()
        except OSError as e:
            logger.warning("KV disk tier: skipped %s: %s", path, e)
            return False
        problem = self._check(data, key)
        if problem:
            logger.warning("KV disk tier: skipped %s: %s", path, problem)
            return False
        offset = HEADER.size
        for host in self.host:
            n = host[slot].nbytes
            host[slot].view(torch.uint8).view(-1).copy_(torch.frombuffer(bytearray(data[offset : offset + n]),
                                                                          dtype=torch.uint8))
            offset += n
        return True

    def _check(self, data: bytes, key: bytes) -> str:
        """Why a file's bytes are not block ``key`` of this model ("" when they are)."""
        if len(data) < HEADER.size:
            return f"truncated ({len(data)} bytes)"
        magic, fingerprint, digest, rank, length, crc = HEADER.unpack_from(data)
        if magic != MAGIC:
            return "not a KV block file"
        if fingerprint.rstrip(b"\0").decode(errors="replace") != self.setup.fingerprint or rank != self.rank:
            return "written for another model, quant method, KV layout or worker"
        if digest != key or length != self.payload_bytes:
            return "holds another block"
        if len(data) != HEADER.size + length:
            return f"truncated ({len(data) - HEADER.size} of {length} bytes)"
        if zlib.crc32(memoryview(data)[HEADER.size :]) != crc:
            return "corrupt (checksum mismatch)"
        return ""
