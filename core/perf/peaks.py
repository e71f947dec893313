"""What a device can do at most: dense matmul FLOP/s by arithmetic and memory bandwidth.

GPUs come from NVIDIA's datasheets (dense figures: the datasheets' tensor
core numbers marked "with sparsity" halved). A CPU is measured on all threads
(``conveyor profile``, or the first server on a machine): the int8 dot
products in registers on each path the packed-block kernels have
(``conveyor.native.int8_peak_ops``) and what those kernels
(``conveyor.native.ggml_linear``) reach of them, a 2048-cubed float32 and bfloat16 torch matmul, and the
read bandwidth of summing a 512 MiB tensor, each the best of a few runs (a
busy moment slows a run, never speeds one). The profile is cached under the
cache directory by the CPU's model name, its instruction-set flags, the
thread count and the measurement's version, so a new CPU, new flags or a new
way of measuring measure again. torch is imported only where a device is
measured or named: the serving process imports this module and never loads
torch.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import re
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

logger = logging.getLogger("conveyor")

TERA = 1e12
# what a cached CPU profile holds; a profile of another version is measured again (2: the int8 rate of the
# packed-block kernels, best-of runs; 3: the int8 dot products' own peak beside it)
MEASUREMENT_VERSION = 3
# seconds one call of the int8 dot products' loop runs (conveyor.native.int8_peak_ops)
INSTRUCTION_SECONDS = 0.05
# runs of each CPU measurement after one untimed run; the fastest counts
REPEATS = 3
# rows, output columns and input columns of the int8 GEMM: each unpacked weight serves 512 rows, so the time
# is the dot products' (about 30 ms on two Zen 4 cores with AVX-512 VNNI, 65 ms on their AVX2 path)
INT8_SHAPE = (512, 4096, 4096)
# the portable path is tens of times slower: a shape of the same kind that takes a similar time
SCALAR_INT8_SHAPE = (64, 1024, 1024)
# the packed-block kernels' paths, slowest first (conveyor.native.ggml_linear_path)
KERNEL_PATHS = ("scalar", "avx2", "avx512_vnni", "amx")
# instruction-set flags that decide a matmul's speed (x86 /proc/cpuinfo "flags", Arm "Features"): the profile's
# key holds these alone, so a flag the OS adds for another reason (a mitigation) does not measure again
ISA_FLAG = re.compile(r"^(avx|amx|fma|f16c|sse|ssse|asimd|sve|sme|i8mm|bf16|dotprod)")

# bits a weight of each format the packed-block kernels multiply as int8 dot products (GGUF blocks, as
# conveyor.model.ggml.BLOCKS sizes them, and the quant methods that keep such blocks; "int8": Q8_0 blocks
# with a scale a row)
INTEGER_BITS = {"Q4_0": 4.5, "Q4_1": 5.0, "Q5_0": 5.5, "Q5_1": 6.0, "Q8_0": 8.5, "Q4_K": 4.5, "Q5_K": 5.5,
                "Q6_K": 6.5625, "Q4_X2": 5.0, "Q8_0R": 8.5, "int8": 8.0}
# bits a weight of the formats multiplied in floating point (fp8 on a CPU: widened to the model dtype)
FLOAT_BITS = {"float32": 32.0, "bfloat16": 16.0, "float16": 16.0, "fp8": 8.0, "F8_E4M3": 8.0}


class DevicePeaks(msgspec.Struct, frozen=True):
    """One device's peaks."""

    name: str
    # arithmetic ("bfloat16", "float16", "float32", "fp8", "int8") -> dense FLOP/s (int8: OP/s, a multiply-add
    # counted as two)
    flops: dict[str, float]
    # memory read bandwidth, bytes/s
    bytes_per_second: float
    # where the numbers come from (a datasheet, or "measured on ...")
    source: str
    # the device's memory, bytes (0: not known; a CPU's KV budget is [kvcache] memory_gb)
    memory_bytes: int = 0
    # a CPU: the path the packed-block kernels take ("avx2", "avx512_vnni", "amx", "scalar"; "": they do not run
    # here), the int8 dot products' peak OP/s on each path built here, and what the kernels reach of it at a shape
    # that favours them
    int8_path: str = ""
    int8_by_path: dict[str, float] = {}
    int8_kernel_by_path: dict[str, float] = {}
    # a measured profile: the MEASUREMENT_VERSION that made it (0: a datasheet, or an older measurement)
    version: int = 0

    def flops_for(self, dtype: str) -> float:
        """FLOP/s for matmuls in ``dtype`` (float16 as bfloat16 where only that is known; 0 when unknown).

        A 16-bit dtype gets at least the float32 rate: a CPU without 16-bit arithmetic (AVX2 alone) multiplies
        bfloat16 hundreds of times slower than float32 in a plain matmul (0.34 against 146 GFLOP/s measured
        on an AMD EPYC with AVX2), but Conveyor's steps do not run at that rate there (GGUF blocks go through
        int8 kernels; a bfloat16 linear is converted), so that rate would make every step look compute-bound.
        """
        rate = self.flops.get(dtype) or self.flops.get("bfloat16" if dtype == "float16" else dtype, 0.0)
        return max(rate, self.flops.get("float32", 0.0)) if dtype in ("bfloat16", "float16") else rate

    def flops_for_weights(self, weight_formats: dict[str, int], dtype: str) -> float:
        """The peak a step's matmuls are measured against, for weights kept as ``weight_formats`` (bytes by
        format, ``DecoderModel.weight_formats``) in a model of ``dtype``.

        On a CPU whose packed-block kernels run, the weights they multiply (GGUF blocks, the int8 method's) take
        the int8 peak and the others the dtype's: the peak is the rate at which the step's FLOPs would take the
        time they take at each peak, share by share (a mean of the rates weighted by the weights' counts,
        harmonic). Elsewhere (a GPU: GGUF blocks widen to the dtype in its kernel) the dtype's peak.
        """
        dense = self.flops_for(dtype)
        integer = self.flops.get("int8", 0.0) if self.int8_path else 0.0
        share = integer_share(weight_formats) if integer else 0.0
        if share <= 0 or (share < 1 and not dense):
            return dense
        return 1 / (share / integer + (1 - share) / dense) if share < 1 else integer


