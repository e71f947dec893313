"""A neighbour for the benchmarks that measure a shared CPU (``--busy-core``): another process that keeps one core
busy, a Python loop that never sleeps, for as long as a block runs."""

from __future__ import annotations

import contextlib
import subprocess
import sys


@contextlib.contextmanager
def busy_core():
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        neighbour.kill()
        neighbour.wait()
