"""The CPUs this process may use: the cores it may run on, capped by its container's CPU quota.

``os.cpu_count()`` counts the machine's cores, and torch's default thread count (OpenMP's) follows the
process's affinity mask; neither reads a cgroup's quota, so in a container given 2 CPUs of a 64-core host
either would start 64 threads that the quota then throttles in turns (each step waits for its slowest
thread). The quota is cgroup v2's ``cpu.max`` ("max 100000" or "200000 100000": microseconds of CPU per
period) or cgroup v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1: none), in the process's own cgroup.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import NamedTuple


class CpuLimit(NamedTuple):
    """What bounds the threads worth running: cores the process may run on, and its quota in CPUs (0: none)."""

    cores: int
    quota: float
    quota_file: str = ""

    @property
    def usable(self) -> int:
        """Threads worth running: the cores, or the quota rounded up (a thread per whole or partial CPU)."""
        return max(1, min(self.cores, math.ceil(self.quota))) if self.quota else self.cores

    def describe(self) -> str:
        if not self.quota or math.ceil(self.quota) >= self.cores:
            return f"{self.cores} cores"
        return f"{self.cores} cores, a CPU quota of {self.quota:g} ({self.quota_file})"


def _cgroup_dirs(root: Path, proc_cgroup: Path) -> list[Path]:
    """The process's own cgroup directories and each parent up to the root, innermost first (a quota set on a
    parent bounds the child too), for v2 ("0::/path") and v1's cpu controller ("N:cpu,cpuacct:/path")."""
    dirs = []
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        names = controllers.split(",")
        if controllers == "":
            base = root
        elif "cpu" in names:
            base = next((root / d for d in ("cpu,cpuacct", "cpu", "cpuacct,cpu") if (root / d).is_dir()), root / "cpu")
        else:
            continue
        here = base / path.lstrip("/")
        while True:
            dirs.append(here)
            if here == base:
                break
            here = here.parent
    # (inside a container the namespace's root is the container's own cgroup)
    dirs.append(root)
    return dirs


def _quota(directory: Path) -> float:
    """The quota in CPUs set in one cgroup directory; 0 where none is set there."""
    try:
        fields = (directory / "cpu.max").read_text().split()
        if fields and fields[0] != "max":
            return int(fields[0]) / int(fields[1])
        return 0.0
    except (OSError, ValueError, IndexError):
        pass
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else 0.0
    except (OSError, ValueError):
        return 0.0


def cpu_limit(root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")) -> CpuLimit:
    """The cores this process may run on and the tightest CPU quota of its cgroup and the cgroups above it."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # (not on Linux)
        cores = os.cpu_count() or 1
    tightest, where = 0.0, ""
    for directory in dict.fromkeys(_cgroup_dirs(root, proc_cgroup)):
        quota = _quota(directory)
        if quota and (not tightest or quota < tightest):
            tightest, where = quota, str(directory)
    return CpuLimit(cores, tightest, where)
