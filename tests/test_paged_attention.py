"""Paged KV cache attention (torch, C++ CPU kernel, Triton) against dense float64 attention: the whole
step path, from the KV cache manager's blocks to the worker's storage and backend."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from conveyor.attention import BACKENDS, select_backend
from conveyor.attention.backend import LayerAttention, StepAttention
from conveyor.attention.storage import KVStorage
from conveyor.kvcache import KVCacheSpec
from conveyor.messages import ScheduledRequest, StepInput
from conveyor.plugins.kvcache.paged import PagedKVCache, PagedOptions
from conveyor.request import Request
from conveyor.sampling import SamplingParams
from conveyor.worker.inputs import InputBuffers
from tests.helpers import reference_attention

pytestmark = pytest.mark.usefixtures("random_seed")

CPU = torch.device("cpu")
# the Triton kernels' device: the GPU where there is one, else the CPU under TRITON_INTERPRET=1 (tests/conftest.py)
TRITON = torch.device("cuda") if torch.cuda.is_available() else CPU


def step_attention(cache: PagedKVCache, backend, batch: list[tuple[Request, int]], num_decodes: int) -> StepAttention:
    """The attention function of a step over ``batch`` ((request, tokens this step), decodes first)."""
    requests = [
        ScheduledRequest(r.request_id, r.num_computed_tokens, [0] * n, cache.block_ids(r), SamplingParams())
        for r, n in batch
    ]
    buffers = InputBuffers(cache.block_size, backend.storage.device, tokens=1, rows=1, width=1)  # (they grow)
    return buffers.prepare(StepInput(requests, num_decodes), backend).attention


def fp8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """What an fp8 cache gives back: e4m3 values with one bf16 scale per token and head (amax -> 448)."""
    scale = (x.abs().amax(-1, keepdim=True) / 448).clamp_min(1e-8).bfloat16().double()
    return (x.double() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).double() * scale


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_mixed_batch_of_decodes_and_chunks_matches_dense_attention(backend, kv_dtype):
    """The whole step path: slot mapping, cache writes, then decode and prefill attention
    (the C++ kernels for "cpu"; the Triton kernels on the GPU, or under TRITON_INTERPRET=1 on a CPU).
    With an fp8 cache, what is read back from the cache is the fp8 round trip of K and V."""
    check_mixed_step(backend, kv_dtype, torch.float32, dim=16, tolerance={"rtol": 1e-4, "atol": 1e-5})


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_mixed_bf16_step_matches_dense_attention(backend):
    """bfloat16 with head_dim 64: on a CPU with AVX-512 BF16, "cpu" runs prompt chunks in its prefill kernel too."""
    check_mixed_step(backend, "auto", torch.bfloat16, dim=64, tolerance={"rtol": 3e-2, "atol": 3e-2})


@pytest.mark.parametrize("dtype, dim", [(torch.float32, 16), (torch.bfloat16, 64)])
@pytest.mark.parametrize("path", ["sdpa", "rows", "kernel"])
def test_every_cpu_prefill_path_matches_dense_attention(path, dtype, dim):
    """Whichever path the machine's measurement keeps for prompt chunks (the prefill kernel, the decode kernel a
    row per token, or SDPA over gathered blocks), forced here: chunks from position 0 and from inside their
    context, beside decodes, against float64 attention."""
    from conveyor import native

    if path == "kernel" and not (dtype == torch.bfloat16 and native.load() and native.prefill_supported(
            torch.empty(0, 1, dim, dtype=dtype), torch.empty(1, 1, dim, dtype=dtype))):
        pytest.skip("no prefill kernel on this CPU (AVX-512 BF16, a bfloat16 cache)")
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 3e-2, "atol": 3e-2}
    plan = [*PLAN, (200, 150, 50), (64, 63, 1), (70, 64, 6)]
    check_mixed_step("cpu", "auto", dtype, dim=dim, tolerance=tolerance, plan=plan, prefill_path=path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "params",
    [LayerAttention(0.3, window=7), LayerAttention(0.25, softcap=3.0), LayerAttention(0.3, window=12, softcap=2.0)],
    ids=["window", "softcap", "window-softcap"],
)
@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_sliding_window_and_soft_cap_match_dense_attention(backend, params, dtype):
    """Gemma's and Mistral's attention: a scale of the model's, a sliding window shorter than the contexts
    (decodes and chunks that start inside, at and past it), and scores soft-capped before the softmax.
    head_dim 64 in bfloat16 takes the C++ kernel's vector path; Triton runs under the interpreter."""
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 3e-2, "atol": 3e-2}
    check_mixed_step(backend, "auto", dtype, dim=16 if dtype == torch.float32 else 64, tolerance=tolerance,
                     params=params)


