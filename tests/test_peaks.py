"""A CPU's measured peaks: the int8 peak of the packed-block kernels on the path they take, the profile's cache
key (CPU model, instruction-set flags, threads, the measurement's version), and the peak a step's weights are
measured against."""

from __future__ import annotations

import msgspec
import pytest

from conveyor import native
from conveyor.config import paths
from conveyor.entrypoints.cli import main
from conveyor.model import ggml
from conveyor.perf import peaks as peaks_module
from conveyor.perf.peaks import (
    INTEGER_BITS,
    KERNEL_PATHS,
    MEASUREMENT_VERSION,
    DevicePeaks,
    cpu_key,
    cpu_peaks,
    cpu_profile_path,
    gpu_peaks,
    integer_share,
    measure_int8,
    profile_cpu,
)

ZEN4 = ("processor\t: 0\nmodel name\t: AMD EPYC 9R14 96-Core Processor\n"
        "flags\t\t: fpu sse sse2 ssse3 fma avx avx2 avx512f avx512_vnni avx512_bf16 md_clear\n")


def test_the_profile_key_follows_the_cpu_model_its_isa_flags_threads_and_the_version(monkeypatch):
    key = cpu_key(ZEN4, 2)
    assert cpu_key(ZEN4, 2) == key
    assert cpu_key(ZEN4.replace("9R14", "7R13"), 2) != key  # another CPU model
    assert cpu_key(ZEN4.replace(" avx512_vnni", ""), 2) != key  # another instruction set: another kernel path
    assert cpu_key(ZEN4.replace("md_clear", "md_clear amx_int8 amx_tile"), 2) != key
    assert cpu_key(ZEN4, 1) != key  # the peaks are of all the threads
    # a flag that is no instruction set (a mitigation the kernel adds) measures nothing again
    assert cpu_key(ZEN4.replace(" md_clear", ""), 2) == key
    monkeypatch.setattr(peaks_module, "MEASUREMENT_VERSION", MEASUREMENT_VERSION + 1)
    assert cpu_key(ZEN4, 2) != key  # a new way of measuring


def _fake_profile(int8: float) -> DevicePeaks:
    return DevicePeaks("fake CPU (2 threads)", {"float32": 150e9, "bfloat16": 400e9, "float16": 400e9, "int8": int8},
                       30e9, "measured by the test", int8_path="avx2", int8_by_path={"avx2": int8},
                       version=MEASUREMENT_VERSION)


def test_the_cached_profile_is_measured_again_for_another_cpu_or_an_older_measurement(tmp_path, monkeypatch):
    """Measured once per key: again when the key changes (another CPU), not when it comes back; a profile cached by
    the older measurement (float matmuls only, no version) under this CPU's key is measured again, not read."""
    measured = []

    def measure() -> DevicePeaks:  # (each measurement a little different, as on a real machine)
        measured.append(_fake_profile(600e9 + len(measured)))
        return measured[-1]

    monkeypatch.setattr(peaks_module, "measure_cpu", measure)
    key = "zen4"
    monkeypatch.setattr(peaks_module, "_cpu_key", lambda: key)
    first = cpu_peaks(tmp_path)
    assert len(measured) == 1 and cpu_peaks(tmp_path) == first and len(measured) == 1
    assert cpu_profile_path(tmp_path) == cpu_profile_path(tmp_path, "zen4")

    key = "sapphire-rapids"
    second = cpu_peaks(tmp_path)
    assert len(measured) == 2 and second != first
    key = "zen4"
    assert cpu_peaks(tmp_path) == first and len(measured) == 2
    assert cpu_peaks(tmp_path, measure=False) == first

    # the file an older Conveyor wrote: a float32 matmul as the peak of every step
    key = "zen3"
    older = {"name": "AMD EPYC (2 threads)", "flops": {"float32": 146e9, "bfloat16": 146e9, "float16": 146e9},
             "bytes_per_second": 3e10, "source": "measured 2026-12-01 by conveyor profile", "memory_bytes": 0}
    cpu_profile_path(tmp_path).parent.mkdir(parents=True, exist_ok=True)
    cpu_profile_path(tmp_path).write_bytes(msgspec.json.encode(older))
    assert cpu_peaks(tmp_path, measure=False) is None
    third = cpu_peaks(tmp_path)
    assert len(measured) == 3 and third == measured[-1] and third.version == MEASUREMENT_VERSION
    assert msgspec.json.decode(cpu_profile_path(tmp_path).read_bytes(), type=DevicePeaks) == third