def integer_share(weight_formats: dict[str, int]) -> float:
    """The share of the weights (by count, not bytes) kept in formats that a CPU's packed-block kernels multiply
    with int8 dot products; 0 where none are ("copies": second copies of other weights, left out)."""
    integer = other = 0.0
    for format, num_bytes in weight_formats.items():
        if format == "copies":
            continue
        if format in INTEGER_BITS:
            integer += num_bytes * 8 / INTEGER_BITS[format]
        else:
            other += num_bytes * 8 / FLOAT_BITS.get(format, 16.0)
    return integer / (integer + other) if integer + other else 0.0


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


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_model_name(cpuinfo: str) -> str:
    """The CPU's model name in ``cpuinfo`` (/proc/cpuinfo's text), else what platform knows of it."""
    for line in cpuinfo.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_key(cpuinfo: str, threads: int) -> str:
    """What a measured profile holds for: the CPU's model name and instruction-set flags in ``cpuinfo``
    (/proc/cpuinfo's text), the machine, the measurement's version, and ``threads``."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(flag for flag in line.split(":", 1)[-1].split() if ISA_FLAG.match(flag))
    digest = hashlib.sha1(f"v{MEASUREMENT_VERSION}\0{cpu_model_name(cpuinfo)}\0{platform.machine()}".encode())
    digest.update(" ".join(sorted(flags)).encode())
    return f"{digest.hexdigest()[:12]}-{threads}t"


def _cpu_key() -> str:
    import torch

    return cpu_key(_cpuinfo(), torch.get_num_threads())


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` timed calls, after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _matmul_rate(dtype, size: int, repeats: int) -> float:
    import torch

    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    return 2 * size**3 / _best_seconds(lambda: a @ b, repeats)


def _instruction_rate(path: str, repeats: int) -> float:
    """The int8 dot products' OP/s on ``path`` in registers on every thread (``native.int8_peak_ops``), the turns
    of its loop grown until one call takes INSTRUCTION_SECONDS."""
    from conveyor import native

    turns = 1024
    while True:
        start = time.perf_counter()
        native.int8_peak_ops(path, turns)
        if time.perf_counter() - start >= INSTRUCTION_SECONDS or turns >= 2**40:
            break
        turns *= 4
    ops = native.int8_peak_ops(path, turns)
    return ops / _best_seconds(lambda: native.int8_peak_ops(path, turns), repeats)


def measure_int8(repeats: int = REPEATS) -> tuple[str, dict[str, float], dict[str, float]]:
    """The path the packed-block kernels take here, and by path built here: the int8 dot products' peak (the
    instructions alone, in registers: csrc/int8_peak.cpp) and the kernels' own rate at a shape that favours them;
    ("", {}, {}) where they do not build.

    The kernels' rate: ``ggml_linear`` over Q4_0 blocks (as the kernels lay them out, Q4_X2) at INT8_SHAPE,
    bfloat16 x, every unpacked panel of weights serving all 512 rows (on AMX, Q8_0R blocks' own path too, the
    faster counting). What they leave of the peak goes to unpacking, quantizing x and each block's scales.
    """
    import torch

    from conveyor import native
    from conveyor.model import ggml

    if not native.load():
        return "", {}, {}
    taken = native.ggml_linear_path()
    paths = KERNEL_PATHS[1 : KERNEL_PATHS.index(taken) + 1] or ("scalar",)
    rows, n, k = INT8_SHAPE if taken != "scalar" else SCALAR_INT8_SHAPE
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=generator)
    scales = torch.full((n, k // ggml.QK), 1 / 128)
    blocks = {"Q4_X2": ggml.repack(ggml.encode("Q4_0", q, scales)).data}
    if taken == "amx":
        blocks["Q8_0R"] = ggml.encode("Q8_0", q.to(torch.int32) - 8, scales).data
    x = torch.randn(rows, k, generator=generator).to(torch.bfloat16)
    peak_by_path, kernel_by_path = {}, {}
    for path in paths:
        peak_by_path[path] = _instruction_rate(path, repeats)
        kinds = blocks if path == "amx" else {"Q4_X2": blocks["Q4_X2"]}
        seconds = min(_best_seconds(lambda d=data, t=ggml.TYPE_IDS[kind], p=path: native.ggml_linear(x, d, t, path=p),
                                    repeats) for kind, data in kinds.items())
        kernel_by_path[path] = 2 * rows * n * k / seconds
    return taken, peak_by_path, kernel_by_path


def measure_cpu(repeats: int = REPEATS) -> DevicePeaks:
    """Measure this CPU now (a few seconds; 512 MiB for the bandwidth)."""
    import torch

    x = torch.ones(2**27, dtype=torch.float32)
    bandwidth = x.nbytes / _best_seconds(x.sum, 2 * repeats)
    del x
    flops = {"float32": _matmul_rate(torch.float32, 2048, repeats)}
    # NOTE: without 16-bit arithmetic (AVX2 alone) a 2048-cubed bfloat16 matmul takes about a minute (0.29
    # GFLOP/s on an AMD EPYC), and a server that measured it at start-up missed a 300 s start-up deadline; a
    # 256-cubed one says as much in a tenth of a second
    probe = _matmul_rate(torch.bfloat16, 256, 1)
    flops["bfloat16"] = probe if probe < flops["float32"] / 10 else _matmul_rate(torch.bfloat16, 2048, repeats)
    flops["float16"] = flops["bfloat16"]
    int8_path, int8_by_path, kernel_by_path = measure_int8(repeats)
    if int8_by_path:
        # (the kernels take the fastest path built, and on AMX whichever of AMX and VNNI timed faster at load: the
        # hardware's peak is the fastest path's)
        flops["int8"] = max(int8_by_path.values())
    threads = torch.get_num_threads()
    shape = " x ".join(map(str, INT8_SHAPE if int8_path != "scalar" else SCALAR_INT8_SHAPE))
    source = (f"measured {time.strftime('%Y-%m-%d')}, the best of {repeats} runs each: int8, the dot products "
              f"in registers, and the packed-block kernels over Q4_0 blocks at {shape}; float32 and bfloat16, a "
              "2048-cubed torch matmul; bandwidth, a 512 MiB sum")
    return DevicePeaks(f"{cpu_model_name(_cpuinfo())} ({threads} threads)", flops, bandwidth, source,
                       int8_path=int8_path, int8_by_path=int8_by_path, int8_kernel_by_path=kernel_by_path,
                       version=MEASUREMENT_VERSION)


def cpu_profile_path(cache_root: Path, key: str | None = None) -> Path:
    """Where this CPU's profile is cached (``key``: ``cpu_key``'s, by default this CPU's now)."""
    return cache_root / "profiles" / f"cpu-{key or _cpu_key()}.json"