@pytest.mark.parametrize("kv_dtype, params", [
    ("auto", None), ("fp8", None), ("auto", LayerAttention(0.3, window=12, softcap=2.0)),
], ids=["plain", "fp8", "window-softcap"])
@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_batch_invariant_steps_match_dense_attention(backend, kv_dtype, params):
    """[engine] batch_invariant: every token of the step, prompt chunks' too, attends in the decode path (the torch
    backend's in fixed blocks of queries and keys); the results are still attention."""
    # (torch: the longest span several of its steps of keys; the kernels' key loops are the decodes' own)
    plan = [*PLAN, (150, 120, 30), (140, 139, 1)] if backend == "torch" else PLAN
    check_mixed_step(backend, kv_dtype, torch.float32, dim=16, tolerance={"rtol": 1e-4, "atol": 1e-5}, params=params,
                     batch_invariant=True, plan=plan)


# (total length, tokens already cached, tokens this step)
PLAN = [(9, 8, 1), (30, 29, 1), (1, 0, 1), (17, 0, 17), (40, 25, 15), (13, 12, 1)]


def check_mixed_step(backend: str, kv_dtype: str, dtype: torch.dtype, dim: int, tolerance: dict,
                     params: LayerAttention | None = None, batch_invariant: bool = False,
                     plan: list[tuple[int, int, int]] | None = None, prefill_path: str | None = None) -> None:
    heads, kv_heads = 6, 2
    spec = KVCacheSpec(1, kv_heads, dim, str(dtype).removeprefix("torch."), 512)
    cache = PagedKVCache(PagedOptions(block_size=4, num_blocks=200, dtype=kv_dtype), spec)
    device = TRITON if backend == "triton" else CPU
    attention_backend = select_backend(backend, device)(KVStorage(cache.layout, device), [params] if params else None,
                                                        batch_invariant)
    if prefill_path:  # (the measured choice, forced; "rows" makes every token a decode, in the input buffers)
        attention_backend.prefill_path = prefill_path
    attend = {"scale": params.scale, "window": params.window, "softcap": params.softcap} if params else {}
    # hand out blocks in random order so no block table is contiguous
    cache.free_blocks = OrderedDict.fromkeys(torch.randperm(200).tolist())
    plan = plan or PLAN
    params = SamplingParams()
    sequences = []
    for i, (length, cached, _) in enumerate(plan):
        r = Request(f"q{i}", list(range(length)), params, 512)
        q = torch.randn(length, heads, dim, dtype=dtype)
        k, v = torch.randn(length, kv_heads, dim, dtype=dtype), torch.randn(length, kv_heads, dim, dtype=dtype)
        if cached:  # write the earlier tokens into the cache with a first pass
            assert cache.allocate(r, cached)
            attention = step_attention(cache, attention_backend, [(r, cached)], 0)
            attention(0, q[:cached].to(device), k[:cached].to(device), v[:cached].to(device))
            r.num_computed_tokens = cached
        sequences.append((r, q, k, v))
    order = [(r, q, k, v, n) for (r, q, k, v), (_, _, n) in zip(sequences, plan)]
    decodes = [e for e in order if e[4] == 1]
    chunks = [e for e in order if e[4] != 1]
    batch = decodes + chunks
    for r, *_, n in batch:
        assert cache.allocate(r, n)
    attention = step_attention(cache, attention_backend, [(e[0], e[4]) for e in batch], len(decodes))
    q_flat = torch.cat([q[r.num_computed_tokens : r.num_computed_tokens + n] for r, q, k, v, n in batch])
    k_flat = torch.cat([k[r.num_computed_tokens : r.num_computed_tokens + n] for r, q, k, v, n in batch])
    v_flat = torch.cat([v[r.num_computed_tokens : r.num_computed_tokens + n] for r, q, k, v, n in batch])
    out = attention(0, q_flat.to(device), k_flat.to(device), v_flat.to(device)).cpu()
    row = 0
    for i, (r, q, k, v, n) in enumerate(batch):
        start = r.num_computed_tokens
        # the torch path attends a fresh prompt chunk's own K and V; everything else comes from the cache
        if kv_dtype == "fp8" and (batch_invariant or backend == "triton" or start > 0 or i < len(decodes)):
            k, v = fp8_round_trip(k), fp8_round_trip(v)
        expected = reference_attention(q[start : start + n], k[: start + n], v[: start + n], start, **attend)
        torch.testing.assert_close(out[row : row + n].double(), expected, **tolerance)
        row += n


