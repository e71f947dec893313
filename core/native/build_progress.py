"""Lines while the CPU kernels build (torch's builder runs ninja silently, and a first build takes a minute or
more): which source has compiled, how many are left, and the time so far."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

logger = logging.getLogger("conveyor")

# what a first build takes, for the message that announces it (measured: 42 s on an idle 2-core AMD EPYC (Zen 4),
# 2026-12-07; about 4 minutes was seen on a 2-core machine shared with other work)
BUILD_TIME = "about a minute on two idle cores, several while they are busy"


class BuildProgress:
    """A line each time the build finishes compiling a source (``ggml_gemm.cpp compiled: 3 of 12, 41 s``): torch's
    builder runs ninja silently, and a first build takes minutes."""

    def __init__(self, build_dir: Path, sources: list[Path], interval: float = 1.0):
        self.build_dir = build_dir
        self.pending = {source.stem: source.name for source in sources}
        self.total = len(sources)
        self.started = time.perf_counter()
        self.interval = interval
        self._stopped = threading.Event()
        self._polling = threading.Lock()
        threading.Thread(target=self._watch, daemon=True, name="kernel-build-progress").start()

    def poll(self) -> list[str]:
        """The sources whose object files have appeared since the last poll, announced in the log."""
        with self._polling:  # (the watcher's thread and stop() both poll)
            done = [stem for stem in self.pending if (self.build_dir / f"{stem}.o").exists()]
            for stem in done:
                name = self.pending.pop(stem)
                logger.info("  %s compiled: %d of %d, %.0f s", name, self.total - len(self.pending), self.total,
                            time.perf_counter() - self.started)
        return done

    def _watch(self) -> None:
        while self.pending and not self._stopped.wait(self.interval):
            self.poll()

    def stop(self) -> None:
        self._stopped.set()
        self.poll()  # (the last sources compile just before the link ends the build)
