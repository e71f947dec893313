"""GPU utilization and memory from NVML (``nvidia-ml-py``, optional), on /metrics beside the step stats.

Read at each scrape, for every GPU NVML sees on the server's machine:
``conveyor_gpu_utilization_ratio`` (the share of the last sample period a
kernel ran, 0..1), ``conveyor_gpu_memory_used_bytes`` and
``conveyor_gpu_memory_total_bytes``, labelled ``gpu`` (NVML's index). They
are registered once an engine reports a CUDA device and NVML starts; without
the package, the driver or a GPU they are absent and nothing else changes.
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

logger = logging.getLogger("conveyor")


class GpuGauges:
    """NVML's view of the machine's GPUs, refreshed by ``update`` (a scrape)."""

    def __init__(self, nvml: Any, registry: CollectorRegistry, model_name: str):
        self.nvml = nvml
        self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        labels = ["model_name", "gpu"]
        utilization = Gauge("conveyor_gpu_utilization_ratio", "Share of NVML's last sample period in which a "
                            "kernel ran on the GPU.", labels, registry=registry)
        used = Gauge("conveyor_gpu_memory_used_bytes", "GPU memory in use (all processes).", labels,
                     registry=registry)
        total = Gauge("conveyor_gpu_memory_total_bytes", "GPU memory in all.", labels, registry=registry)
        self.gauges = [(utilization.labels(model_name, str(i)), used.labels(model_name, str(i)),
                        total.labels(model_name, str(i))) for i in range(len(self.handles))]

    @classmethod
    def start(cls, registry: CollectorRegistry, model_name: str) -> GpuGauges | None:
        """The gauges, or None where NVML cannot start (no package, driver or GPU)."""
        try:
            import pynvml
        except ImportError:
            logger.info("no GPU metrics: nvidia-ml-py is not installed (pip install 'conveyor-serve[gpu]')")
            return None
        try:
            pynvml.nvmlInit()
            return cls(pynvml, registry, model_name)
        except pynvml.NVMLError as e:  # no driver, no GPU
            logger.info("no GPU metrics from NVML: %s", e)
            return None

    def update(self) -> None:
        for handle, (utilization, used, total) in zip(self.handles, self.gauges):
            try:
                rates = self.nvml.nvmlDeviceGetUtilizationRates(handle)
                memory = self.nvml.nvmlDeviceGetMemoryInfo(handle)
            except self.nvml.NVMLError as e:  # a GPU fallen off the bus: keep the last values
                logger.warning("NVML: %s", e)
                continue
            utilization.set(rates.gpu / 100)
            used.set(memory.used)
            total.set(memory.total)
