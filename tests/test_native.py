"""The C++ CPU kernels (conveyor.native) against independent references.

Paged decode and prefill attention against float64 dense attention (fresh
random inputs, shuffled blocks, unused slots poisoned with NaN); the fused element-wise
layers against the torch ops they replace; and the fallback to torch when
the kernels cannot be built.
"""

from __future__ import annotations

import os
import platform
import random
import shutil
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conveyor import native
from conveyor.attention.storage import SCALE_DTYPE, dequantize
from conveyor.model.formats import quantize_fp8
from conveyor.model.layers import RMSNorm, apply_rotary
from tests.helpers import paged_store, reference_attention, relative_error

pytestmark = [
    pytest.mark.skipif(not native.load(), reason="no C++ compiler: the CPU kernels cannot be built here"),
    pytest.mark.usefixtures("random_seed"),
]

# max |kernel - reference| / max |reference|
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize(
    "block_size, heads, kv_heads, head_dim, dtype",
    [
        (16, 9, 3, 64, torch.bfloat16),  # SmolLM2's shape: the AVX-512 BF16 path where the CPU has it
        (16, 8, 2, 128, torch.bfloat16),  # GQA 4:1, head_dim 128
        (5, 4, 4, 64, torch.float32),  # no GQA, blocks of 5
        (12, 6, 2, 24, torch.float16),  # head_dim and block size not powers of two (the generic loop)
        (8, 3, 1, 48, torch.bfloat16),  # bf16 with a head_dim the dpbf16 path does not take
        (32, 14, 2, 64, torch.bfloat16),  # 7 query heads per KV head: value accumulators in chunks of 4
    ],
)
def test_paged_decode_matches_reference_attention(block_size, heads, kv_heads, head_dim, dtype):
    lengths = [random.randint(1, 300) for _ in range(6)] + [1, block_size, block_size + 1]
    k_cache, v_cache, tables, keys, values = paged_store(lengths, kv_heads, head_dim, block_size, dtype)
    # q as the model hands it over: a view into the wider qkv rows
    qkv = torch.randn(len(lengths), (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(len(lengths), heads, head_dim)
    out = torch.full((len(lengths), heads, head_dim), float("nan"), dtype=dtype)
    native.paged_decode_attention(
        q, k_cache, v_cache, tables, torch.tensor(lengths, dtype=torch.int32), block_size, out=out
    )
    for i, n in enumerate(lengths):
        expected = reference_attention(q[i : i + 1], keys[i], values[i], n - 1)[0]
        assert relative_error(out[i], expected) < TOLERANCE[dtype], f"sequence {i} (length {n})"


def test_paged_decode_reads_an_fp8_cache_with_its_scales():
    block_size, heads, kv_heads, head_dim = 8, 6, 2, 64
    lengths = [random.randint(1, 100) for _ in range(5)]
    k_cache, v_cache, tables, _, _ = paged_store(lengths, kv_heads, head_dim, block_size, torch.bfloat16)
    # quantize every slot (unused ones hold NaN and are never read), as the cache stores them
    caches = []
    for cache in (k_cache, v_cache):
        values, scale = quantize_fp8(cache.transpose(0, 1).nan_to_num(), SCALE_DTYPE)
        caches += [values.view(torch.uint8).transpose(0, 1).contiguous(), scale.transpose(0, 1).contiguous()]
    k_bits, k_scale, v_bits, v_scale = caches
    q = torch.randn(len(lengths), heads, head_dim, dtype=torch.bfloat16)
    out = native.paged_decode_attention(
        q, k_bits, v_bits, tables, torch.tensor(lengths, dtype=torch.int32), block_size, k_scale, v_scale
    )
    # the reference reads the same fp8 values back through torch's own e4m3 conversion
    k_back, v_back = dequantize(k_bits, k_scale, torch.float64), dequantize(v_bits, v_scale, torch.float64)
    for i, n in enumerate(lengths):
        slots = torch.tensor([tables[i, p // block_size].item() * block_size + p % block_size for p in range(n)])
        keys, values = k_back[:, slots].transpose(0, 1), v_back[:, slots].transpose(0, 1)
        expected = reference_attention(q[i : i + 1], keys, values, n - 1)[0]
        assert relative_error(out[i], expected) < 2e-2, f"sequence {i} (length {n})"


def test_paged_decode_rejects_bad_tables():
    k_cache, v_cache, tables, _, _ = paged_store([5], 1, 16, 4, torch.float32)
    q = torch.randn(1, 1, 16)
    with pytest.raises(RuntimeError, match="block_tables"):
        native.paged_decode_attention(q, k_cache, v_cache, tables.long(), torch.tensor([5], dtype=torch.int32), 4)
    # a block past the end of the cache, or a length past the end of the table, is refused, not read
    with pytest.raises(RuntimeError, match="uses block"):
        native.paged_decode_attention(q, k_cache, v_cache, tables + 1000, torch.tensor([5], dtype=torch.int32), 4)
    with pytest.raises(RuntimeError, match="outside what its block table"):
        native.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor([9], dtype=torch.int32), 4)
    with pytest.raises(RuntimeError, match="multiple"):
        native.paged_decode_attention(
            torch.randn(1, 3, 16), k_cache.expand(2, -1, -1).contiguous(), v_cache.expand(2, -1, -1).contiguous(),
            tables, torch.tensor([5], dtype=torch.int32), 4,
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_torch(dtype, with_residual):
    h = torch.randn(37, 576, dtype=dtype) * 3
    delta = torch.randn(37, 576, dtype=dtype) if with_residual else None
    weight = torch.randn(576, dtype=dtype)
    h_ref, h_ours = h.clone(), h.clone()
    torch_norm, native_norm = RMSNorm(1e-5), RMSNorm(1e-5, fused=True)
    torch_norm.weight = native_norm.weight = weight
    expected = torch_norm(h_ref, delta)
    out = native_norm(h_ours, delta)
    # the residual add lands in h, exactly as torch rounds it
    assert torch.equal(h_ours, h_ref)
    # the float32 sum of squares is reordered: a normalized value may round one unit differently
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out, expected, rtol=4 * eps, atol=4 * eps)
    if dtype != torch.float32:
        assert (out != expected).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_silu_mul_matches_torch(dtype):
    gate_up = torch.randn(33, 2 * 1536, dtype=dtype) * 4
    gate, up = gate_up.split(1536, dim=-1)
    expected = F.silu(gate) * up
    out = native.silu_mul(gate_up)
    assert out.shape == expected.shape
    # exp may differ from torch's in the last float32 bit: a product may round one unit differently
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out, expected, rtol=4 * eps, atol=1e-6)
    if dtype != torch.float32:
        assert (out != expected).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_in_place_on_the_qkv_buffer_matches_torch(dtype):
    tokens, heads, kv_heads, head_dim = 21, 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    angles = torch.randn(tokens, head_dim // 2, dtype=torch.float64) * 10
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    v_before = v.clone()
    native.rotary_(q, cos, sin)  # strided views into qkv
    native.rotary_(k, cos, sin)
    tolerance = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 0, "atol": 0}
    torch.testing.assert_close(q, expected_q, **tolerance)
    torch.testing.assert_close(k, expected_k, **tolerance)
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(dtype):
    """[engine] batch_invariant: each fused op gives 16,384 rows the same bits in one call (tasks of rows spread over
    the threads) as in calls of 16 rows (each run in the calling thread). Once the two paths were compiled apart, and
    about one row in a thousand of RMSNorm came out a bit different."""
    rows, hidden = 16384, 576
    h, delta = (torch.randn(rows, hidden) * 10).to(dtype), torch.randn(rows, hidden).to(dtype)
    weight = torch.empty(hidden).uniform_(0.05, 0.5).to(dtype)
    gate_up = torch.randn(rows, 2 * 256).to(dtype)
    qk = torch.randn(rows, 4, 64).to(dtype)
    angles = torch.rand(rows, 32) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)

    def ops(part: slice) -> tuple[torch.Tensor, ...]:
        return (native.rms_norm(h[part].clone(), weight, 1e-5, delta[part]), native.silu_mul(gate_up[part]),
                native.rotary_(qk[part].clone(), cos[part], sin[part]))

    together = ops(slice(None))
    apart = [torch.cat(parts) for parts in zip(*(ops(slice(r, r + 16)) for r in range(0, rows, 16)))]
    for name, a, b in zip(("rms_norm", "silu_mul", "rotary"), apart, together):
        differ = (a != b).flatten(1).any(1).nonzero().flatten().tolist()
        assert not differ, f"{name}: rows {differ[:5]} differ"


def test_each_checkout_and_environment_builds_in_its_own_directory(tmp_path):
    """Two checkouts of the same sources (or one checkout in two environments) build in two directories: torch's
    build files name the sources and torch's headers by absolute path, so one directory shared between them would
    be rebuilt each time the other one loaded."""
    here = native.build_name()
    assert native.build_name(native.CSRC, sys.prefix) == here  # the same checkout finds its build again
    other = shutil.copytree(native.CSRC, tmp_path / "checkout" / "csrc")
    assert native.build_name(other) != here
    assert native.build_name(prefix=str(tmp_path / "venv")) != here
    ninja = (native.cache_dir() / here / "build.ninja").read_text()  # (built by the skip check above)
    assert str(native.CSRC) in ninja


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the other targets are x86 CPUs")
def test_every_source_compiles_for_the_other_x86_cpus():
    """The build is for this CPU (-march=native), so the code guarded for other CPUs is never compiled here: each
    source is checked (syntax and types, no code generated) for a CPU without AVX2 (the portable paths), one with
    AVX2 alone, and the other AVX-512 family: with AMX where this CPU has none (Intel since Sapphire Rapids),
    without it where it has (AVX-512 VNNI and BF16 alone, as AMD Zen 4)."""
    from torch.utils import cpp_extension

    amx = "amx_int8" in Path("/proc/cpuinfo").read_text()
    targets = ["x86-64", "haswell", "cooperlake" if amx else "sapphirerapids"]
    flags = [flag for flag in native.CFLAGS if not flag.startswith(("-march", "-O"))]
    includes = [f"-I{path}" for path in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    compiler = os.environ.get("CXX", "c++")

    def check(target: str, source: Path) -> str | None:
        command = [compiler, f"-march={target}", "-fsyntax-only", "-w", *flags, *includes, str(source)]
        result = subprocess.run(command, capture_output=True, text=True)
        return None if result.returncode == 0 else f"{source.name} for -march={target}:\n{result.stderr[-2000:]}"

    jobs = [(target, source) for target in targets for source in native.SOURCES]
    with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
        failures = [failure for failure in pool.map(lambda job: check(*job), jobs) if failure]
    assert not failures, "\n".join(failures)


def test_without_a_compiler_everything_falls_back_to_torch(monkeypatch, caplog):
    from torch.utils import cpp_extension

    from conveyor.attention import BackendUnavailable, select_backend

    cpu = torch.device("cpu")
    assert select_backend("auto", cpu).name == "cpu"  # the kernels built here
    assert select_backend("auto", cpu).fused_layers

    def no_compiler(*args, **kwargs):
        raise RuntimeError("c++: command not found")

    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    with caplog.at_level("WARNING", logger="conveyor"):
        backend = select_backend("auto", cpu)
    assert backend.name == "torch" and not backend.fused_layers  # attention and layers both in torch ops
    assert "c++: command not found" in caplog.text and "torch" in caplog.text
    with pytest.raises(BackendUnavailable, match="attention = 'cpu': the C\\+\\+ kernels could not be built"):
        select_backend("cpu", cpu)


@pytest.mark.skipif(
    not native.prefill_supported(torch.empty(0, 1, 64, dtype=torch.bfloat16), torch.empty(1, 1, 64, dtype=torch.bfloat16)),
    reason="the prefill kernel needs AVX-512 BF16",
)
@pytest.mark.parametrize("block_size, heads, kv_heads, head_dim", [(16, 9, 3, 64), (8, 8, 2, 128), (5, 4, 4, 64)])
def test_paged_prefill_chunks_match_reference_attention(block_size, heads, kv_heads, head_dim):
    # (tokens already cached, chunk length): fresh prompts, continued chunks, one-token chunks, a tile edge
    plan = [(0, random.randint(17, 90)), (random.randint(1, 60), random.randint(2, 40)), (100, 1), (0, 1), (15, 17)]
    lengths = [start + n for start, n in plan]
    k_cache, v_cache, tables, keys, values = paged_store(lengths, kv_heads, head_dim, block_size, torch.bfloat16)
    chunks = [torch.randn(n, heads, head_dim, dtype=torch.bfloat16) for _, n in plan]
    q = torch.cat(chunks)
    rows = [sum(n for _, n in plan[:i]) for i in range(len(plan))]
    out = torch.full_like(q, float("nan"))

    def int32(values):
        return torch.tensor(values, dtype=torch.int32)

    native.paged_prefill_attention(
        q, k_cache, v_cache, tables, int32(rows), int32([n for _, n in plan]), int32([s for s, _ in plan]),
        block_size, out,
    )
    for i, ((start, n), row) in enumerate(zip(plan, rows)):
        expected = reference_attention(chunks[i], keys[i], values[i], start)
        assert relative_error(out[row : row + n], expected) < TOLERANCE[torch.bfloat16], f"chunk {i} {plan[i]}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_store_kv_writes_what_index_copy_writes(dtype):
    kv_heads, head_dim, slots = 3, 64, 160
    qkv = torch.randn(7, (9 + 2 * kv_heads) * head_dim).to(dtype)  # k, v as views into the qkv rows
    k = qkv[:, 9 * head_dim : 12 * head_dim].view(7, kv_heads, head_dim)
    v = qkv[:, 12 * head_dim :].view(7, kv_heads, head_dim)
    slot_mapping = torch.tensor(random.sample(range(slots), 7))
    k_cache, v_cache = torch.randn(kv_heads, slots, head_dim).to(dtype), torch.randn(kv_heads, slots, head_dim).to(dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_k.index_copy_(1, slot_mapping, k.transpose(0, 1))
    expected_v.index_copy_(1, slot_mapping, v.transpose(0, 1))
    native.store_kv(k_cache, v_cache, slot_mapping, k, v)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    with pytest.raises(RuntimeError, match=f"goes to slot {slots} of {slots}"):
        native.store_kv(k_cache, v_cache, torch.tensor([0, 1, 2, 3, 4, 5, slots]), k, v)


def test_a_build_lock_left_by_a_build_that_died_is_removed_and_a_live_one_kept(tmp_path):
    """torch's builder waits forever for the lock a killed build leaves; the loader removes one that old."""
    lock = tmp_path / "lock"
    lock.touch()
    assert not native.clear_stale_lock(tmp_path) and lock.exists()  # (a build running now)
    old = time.time() - native.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    assert native.clear_stale_lock(tmp_path) and not lock.exists()
    assert not native.clear_stale_lock(tmp_path)  # (no lock: nothing to do)


def test_a_first_build_says_each_source_as_it_compiles(tmp_path, caplog):
    """The lines a build prints: one a source, when its object file appears, with how many of how many."""
    import logging

    from conveyor.native.build_progress import BuildProgress

    sources = [tmp_path / "a.cpp", tmp_path / "b.cpp"]
    progress = BuildProgress(tmp_path, sources, interval=3600)  # (polled by hand here)
    with caplog.at_level(logging.INFO, logger="conveyor"):
        assert progress.poll() == []
        (tmp_path / "b.o").touch()
        assert progress.poll() == ["b"]
        (tmp_path / "a.o").touch()
        progress.stop()
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(",")[0].strip() for line in lines] == ["b.cpp compiled: 1 of 2", "a.cpp compiled: 2 of 2"]