def test_blocks_are_reused_after_free():
    spec = KVCacheSpec(1, 1, 4, "float32", 64)
    cache = PagedKVCache(PagedOptions(block_size=4, num_blocks=3), spec)
    a = Request("a", list(range(10)), SamplingParams(), 64)
    b = Request("b", list(range(10)), SamplingParams(), 64)
    assert cache.allocate(a, 10) and cache.usage() == 1.0
    assert not cache.allocate(b, 1)
    cache.free(a)
    assert cache.usage() == 0.0 and cache.allocate(b, 10)


def test_cpu_budget_sizes_the_pool_from_bytes_per_token():
    spec = KVCacheSpec(30, 3, 64, "bfloat16", 2048)
    assert spec.bytes_per_token == 2 * 30 * 3 * 64 * 2
    cache = PagedKVCache(PagedOptions(block_size=16, memory_gb=0.25), spec)
    # less one: the block the workers add to pad compiled steps
    assert cache.num_blocks == int(0.25 * 2**30 // (16 * spec.bytes_per_token)) - 1
    # what the worker allocates for that layout (the pad block included) fits the budget
    assert KVStorage(cache.layout, CPU).num_bytes <= 0.25 * 2**30


def test_gpu_budget_is_a_fraction_of_the_measured_free_memory():
    spec = KVCacheSpec(30, 3, 64, "bfloat16", 2048)
    free = 10 * 2**30
    cache = PagedKVCache(PagedOptions(block_size=16, memory_fraction=0.5, memory_gb=0.25), spec, free_memory=free)
    assert cache.num_blocks == int(0.5 * free // (16 * spec.bytes_per_token)) - 1


def test_fp8_cache_holds_nearly_twice_the_blocks():
    spec = KVCacheSpec(30, 3, 64, "bfloat16", 2048)
    bf16 = PagedKVCache(PagedOptions(block_size=16, memory_gb=0.25), spec)
    fp8 = PagedKVCache(PagedOptions(block_size=16, memory_gb=0.25, dtype="fp8"), spec)
    assert fp8.num_blocks >= 1.9 * bf16.num_blocks
    assert KVStorage(fp8.layout, CPU).num_bytes <= 0.25 * 2**30


def test_triton_on_a_cpu_needs_the_interpreter(monkeypatch):
    from conveyor.attention import BackendUnavailable

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendUnavailable, match="attention = 'triton': .*CUDA GPU.*TRITON_INTERPRET=1"):
        select_backend("triton", CPU)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_backend("triton", CPU) is BACKENDS["triton"]
    assert select_backend("torch", CPU) is BACKENDS["torch"]


def test_the_prefill_path_is_measured_once_per_machine_and_shape_and_kept(tmp_path, monkeypatch):
    """The C++ prefill kernel, the decode kernel a row per token, or SDPA for prompt chunks: measured by the first
    backend on the machine and kept, so that every later process (a server, an offline run) computes prompts the
    same way however busy the machine is when it starts; a process that measured at the same time as another
    takes the choice kept first; a kept choice this backend cannot take is measured again."""
    from conveyor import native
    from conveyor.attention.cpu_backend import CpuAttention, prefill_choice_path

    if not native.load():
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path))
    cache = PagedKVCache(PagedOptions(block_size=16, num_blocks=8), KVCacheSpec(1, 2, 64, "bfloat16", 512))
    storage = KVStorage(cache.layout, CPU)
    kernel = native.prefill_supported(torch.empty(0, 1, 64, dtype=torch.bfloat16), storage.k[0])
    offered = ["sdpa", "rows", "kernel"] if kernel else ["sdpa", "rows"]
    measured = []
    measure = CpuAttention._fastest_prefill
    monkeypatch.setattr(CpuAttention, "_fastest_prefill", lambda self, *shape: measured.append(shape) or
                        measure(self, *shape))
    first = CpuAttention(storage)
    path = prefill_choice_path(2, 64, torch.bfloat16)
    assert str(path).startswith(str(tmp_path)) and measured == [(2, 64, offered)]
    assert path.read_text().strip() == first.prefill_path and first.prefill_path in offered
    assert CpuAttention(storage).prefill_path == first.prefill_path and len(measured) == 1  # read, not measured
    for choice in offered:  # the kept choice rules
        path.write_text(choice + "\n")
        assert CpuAttention(storage).prefill_path == choice
    assert len(measured) == 1
    path.write_text("warp-drive\n")  # (a choice this backend does not know: measured again)
    CpuAttention(storage)
    assert len(measured) == 2

    def another_process_keeps_sdpa_meanwhile(self, *shape):
        path.write_text("sdpa\n")
        return "rows"  # (this one measured the rows faster)

    path.unlink()
    monkeypatch.setattr(CpuAttention, "_fastest_prefill", another_process_keeps_sdpa_meanwhile)
    assert CpuAttention(storage).prefill_path == "sdpa" and path.read_text().strip() == "sdpa"
