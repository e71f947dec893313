"""Triton GEMMs for int8 and fp8 weights against a float64 torch reference (TRITON_INTERPRET=1 on CPU).

Fresh random inputs each run, odd shapes (M in {1, 7, 33}; K and N not
multiples of any block size), the output poisoned first. The bound is
max |kernel - reference| / max |reference|, per activation dtype: float32
accumulation leaves ~1e-6; a bf16 or fp16 output rounds at 2^-8 or 2^-11.
"""

from __future__ import annotations

import pytest
import torch

from conveyor.model.formats import quantize_fp8
from conveyor.plugins.quant import kernels
from conveyor.plugins.quant.int8 import quantize_int8

pytestmark = pytest.mark.usefixtures("random_seed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5 if DEVICE == "cpu" else 2e-3, torch.float16: 2e-3, torch.bfloat16: 1e-2}
TOLERANCE_CPU = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
SHAPES = [(1, 200, 90), (7, 130, 33), (33, 77, 150)]  # (M, K, N)


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out.double().cpu() - expected).abs().max() / expected.abs().max())


def poisoned_launch(monkeypatch, fn, *args):
    """Run ``fn`` with torch.empty returning NaN-filled buffers, so unwritten outputs show."""
    real_empty = torch.empty

    def empty(*shape, **kwargs):
        return real_empty(*shape, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(kernels.torch, "empty", empty)
    try:
        return fn(*args)
    finally:
        monkeypatch.setattr(kernels.torch, "empty", real_empty)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_w8a16_matches_reference(monkeypatch, shape, dtype, fmt):
    m, k, n = shape
    quantize = quantize_int8 if fmt == "int8" else quantize_fp8
    w, w_scale = quantize(torch.randn(n, k))
    x = torch.randn(m, k).to(dtype)
    out = poisoned_launch(monkeypatch, kernels.w8a16_matmul, x.to(DEVICE), w.to(DEVICE), w_scale.to(DEVICE))
    assert out.dtype == dtype and out.shape == (m, n)
    expected = x.double() @ (w.double() * w_scale.double()[:, None]).T
    assert relative_error(out, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_fp8_matches_reference(monkeypatch, shape, dtype):
    m, k, n = shape
    w, w_scale = quantize_fp8(torch.randn(n, k))
    x = (torch.randn(m, k) * torch.rand(m, 1) * 4).to(dtype)  # rows of different magnitudes
    out = poisoned_launch(monkeypatch, kernels.w8a8_fp8_matmul, x.to(DEVICE), w.to(DEVICE), w_scale.to(DEVICE))
    # the reference quantizes each row of x to e4m3 on its own, independently of the kernel module, in float32
    # as the kernels do (in float64 a value on an e4m3 rounding midpoint can round the other way)
    x_scale = x.float().abs().amax(dim=1, keepdim=True) / 448
    xq = (x.float() / x_scale).to(torch.float8_e4m3fn).double() * x_scale.double()
    expected = xq @ (w.double() * w_scale.double()[:, None]).T
    assert relative_error(out, expected) < TOLERANCE[dtype]
    # and it stays near the unquantized product: e4m3 keeps 3 mantissa bits
    exact = x.double() @ (w.double() * w_scale.double()[:, None]).T
    assert relative_error(out, exact) < 0.1


def test_weight_quantizers_round_to_nearest():
    w = torch.randn(40, 50)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() == 127
    assert (q.double() * scale.double()[:, None] - w.double()).abs().max() <= scale.max() / 2 + 1e-6
    f, fscale = quantize_fp8(w)
    assert f.dtype == torch.float8_e4m3fn and f.float().abs().amax(dim=1).eq(448).all()
    # e4m3 rounds to within half a step: relative error <= 2^-4 for normal values
    rel = ((f.double() * fscale.double()[:, None] - w.double()).abs() / w.double().abs().clamp_min(1e-3))
    assert rel[w.abs() > fscale[:, None] * 2**-6].max() <= 2**-4 + 1e-6


# (int8pack and Q8_0 blocks need K % 32 == 0; 100 takes the other path)
@pytest.mark.parametrize("in_features", [128, 100])
@pytest.mark.parametrize("rows", [1, 64])  # below and above cpu_int8_max_rows
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", ["int8-q8_0", "int8-torch", "fp8-w8a16", "fp8-w8a16-torch", "fp8-w8a8"])
def test_cpu_paths_match_reference(monkeypatch, method, dtype, rows, in_features):
    """int8-q8_0: Q8_0 blocks through the C++ kernel (the activations rounded to int8 per 32 values; chosen where
    the kernel has its VNNI path, forced here), int8-torch: the torch paths; each against the per-channel int8
    weight worked out here. fp8-w8a16: the C++ kernel at every row count (forced), -torch: dequantized."""
    from conveyor import native
    from conveyor.plugins.quant import int8
    from conveyor.plugins.quant.fp8 import FP8, FP8Options
    from conveyor.plugins.quant.int8 import Int8Options, Int8WeightOnly

    cpu = torch.device("cpu")
    blocks = method == "int8-q8_0" and in_features % 32 == 0
    if method == "int8-q8_0" and not native.load():
        pytest.skip("the C++ kernels do not build here")
    monkeypatch.setattr(int8, "q8_0_kernel", lambda: method == "int8-q8_0")
    if method.startswith("int8"):
        quant = Int8WeightOnly(Int8Options(cpu_int8_max_rows=32), dtype, cpu)
    else:
        quant = FP8(FP8Options(activations="fp8" if method == "fp8-w8a8" else "bf16"), dtype, cpu)
    if method.startswith("fp8-w8a16"):  # (the C++ kernel where it builds, or the dequantizing path)
        if method == "fp8-w8a16" and not native.fp8_linear_supported():
            pytest.skip("the C++ fp8 kernel does not build here")
        quant.kernel, quant.fast_dense = method == "fp8-w8a16", True
    weight, bias = torch.randn(70, in_features), torch.randn(70)
    params = quant.prepare(weight, bias)
    assert ("q8_0" in params) == blocks
    x = torch.randn(rows, in_features).to(dtype)
    out = quant.linear(x, params)
    x_ref = x.double()
    if method == "fp8-w8a8":
        scale = x_ref.abs().amax(dim=1, keepdim=True) / 448
        x_ref = (x_ref / scale).to(torch.float8_e4m3fn).double() * scale
    if method.startswith("int8"):
        # (rounded in float32, as the method rounds: in float64 a value near a half step may round the other way)
        scale = weight.abs().amax(dim=1) / 127
        if blocks:  # (the scale a Q8_0 block stores: float16)
            scale = scale.half().float()
        w = (weight / scale[:, None]).round().clamp(-127, 127).double() * scale.double()[:, None]
    else:
        w = params["qweight"].double() * params["scale"].double()[:, None]
    expected = x_ref @ w.T + bias.to(dtype).double()
    assert out.dtype == dtype
    # (x rounded to int8 per 32 values: at most 1/254 of each block's largest value)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-2 if blocks else 1e-5
    assert relative_error(out, expected) < tolerance
    if method == "int8-torch":  # (and as a CPU without a fast dense matmul takes it: int8pack at any row count)
        quant.fast_dense = not quant.fast_dense
        assert relative_error(quant.linear(x, params), expected) < tolerance


def test_cpu_int8_shards_keep_their_rows_scale(monkeypatch):
    """A row-parallel int8 layer split in two column shards (Q8_0 blocks each) sums to the whole layer's product."""
    from conveyor import native
    from conveyor.plugins.quant import int8
    from conveyor.plugins.quant.int8 import Int8WeightOnly

    if not native.load():
        pytest.skip("the C++ kernels do not build here")
    monkeypatch.setattr(int8, "q8_0_kernel", lambda: True)
    quant = Int8WeightOnly(None, torch.float32, torch.device("cpu"))
    weight, x = torch.randn(50, 128), torch.randn(3, 128)
    whole = quant.linear(x, quant.prepare(weight))
    halves = [quant.prepare_input_shard(weight, cols) for cols in (slice(0, 64), slice(64, 128))]
    assert all("q8_0" in h and h["q8_0"].shape == (50, 2 * 34) for h in halves)
    parts = quant.linear(x[:, :64], halves[0]) + quant.linear(x[:, 64:], halves[1])
    # (each shard's rows carry the whole row's scale: the same products, summed in another order)
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 3, 5])
@pytest.mark.parametrize("in_features", [203, 64])
def test_cpu_fp8_kernel_matches_reference(rows, in_features):
    """The C++ kernel (tiles of two rows and four columns, K's tail past the last eight, a column tail) against
    float64 over the upcast weights; every finite e4m3 byte converted exactly."""
    from conveyor import native
    from conveyor.model.formats import quantize_fp8

    if not native.fp8_linear_supported():
        pytest.skip("the C++ fp8 kernel does not build here")
    q, scale = quantize_fp8(torch.randn(70, in_features))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x, bias = torch.randn(rows, in_features).to(dtype), torch.randn(70).to(dtype)
        out = native.fp8_linear(x, q, scale, bias)
        expected = x.double() @ (q.double() * scale.double()[:, None]).T + bias.double()
        assert out.dtype == dtype and relative_error(out, expected) < TOLERANCE_CPU[dtype]
    every = torch.arange(256, dtype=torch.uint8)
    every = every[(every & 0x7F) != 0x7F].view(torch.float8_e4m3fn)  # (0x7f, 0xff: NaN)
    # (row i of the identity picks value i of each of five weight rows)
    values = native.fp8_linear(torch.eye(len(every)), every.repeat(5, 1), torch.ones(5))
    assert torch.equal(values, every.float()[:, None].expand(-1, 5))


