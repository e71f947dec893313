"""What a device can do at most: dense matmul FLOP/s by dtype and memory bandwidth.

GPUs come from NVIDIA's datasheets (dense figures: the datasheets' tensor
core numbers marked "with sparsity" halved). A CPU is measured: a 2048-cubed
matmul per dtype on all threads and the read bandwidth of summing a 512 MiB
tensor, once per CPU model, feature flags and thread count
(``conveyor profile``), then cached under the cache directory. torch is
imported only where a device is measured or named: the serving process
imports this module and never loads torch.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import time
from pathlib import Path

import msgspec

logger = logging.getLogger("conveyor")

TERA = 1e12


class DevicePeaks(msgspec.Struct, frozen=True):
    """One device's peaks."""

    name: str
    # dtype ("bfloat16", "float16", "float32", "fp8", "int8") -> dense FLOP/s (int8: OP/s)
    flops: dict[str, float]
    # memory read bandwidth, bytes/s
    bytes_per_second: float
    # where the numbers come from (a datasheet, or "measured on ...")
    source: str
    # the device's memory, bytes (0: not known; a CPU's KV budget is [kvcache] memory_gb)
    memory_bytes: int = 0

    def flops_for(self, dtype: str) -> float:
        """FLOP/s for matmuls in ``dtype`` (float16 as bfloat16 where only that is known; 0 when unknown).

        A 16-bit dtype gets at least the float32 rate: a CPU without 16-bit arithmetic (AVX2 alone) multiplies
        bfloat16 hundreds of times slower than float32 in a plain matmul (0.34 against 146 GFLOP/s measured
        on an AMD EPYC with AVX2), but Conveyor's steps do not run at that rate there (GGUF blocks go through
        int8 kernels; a bfloat16 linear is converted), so that rate would make every step look compute-bound.
        """
        rate = self.flops.get(dtype) or self.flops.get("bfloat16" if dtype == "float16" else dtype, 0.0)
        return max(rate, self.flops.get("float32", 0.0)) if dtype in ("bfloat16", "float16") else rate


def _gpu(name: str, bf16: float, fp8: float, int8: float, gb_per_s: float, memory_gb: int,
         source: str) -> DevicePeaks:
    flops = {"bfloat16": bf16 * TERA, "float16": bf16 * TERA, "int8": int8 * TERA}
    if fp8:
        flops["fp8"] = fp8 * TERA
    return DevicePeaks(name, flops, gb_per_s * 1e9, source, memory_gb * 10**9)


# (what torch.cuda.get_device_name contains, lower case) -> peaks (TFLOP/s dense, GB/s, GB of memory); the first
# match wins, so longer names first
GPUS: list[tuple[str, DevicePeaks]] = [
    ("h200", _gpu("H200 SXM", 989.4, 1978.9, 1978.9, 4800, 141, "NVIDIA H200 Tensor Core GPU datasheet (SXM)")),
    ("h100 pcie", _gpu("H100 PCIe", 756.0, 1513.0, 1513.0, 2000, 80, "NVIDIA H100 Tensor Core GPU datasheet (PCIe)")),
    ("h100 nvl", _gpu("H100 NVL", 835.0, 1670.0, 1670.0, 3900, 94, "NVIDIA H100 Tensor Core GPU datasheet (NVL)")),
    ("h100", _gpu("H100 SXM", 989.4, 1978.9, 1978.9, 3350, 80, "NVIDIA H100 Tensor Core GPU datasheet (SXM)")),
    ("a100-sxm4-40gb", _gpu("A100 SXM 40GB", 312.0, 0.0, 624.0, 1555, 40, "NVIDIA A100 Tensor Core GPU datasheet")),
    ("a100-pcie-40gb", _gpu("A100 PCIe 40GB", 312.0, 0.0, 624.0, 1555, 40, "NVIDIA A100 Tensor Core GPU datasheet")),
    ("a100 80gb pcie", _gpu("A100 PCIe 80GB", 312.0, 0.0, 624.0, 1935, 80, "NVIDIA A100 Tensor Core GPU datasheet")),
    ("a100", _gpu("A100 SXM 80GB", 312.0, 0.0, 624.0, 2039, 80, "NVIDIA A100 Tensor Core GPU datasheet")),
    ("l40s", _gpu("L40S", 362.05, 733.0, 733.0, 864, 48, "NVIDIA L40S GPU datasheet")),
    ("l4", _gpu("L4", 121.0, 242.5, 242.5, 300, 24, "NVIDIA L4 Tensor Core GPU datasheet")),
]