def best_of(cached: DevicePeaks, measured: DevicePeaks) -> DevicePeaks:
    """Each peak the higher of a cached profile's and a new measurement's of the same CPU (key): a busy moment
    lowers a measurement, and the hardware's peak does not go down."""
    flops = {dtype: max(rate, cached.flops.get(dtype, 0.0)) for dtype, rate in measured.flops.items()}
    by_path = {path: max(rate, cached.int8_by_path.get(path, 0.0)) for path, rate in measured.int8_by_path.items()}
    kernels = {path: max(rate, cached.int8_kernel_by_path.get(path, 0.0))
               for path, rate in measured.int8_kernel_by_path.items()}
    compared = [("bandwidth", cached.bytes_per_second, measured.bytes_per_second),
                *((dtype, cached.flops.get(dtype, 0.0), rate) for dtype, rate in measured.flops.items()
                  if dtype != "float16")]  # (float16 is bfloat16's number)
    kept = [name for name, before, now in compared if before > now]
    source = measured.source + (f"; kept from the profile cached before, higher: {', '.join(kept)}" if kept else "")
    return msgspec.structs.replace(measured, flops=flops, int8_by_path=by_path, int8_kernel_by_path=kernels,
                                   source=source,
                                   bytes_per_second=max(cached.bytes_per_second, measured.bytes_per_second))


