"""Where Conveyor keeps what it builds and measures on a machine (kernels, compiled graphs, device peaks)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$CONVEYOR_CACHE_DIR``, by default ``~/.cache/conveyor``."""
    return Path(os.environ.get("CONVEYOR_CACHE_DIR") or Path.home() / ".cache" / "conveyor")