def gpu_peaks(device_name: str) -> DevicePeaks | None:
    """The table's entry for a GPU named ``device_name`` (as ``torch.cuda.get_device_name`` gives it), or a
    name from the table ("H100 SXM", "l4"); None for a GPU the table lacks."""
    name = device_name.lower()
    for pattern, peaks in GPUS:
        if pattern in name or name == peaks.name.lower():
            return peaks
    return None


def _cpu_key() -> str:
    """The CPU model, its feature flags and torch's threads: what a measured profile holds for."""
    import torch

    digest = hashlib.sha1(platform.processor().encode())
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags", "Features")):
                digest.update(line.encode())
    except OSError:
        pass
    return f"{digest.hexdigest()[:12]}-{torch.get_num_threads()}t"


def measure_cpu() -> DevicePeaks:
    """Measure this CPU now (a few seconds; 512 MiB for the bandwidth)."""
    import torch

    from conveyor.perf.floors import matmul_flops, median_seconds

    x = torch.ones(2**27, dtype=torch.float32)
    bandwidth = x.nbytes / min(median_seconds(x.sum, 3) for _ in range(3))
    del x
    flops = {"float32": matmul_flops(torch.float32)}
    # NOTE: without 16-bit arithmetic (AVX2 alone) a 2048-cubed bfloat16 matmul takes about a minute (0.29
    # GFLOP/s on an AMD EPYC), and a server that measured it at start-up missed a 300 s start-up deadline; a
    # 256-cubed one says as much in a tenth of a second
    probe = matmul_flops(torch.bfloat16, size=256)
    flops["bfloat16"] = probe if probe < flops["float32"] / 10 else matmul_flops(torch.bfloat16)
    flops["float16"] = flops["bfloat16"]
    name = platform.processor() or platform.machine()
    try:
        name = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return DevicePeaks(f"{name} ({torch.get_num_threads()} threads)", flops, bandwidth,
                       f"measured {time.strftime('%Y-%m-%d')} by conveyor profile")


def cpu_profile_path(cache_root: Path) -> Path:
    return cache_root / "profiles" / f"cpu-{_cpu_key()}.json"


def profile_cpu(cache_root: Path) -> tuple[DevicePeaks, Path]:
    """Measure this CPU and cache the profile (replacing one there was); returns it and where it went."""
    path = cpu_profile_path(cache_root)
    peaks = measure_cpu()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.encode(peaks))
    return peaks, path


def cpu_peaks(cache_root: Path, measure: bool = True) -> DevicePeaks | None:
    """This CPU's cached profile; measured and cached first where there is none and ``measure``."""
    path = cpu_profile_path(cache_root)
    try:
        return msgspec.json.decode(path.read_bytes(), type=DevicePeaks)
    except (OSError, msgspec.DecodeError):
        if not measure:
            return None
    logger.info("measuring this CPU's matmul rate and memory bandwidth (once; cached in %s)", path)
    return profile_cpu(cache_root)[0]


def device_peaks(device: str, cache_root: Path) -> DevicePeaks | None:
    """The peaks of ``device`` ("cpu", "cuda:0"); None for a GPU the table lacks."""
    if device.startswith("cuda"):
        import torch

        name = torch.cuda.get_device_name(torch.device(device))
        peaks = gpu_peaks(name)
        if peaks is None:
            logger.info("%s is not in the table of GPU peaks: no MFU or MBU on /metrics", name)
        return peaks
    return cpu_peaks(cache_root)