def _cached(path: Path) -> DevicePeaks | None:
    """The profile cached at ``path``, where it is of this measurement's version."""
    try:
        peaks = msgspec.json.decode(path.read_bytes(), type=DevicePeaks)
    except (OSError, msgspec.DecodeError):
        return None
    return peaks if peaks.version == MEASUREMENT_VERSION else None


def profile_cpu(cache_root: Path) -> tuple[DevicePeaks, Path]:
    """Measure this CPU and cache the profile, each peak the higher of the new one and the one cached before for
    the same key (delete the file to start afresh); returns it and where it went."""
    path = cpu_profile_path(cache_root)
    peaks = measure_cpu()
    cached = _cached(path)
    if cached is not None:
        peaks = best_of(cached, peaks)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.encode(peaks))
    return peaks, path


def cpu_peaks(cache_root: Path, measure: bool = True) -> DevicePeaks | None:
    """This CPU's cached profile; measured and cached first where there is none, or where the one there is of
    another measurement's version, and ``measure``."""
    path = cpu_profile_path(cache_root)
    peaks = _cached(path)
    if peaks is not None or not measure:
        return peaks
    logger.info("measuring this CPU's int8 kernels, matmuls and memory bandwidth (a few seconds, once; cached in "
                "%s)", path)
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


def describe_cpu_peaks(peaks: DevicePeaks, path: Path | None = None) -> str:
    """``conveyor profile``'s lines: the int8 peak with the kernels' path named (and every path measured), the
    bfloat16 and float32 matmul peaks, the read bandwidth, how they were measured and where they are cached."""
    giga = 1e9
    if peaks.int8_path:
        paths = ", ".join(
            f"{path} {rate / giga:,.0f}" + (f" (the kernels {kernel / giga:,.0f}, {kernel / rate:.0%})"
                                           if (kernel := peaks.int8_kernel_by_path.get(path)) else "")
            for path, rate in peaks.int8_by_path.items())
        integer = (f"int8 dot products {peaks.flops['int8'] / giga:,.0f} GOP/s; the packed-block kernels take the "
                   f"{peaks.int8_path} path here (GOP/s by path: {paths})")
    else:
        integer = "int8 dot products: not measured (the C++ kernels do not build here; GGUF blocks are widened)"
    lines = [
        peaks.name,
        f"  {integer}",
        f"  bfloat16 matmul {peaks.flops['bfloat16'] / giga:,.{0 if peaks.flops['bfloat16'] >= 10 * giga else 2}f} "
        "GFLOP/s"
        + (" (no 16-bit arithmetic: bfloat16 steps count at float32's rate)"
           if peaks.flops["bfloat16"] < peaks.flops["float32"] else "")
        + f", float32 matmul {peaks.flops['float32'] / giga:,.0f} GFLOP/s",
        f"  read bandwidth {peaks.bytes_per_second / giga:.1f} GB/s",
        f"  ({peaks.source})",
    ]
    if path is not None:
        lines.append(f"  cached in {path}: servers on this machine take each step's MFU against the int8 peak for "
                     "packed weights (GGUF blocks, quant int8 and int4) and the model dtype's for float ones, and "
                     "its MBU against the bandwidth")
    return "\n".join(lines)