def test_cpu_fp8_upcast_is_exact_for_every_value():
    from conveyor.plugins.quant.fp8 import upcast

    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = ~every.float().isnan()
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(upcast(every, dtype)[finite], every.to(dtype)[finite])


def test_cpu_fp8_native_upcast_gives_torchs_bits():
    """The C++ pass that dequantizes a layer for a large batch (16 values a step, then K's tail) against torch's
    own float8 conversion and multiply: every finite e4m3 byte, random scales, the same bits in each dtype."""
    from conveyor import native

    if not native.fp8_linear_supported():
        pytest.skip("the C++ fp8 kernel does not build here")
    every = torch.arange(256, dtype=torch.uint8)
    every = every[(every & 0x7F) != 0x7F]  # (0x7f, 0xff: NaN)
    generator = torch.Generator().manual_seed(7)
    for k in (203, 64):
        q = every[torch.randint(len(every), (9, k), generator=generator)].view(torch.float8_e4m3fn)
        scale = torch.rand(9, generator=generator) * 10.0 ** torch.randint(-4, 2, (9,), generator=generator)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            expected = q.to(dtype) * scale[:, None].to(dtype)
            got = native.fp8_upcast(q, scale, dtype)
            assert got.dtype == dtype and torch.equal(got, expected), f"K={k} {dtype}"