def test_measuring_again_on_a_busy_machine_lowers_no_peak(tmp_path, monkeypatch):
    """`conveyor profile` run while another process takes the cores measures less: each number cached is the
    higher of the two (the source says which were kept); a faster measurement raises them."""
    quiet = _fake_profile(615e9)
    busy = msgspec.structs.replace(_fake_profile(300e9), flops={"float32": 95e9, "bfloat16": 420e9,
                                                                 "float16": 420e9, "int8": 300e9},
                                   bytes_per_second=15e9)
    measurements = [quiet, busy]
    monkeypatch.setattr(peaks_module, "measure_cpu", lambda: measurements.pop(0))
    monkeypatch.setattr(peaks_module, "_cpu_key", lambda: "zen4")
    assert profile_cpu(tmp_path)[0] == quiet
    kept, _path = profile_cpu(tmp_path)
    assert kept.flops == {"float32": 150e9, "bfloat16": 420e9, "float16": 420e9, "int8": 615e9}
    assert kept.int8_by_path == {"avx2": 615e9} and kept.bytes_per_second == 30e9
    assert "kept from the profile cached before, higher: bandwidth, float32, int8" in kept.source
    assert cpu_peaks(tmp_path, measure=False) == kept


@pytest.mark.skipif(not native.load(), reason="the C++ kernels do not build here")
def test_the_int8_peak_is_measured_on_every_path_up_to_the_one_the_kernels_take():
    """Each path's peak bounds what the kernels reach on it: the kernels do the same dot products and more."""
    taken, by_path, kernels = measure_int8(repeats=1)
    assert taken == native.ggml_linear_path()
    expected = KERNEL_PATHS[1 : KERNEL_PATHS.index(taken) + 1] or ("scalar",)
    assert tuple(by_path) == tuple(kernels) == expected
    assert all(by_path[path] > 0 and 0 < kernels[path] < 1.2 * by_path[path] for path in expected), (by_path, kernels)


def test_the_integer_formats_carry_the_bits_of_their_blocks():
    """peaks.py sizes GGUF's blocks without importing torch: its bits a weight are conveyor.model.ggml's blocks'."""
    for format, (values, size) in ggml.BLOCKS.items():
        assert INTEGER_BITS[format] == pytest.approx(8 * size / values), format


def test_a_steps_peak_is_that_of_the_arithmetic_its_weights_take():
    cpu = _fake_profile(600e9)
    # the default model: Q4_1 layers and a Q8_0 embedding (its bytes by format), all through the int8 kernels
    default = {"Q4_1": 66_355_200, "Q8_0": 30_081_024}
    assert integer_share(default) == 1.0
    assert cpu.flops_for_weights(default, "bfloat16") == 600e9
    assert cpu.flops_for_weights({"bfloat16": 269_030_016}, "bfloat16") == 400e9
    assert cpu.flops_for_weights({"int8": 135_000_000, "copies": 10**9}, "bfloat16") == 600e9
    # as many weights in Q4_0 blocks (4.5 bits) as in bfloat16: half the step's FLOPs at each peak
    half = {"Q4_0": 9 * 1000, "bfloat16": 32 * 1000}
    assert integer_share(half) == pytest.approx(0.5)
    assert cpu.flops_for_weights(half, "bfloat16") == pytest.approx(1 / (0.5 / 600e9 + 0.5 / 400e9))
    # AVX2 alone: bfloat16 emulated, so a float model's steps count against float32's peak
    avx2 = DevicePeaks("avx2", {"float32": 150e9, "bfloat16": 0.3e9, "int8": 270e9}, 3e10, "test", int8_path="avx2",
                       int8_by_path={"avx2": 270e9}, version=MEASUREMENT_VERSION)
    assert avx2.flops_for_weights({"bfloat16": 1000}, "bfloat16") == 150e9
    assert avx2.flops_for_weights(default, "bfloat16") == 270e9
    # where the kernels do not run, and on a GPU (its GGUF kernel widens the blocks), the dtype's peak
    no_kernels = msgspec.structs.replace(cpu, int8_path="", int8_by_path={})
    assert no_kernels.flops_for_weights(default, "bfloat16") == 400e9
    h100 = gpu_peaks("NVIDIA H100 80GB HBM3")
    assert h100.flops_for_weights(default, "bfloat16") == h100.flops_for("bfloat16")


def test_conveyor_profile_prints_the_int8_and_bfloat16_peaks_with_the_kernel_path(tmp_path, monkeypatch, capsys):
    profile = DevicePeaks(
        "AMD EPYC (2 threads)", {"float32": 186e9, "bfloat16": 416e9, "float16": 416e9, "int8": 615e9}, 33.9e9,
        "measured by the test", int8_path="avx512_vnni", int8_by_path={"avx2": 276e9, "avx512_vnni": 615e9},
        version=MEASUREMENT_VERSION)
    monkeypatch.setattr(peaks_module, "measure_cpu", lambda: profile)
    monkeypatch.setattr(paths, "cache_root", lambda: tmp_path)
    assert main(["profile"]) == 0
    out = capsys.readouterr().out
    assert "int8 dot products 615 GOP/s" in out and "avx512_vnni path" in out and "avx2 276" in out
    assert "bfloat16 matmul 416 GFLOP/s" in out and "float32 matmul 186 GFLOP/s" in out
    assert "read bandwidth 33.9 GB/s" in out
    assert str(cpu_profile_path(tmp_path)) in out
