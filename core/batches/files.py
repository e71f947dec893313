"""OpenAI's Files API over a folder: each file's bytes in ``files/``, its record in SQLite (``batch.sqlite3``).

A file is written under a temporary name, synced, renamed into place, and only then recorded, so a record always
has its whole file behind it; a server killed during an upload leaves at most a temporary file, which the next
start removes. Records are listed newest first by their insertion order (SQLite's rowid), which OpenAI's cursor
pagination (``after``: the last id a page ended at) walks without gaps even where two files share a second.
"""

from __future__ import annotations

import os
import secrets
import sqlite3
import time
from pathlib import Path
from typing import Any, BinaryIO

# the purposes /v1/files takes from clients ("batch_output": the batches' own results)
UPLOAD_PURPOSES = ("batch",)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL
)"""
_COPY_CHUNK = 1 << 20


class FileTooLarge(ValueError):
    """An upload past ``[batch] max_file_mb``."""


class FileStore:
    """The files of ``[batch] dir``."""

    def __init__(self, directory: str | Path, max_file_bytes: int):
        self.dir = Path(directory).expanduser()
        self.files = self.dir / "files"
        self.files.mkdir(parents=True, exist_ok=True)
        self.max_file_bytes = max_file_bytes
        # (each call is one short statement, made on the event loop's thread, in autocommit)
        self.db = sqlite3.connect(self.dir / "batch.sqlite3", isolation_level=None)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(_SCHEMA)
        for partial in self.files.glob("*.part"):  # (an upload the last run did not finish)
            partial.unlink()

    def path(self, file_id: str) -> Path:
        return self.files / file_id

    def write(self, source: BinaryIO) -> tuple[str, int]:
        """Copy an upload into the folder under a new id (blocking: run it in a worker thread); returns the id
        and its size. Nothing is recorded yet (``record``).

        Raises:
            FileTooLarge: past ``max_file_bytes`` (nothing is left behind).
        """
        file_id = f"file-{secrets.token_hex(12)}"
        partial = self.files / f"{file_id}.part"
        size = 0
        try:
            with open(partial, "wb") as out:
                while chunk := source.read(_COPY_CHUNK):
                    size += len(chunk)
                    if size > self.max_file_bytes:
                        raise self.too_large()
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            partial.rename(self.path(file_id))
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        return file_id, size

    def too_large(self) -> FileTooLarge:
        return FileTooLarge(f"the file is larger than [batch] max_file_mb = {self.max_file_bytes // 2**20} MiB")

    def record(self, file_id: str, filename: str, purpose: str, size: int) -> dict[str, Any]:
        """Record a file written by ``write``; returns its OpenAI file object. A file that cannot be recorded is
        removed (a file without a record would never be listed, nor swept)."""
        try:
            self.db.execute("INSERT INTO files (id, filename, purpose, bytes, created_at) VALUES (?, ?, ?, ?, ?)",
                            (file_id, filename, purpose, size, int(time.time())))
        except BaseException:
            self.path(file_id).unlink(missing_ok=True)
            raise
        return self.get(file_id)

    def get(self, file_id: str) -> dict[str, Any]:
        """The OpenAI file object of ``file_id``.

        Raises:
            KeyError: no such file.
        """
        row = self.db.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        if row is None:
            raise KeyError(file_id)
        return _file_object(row)

    def list(self, purpose: str | None, limit: int, after: str | None, ascending: bool) -> tuple[list[dict], bool]:
        """A page of file objects (``after``: the id the last page ended at) and whether more follow.

        Raises:
            KeyError: ``after`` names no file.
        """
        where, args = [], []
        if purpose is not None:
            where.append("purpose = ?")
            args.append(purpose)
        if after is not None:
            cursor = self.db.execute("SELECT rowid FROM files WHERE id = ?", (after,)).fetchone()
            if cursor is None:
                raise KeyError(after)
            where.append("rowid > ?" if ascending else "rowid < ?")
            args.append(cursor[0])
        # (the statement is made of fixed strings; every value is bound)
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        order = "ASC" if ascending else "DESC"
        rows = self.db.execute(f"SELECT * FROM files {clause} ORDER BY rowid {order} LIMIT ?",
                               (*args, limit + 1)).fetchall()
        return [_file_object(row) for row in rows[:limit]], len(rows) > limit

    def delete(self, file_id: str) -> None:
        """Remove a file and its record.

        Raises:
            KeyError: no such file.
        """
        if self.db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount == 0:
            raise KeyError(file_id)
        self.path(file_id).unlink(missing_ok=True)

    def close(self) -> None:
        self.db.close()


def _file_object(row: sqlite3.Row) -> dict[str, Any]:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed", "expires_at": None,
            "status_details": None}