@pytest.mark.parametrize("block", ["Q4_1", "Q4_0"])
@pytest.mark.parametrize("rows", [1, 17])
def test_cpu_int4_blocks_round_each_weight_and_multiply_them(block, rows):
    """int4 rounds each weight to within half its block's step (Q4_1: (max - min) / 15 over the block's 32
    values; Q4_0: max|w| / 8, a step at its clamped end) as the gguf package's reference quantizer does, and
    multiplies those weights
    (five blocks a row: the kernels' repacking pads an odd count); against float64."""
    from gguf import GGMLQuantizationType, quants

    from conveyor.plugins.quant.int4 import Int4, Int4Options

    torch.manual_seed(0)  # (the error of x's int8 rounding varies with x: the same x whatever ran before)
    quant = Int4(Int4Options(block=block), torch.float32, torch.device("cpu"))
    weight, bias = torch.randn(40, 160), torch.randn(40)
    params = quant.prepare(weight, bias)
    assert set(quant.formats(params)) == {block, "float32"}  # (the blocks, and the bias)
    kept = torch.from_numpy(quants.dequantize(quants.quantize(weight.numpy(), GGMLQuantizationType[block]),
                                              GGMLQuantizationType[block])).double()
    blocks = weight.double().reshape(40, 5, 32)
    if block == "Q4_1":
        step = (blocks.amax(-1) - blocks.amin(-1)) / 15
        bound = step / 2
    else:  # (-8 steps reach the largest magnitude, +7 only 7/8 of it: values past that clamp, within a step)
        step = blocks.abs().amax(-1) / 8
        bound = step
    # (and the float16 rounding of the scale, times up to 15 steps)
    assert ((kept.reshape(40, 5, 32) - blocks).abs() <= (bound * 1.01 + step * 15 * 2**-11)[..., None]).all()
    x = torch.randn(rows, 160)
    expected = x.double() @ kept.T + bias.double()
    # (x rounded to int8 per 32 values where the C++ kernels run)
    assert relative_error(quant.linear(x, params), expected) < 1e-2


# every GGUF block type the gguf method keeps, at the row counts of decodes, batches and prompt chunks
GGML_ROWS = [1, 3, 16, 17, 64, 300]


@pytest.mark.parametrize("format", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_ggml_blocks_matmul_matches_the_gguf_packages_dequantized_weights(monkeypatch, format):
    """The Triton GEMM over packed GGUF blocks (unpacked in registers) against float64 products with the gguf
    package's own dequantization of the same bytes: rows of decodes and prompt chunks (1 to 300), 37 output
    features (not a whole tile), 512 inputs (two K-quant blocks, 16 of the others); float32 activations
    (only the accumulation's rounding) and bfloat16 ones (the output's rounding)."""
    from conveyor.plugins.quant import ggml_kernels
    from tests.test_ggml import packed_random

    packed, weight = packed_random(format, 37, 512, seed=7)
    for rows in GGML_ROWS:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, 512).to(dtype)
            out = poisoned_launch(monkeypatch, ggml_kernels.ggml_matmul, x.to(DEVICE), packed.data.to(DEVICE),
                                  format)
            assert out.dtype == dtype and out.shape == (rows, 37)
            error = relative_error(out, x.double() @ weight.T)
            assert error < TOLERANCE[dtype], (format, rows, dtype, error)
