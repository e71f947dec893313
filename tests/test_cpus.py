"""The CPUs the engine's threads are sized to (conveyor.perf.cpus): the cores the process may run on, capped by its
cgroup's CPU quota, read from cgroup trees written here in the layouts of v2 and v1."""

from __future__ import annotations

import os

import pytest
import torch

from conveyor.perf.cpus import CpuLimit, cpu_limit

CORES = len(os.sched_getaffinity(0))


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_of_the_process_or_a_parent_caps_the_threads(tmp_path):
    proc = tmp_path / "cgroup"
    write(proc, "0::/kubepods/pod1/container\n")
    root = tmp_path / "fs"
    write(root / "kubepods/pod1/container/cpu.max", "max 100000\n")
    write(root / "kubepods/pod1/cpu.max", "150000 100000\n")  # 1.5 CPUs on the pod
    write(root / "kubepods/cpu.max", "400000 100000\n")
    limit = cpu_limit(root, proc)
    assert limit.quota == 1.5 and limit.quota_file.endswith("kubepods/pod1")
    assert limit.usable == min(CORES, 2)  # (a partial CPU is worth a thread)
    write(root / "kubepods/pod1/cpu.max", "max 100000\n")
    assert cpu_limit(root, proc).quota == 4.0


def test_cgroup_v1_quota_and_no_quota(tmp_path):
    proc = tmp_path / "cgroup"
    write(proc, "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n")
    root = tmp_path / "fs"
    write(root / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "50000\n")
    write(root / "cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    limit = cpu_limit(root, proc)
    assert limit.quota == 0.5 and limit.usable == 1 and "quota of 0.5" in limit.describe()
    write(root / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "-1\n")
    assert cpu_limit(root, proc) == CpuLimit(CORES, 0.0, "")
    assert cpu_limit(tmp_path / "nothing", tmp_path / "missing").usable == CORES


def test_the_worker_sizes_torch_threads_to_the_quota(monkeypatch):
    from conveyor.config import load_config
    from conveyor.registry import PluginRegistry
    from conveyor.worker import worker as worker_module

    if CORES < 2:
        pytest.skip("needs 2 cores to see a quota below them")
    before = torch.get_num_threads()
    monkeypatch.setattr(worker_module, "cpu_limit", lambda: CpuLimit(CORES, 1.0, "/sys/fs/cgroup"))
    try:
        for overrides, threads in (({}, 1), ({"engine.num_threads": 2}, 2)):
            config = load_config(None, {"model.device": "cpu", **overrides})
            worker_module.Worker(config, PluginRegistry.of(config))
            assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)

