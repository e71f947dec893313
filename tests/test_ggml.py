"""GGUF's quantized blocks kept packed: the torch dequantizers and the C++ kernels (every path built here,
forced) against the gguf package's own dequantizer and a float64 matmul; shards along whole blocks; the
``gguf`` quant method inside the model against the same model dequantized."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from conveyor import native
from conveyor.model import ggml
from conveyor.native import gemm_choice
from conveyor.native.gemm_choice import amx_from, choose_amx_rows
from conveyor.quant import FP8_TYPE_ID, NativeWeight
from tests.kquants import quantize

# the GGUF types (not Q4_X2, the kernels' own layout of two of them)
TYPES = [t for t in ggml.BLOCKS if t in gguf.GGMLQuantizationType.__members__]


def packed_random(format: str, rows: int, columns: int, seed: int) -> tuple[ggml.PackedWeight, torch.Tensor]:
    """Random weights in ``format`` and the gguf package's float64 reading of them; "Q4_0>X2" and "Q4_1>X2":
    those formats repacked as the kernels read them (columns a multiple of 64)."""
    if format.endswith(">X2"):
        packed, reference = packed_random(format[:4], rows, columns, seed)
        return ggml.repack(packed), reference
    rng = np.random.default_rng(seed)
    # (rows of different magnitudes: the scales differ from row to row and block to block)
    weight = rng.standard_normal((rows, columns)).astype(np.float32) * rng.uniform(0.01, 2.0, (rows, 1))
    qtype = gguf.GGMLQuantizationType[format]
    data = np.ascontiguousarray(quantize(weight, qtype))
    reference = torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float64))
    return ggml.PackedWeight(format, torch.from_numpy(data), columns), reference


@pytest.mark.parametrize("format", TYPES)
def test_dequantize_equals_the_gguf_package(format):
    packed, reference = packed_random(format, 9, 512, seed=1)
    assert torch.equal(ggml.dequantize(packed).double(), reference)
    rows = torch.tensor([8, 0, 3, 3])
    assert torch.equal(ggml.dequantize_rows(packed, rows, torch.float32).double(), reference[rows])


@pytest.mark.parametrize("format", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("columns", [512, 544])
def test_repacking_keeps_every_value(format, columns):
    packed, reference = packed_random(format, 5, columns, seed=5)
    repacked = ggml.repack(packed)
    assert repacked.format == "Q4_X2" and repacked.data.numel() == 5 * (columns + columns % 64) // 64 * 40
    values = ggml.dequantize(repacked).double()
    assert torch.equal(values[:, :columns], reference)
    assert not values[:, columns:].any()  # (the zero block an odd row gets)


@pytest.mark.parametrize("format", TYPES)
def test_rows_and_block_aligned_columns_are_the_same_values(format):
    packed, reference = packed_random(format, 6, 1024, seed=2)
    values = ggml.BLOCKS[format][0]
    assert torch.equal(ggml.dequantize(packed.rows(2, 5)).double(), reference[2:5])
    shard = packed.columns(slice(values, 3 * values))
    assert shard.in_features == 2 * values
    assert torch.equal(ggml.dequantize(shard).double(), reference[:, values : 3 * values])
    assert packed.columns(slice(16, 16 + values)) is None  # (not on a block edge)


PATHS = ["scalar", "avx2", "avx512_vnni", "amx"]  # (each includes the ones before it)


def kernel_paths() -> list[str]:
    """Every path of the kernel built here, forced in turn."""
    if not native.load():
        return []
    return PATHS[: PATHS.index(native.ggml_linear_path()) + 1]


def activation_bound(x: torch.Tensor, weight: torch.Tensor, group: int = 32) -> torch.Tensor:
    """How far x's rounding to int8 per ``group`` values (scale max|x| / 127, so at most half a step per value)
    can move each output: the sum over groups of half a step times the weights' absolute sum there."""
    steps = x.double().reshape(x.shape[0], -1, group).abs().amax(-1) / 127
    return (steps / 2) @ weight.abs().reshape(weight.shape[0], -1, group).sum(-1).T


@pytest.mark.skipif(not kernel_paths(), reason="the C++ kernels do not build here")
@pytest.mark.parametrize("path", kernel_paths())
@pytest.mark.parametrize("format", [*TYPES, "Q4_0>X2", "Q4_1>X2"])
def test_kernel_matches_float64_within_the_activation_rounding(format, path, random_seed):
    values = max(ggml.BLOCKS[format[:4]][0], 64 if format.endswith("X2") else 0)
    # odd output counts (tails of the 4- and 2-column tiles), two input widths, rows across the 4-row tiles
    for rows_out, columns, seed in ((37, 2 * values, 0), (5, 3 * max(values, 64), 1)):
        packed, weight = packed_random(format, rows_out, columns, seed=random_seed + seed)
        for m in (1, 2, 3, 7, 16, 17, 64, 300):  # (VNNI panels from 3 rows, AVX2 from 16)
            x = torch.randn(m, columns, generator=torch.Generator().manual_seed(random_seed + m))
            reference = x.double() @ weight.T
            bias = torch.randn(rows_out)
            y = native.ggml_linear(x, packed.data, ggml.TYPE_IDS[packed.format], path=path)
            error = (y.double() - reference).abs()
            # plus float32 rounding of the sums
            allowed = activation_bound(x, weight) + 1e-5 * (x.double().abs() @ weight.abs().T) + 1e-6
            assert (error <= allowed).all(), f"{format} {path} M={m}: worst {(error / allowed).max():.3f} of the bound"
            # the rounding does happen: a kernel that ignored the activations' scales would not be this close
            assert error.max() > 0
            # bias, bfloat16 in and out
            y16 = torch.ops.conveyor_cpu.ggml_linear  # (the op itself: the bias goes into the kernel)
            out = torch.full((m, rows_out), float("nan"), dtype=torch.bfloat16)
            y16(x.bfloat16(), packed.data, ggml.TYPE_IDS[packed.format], bias.bfloat16(), out, path)
            x16, bias16 = x.bfloat16().double(), bias.bfloat16().double()
            expected = x16 @ weight.T + bias16
            # the activation rounding, then the output's own rounding to bfloat16 (half a unit in its last place)
            allowed16 = activation_bound(x16, weight) + 1e-5 * (x16.abs() @ weight.abs().T) + expected.abs() / 256
            assert ((out.double() - expected).abs() <= allowed16 + 1e-6).all(), f"{format} {path} M={m} bfloat16"


@pytest.mark.skipif(not kernel_paths(), reason="the C++ kernels do not build here")
@pytest.mark.parametrize("path", kernel_paths())
@pytest.mark.parametrize("columns", [1536, 2048, 8192, 8960], ids=lambda k: f"K{k}")
def test_kernel_matches_float64_at_the_input_widths_of_1b_models(columns, path, random_seed):
    """The widths Llama-3.2-1B (hidden 2,048, intermediate 8,192) and Qwen2.5-1.5B (1,536 and 8,960) feed their
    layers, in the formats their GGUFs hold, at the row counts of decodes and prompt chunks: more sub-blocks per
    row than SmolLM2's 576 and 1,536 (panels of scales, prefetches running ahead through longer rows)."""
    for format in ("Q4_0>X2", "Q4_1>X2", "Q8_0", "Q4_K", "Q5_K", "Q6_K"):
        packed, weight = packed_random(format, 33, columns, seed=random_seed + columns)
        for m in (1, 16, 64, 256):
            x = torch.randn(m, columns, generator=torch.Generator().manual_seed(random_seed + m))
            y = native.ggml_linear(x, packed.data, ggml.TYPE_IDS[packed.format], path=path)
            error = (y.double() - x.double() @ weight.T).abs()
            allowed = activation_bound(x, weight) + 1e-5 * (x.double().abs() @ weight.abs().T) + 1e-6
            assert (error <= allowed).all(), f"{format} {path} K={columns} M={m}: worst {(error / allowed).max():.3f}"


@pytest.mark.skipif(not kernel_paths(), reason="the C++ kernels do not build here")
@pytest.mark.parametrize("path", kernel_paths())
@pytest.mark.parametrize("format", [*TYPES, "Q4_1>X2"])
def test_a_row_gives_the_same_bits_alone_and_among_others(format, path):
    """Whatever the step's other rows and however many (the tiles for a few rows, the batched path for more): a
    prompt whose start is in the prefix cache computes its last token alone, and a seeded sample must not
    change with that."""
    values = max(ggml.BLOCKS[format[:4]][0], 64 if format.endswith("X2") else 0)
    packed, _ = packed_random(format, 37, 3 * values, seed=3)
    x = torch.randn(40, 3 * values, generator=torch.Generator().manual_seed(5))
    alone = torch.cat([native.ggml_linear(x[i : i + 1], packed.data, ggml.TYPE_IDS[packed.format], path=path)
                       for i in range(len(x))])
    for rows in (3, 9, 20, 40):  # (tiles; the batched path from 8 rows, 16 with AVX2 alone, 32 with AMX)
        together = native.ggml_linear(x[:rows], packed.data, ggml.TYPE_IDS[packed.format], path=path)
        assert torch.equal(together, alone[:rows]), f"{format} {path}: {rows} rows"


@pytest.mark.skipif(not kernel_paths(), reason="the C++ kernels do not build here")
@pytest.mark.parametrize("path", kernel_paths())
def test_q8_0r_rows_match_float64_and_q8_0_except_on_amx_panels(path):
    """Q8_0R (the int8 method's Q8_0 blocks, one scale a row): on the AMX path, steps of 16 rows or more quantize
    x per 64 values and stay within that rounding of a float64 product; every other step is Q8_0's, bit for bit."""
    from conveyor.plugins.quant.int8 import q8_0_blocks, quantize_int8

    generator = torch.Generator().manual_seed(11)
    for rows_out, columns in ((37, 128), (300, 192), (5, 96), (7, 64)):  # (96: per 32 throughout; 64: one group)
        weight = torch.randn(rows_out, columns, generator=generator) * torch.rand(rows_out, 1, generator=generator)
        q, scale = quantize_int8(weight, (weight.abs().amax(1) / 127).half().float())
        blocks, reference_weight = q8_0_blocks(q, scale), q.double() * scale.double()[:, None]
        for m in (1, 3, 16, 17, 64, 300):
            x = torch.randn(m, columns, generator=generator) * torch.rand(1, columns, generator=generator)
            y = native.ggml_linear(x, blocks, ggml.TYPE_IDS["Q8_0R"], path=path)
            as_q8_0 = native.ggml_linear(x, blocks, ggml.TYPE_IDS["Q8_0"], path=path)
            per_64 = path == "amx" and m >= 16 and columns % 64 == 0
            if not per_64:
                assert torch.equal(y, as_q8_0), f"{path} {rows_out}x{columns} M={m}"
                continue
            reference = x.double() @ reference_weight.T
            error = (y.double() - reference).abs()
            allowed = activation_bound(x, reference_weight, 64) + 1e-5 * (x.double().abs() @ reference_weight.abs().T)
            assert (error <= allowed + 1e-6).all(), f"{rows_out}x{columns} M={m}: {(error / allowed).max():.3f}"
            # per 64, not per 32: some outputs leave the per-32 path's bits
            assert not torch.equal(y, as_q8_0)
            for dtype, rounding in ((torch.bfloat16, 256), (torch.float16, 2048)):  # (half the output's last place)
                out = torch.empty(m, rows_out, dtype=dtype)
                torch.ops.conveyor_cpu.ggml_linear(x.to(dtype), blocks, ggml.TYPE_IDS["Q8_0R"], None, out, path)
                x16 = x.to(dtype).double()
                expected = x16 @ reference_weight.T
                allowed16 = activation_bound(x16, reference_weight, 64) + expected.abs() / rounding + 1e-5 * (
                    x16.abs() @ reference_weight.abs().T)
                assert ((out.double() - expected).abs() <= allowed16 + 1e-6).all(), f"M={m} {dtype}"


@pytest.fixture(autouse=True)
def amx_from_32_rows():
    """The kernel tests force each path; on the AMX one, its panels run from 32 rows, whatever a model loaded
    earlier in this process chose (conveyor.native.gemm_choice)."""
    if not native.load():
        yield
        return
    before = native.amx_min_rows()
    native.set_amx_min_rows(32)
    yield
    native.set_amx_min_rows(before)


def test_amx_takes_over_from_the_fewest_rows_it_won_at_and_at_every_count_above():
    assert amx_from({32: (1.0, 0.9), 64: (1.0, 1.1), 128: (1.0, 2.0), 256: (1.0, 2.0)}) == 64
    assert amx_from({32: (0.5, 0.9), 64: (2.0, 1.1), 128: (1.0, 2.0)}) == 128  # (a loss in between: above it)
    assert amx_from({64: (0.5, 0.9), 32: (0.5, 0.9)}) == 32  # (in any order)
    assert amx_from({32: (0.5, 0.9), 64: (2.0, 1.1)}) is None  # (lost at the most rows)


@pytest.mark.skipif(not kernel_paths(), reason="the C++ kernels do not build here")
def test_the_rows_from_which_amx_runs_are_chosen_where_the_cpu_has_it():
    """Timed against VNNI at load where the fastest path is AMX, and set (a count timed, or never); elsewhere, and
    for weights AMX does not take (Q6_K, fp8), nothing is chosen and nothing changes."""
    q6k, _ = packed_random("Q6_K", 64, 256, seed=1)
    q4, _ = packed_random("Q4_0", 96, 128, seed=2)
    fp8 = NativeWeight(torch.zeros(8, 32, dtype=torch.float8_e4m3fn), FP8_TYPE_ID, torch.ones(8))
    assert choose_amx_rows([NativeWeight(q6k.data, ggml.TYPE_IDS["Q6_K"]), fp8]) is None
    assert native.amx_min_rows() == 32
    weights = [NativeWeight(q6k.data, ggml.TYPE_IDS["Q6_K"]), NativeWeight(q4.data, ggml.TYPE_IDS["Q4_0"])]
    chosen = choose_amx_rows(weights)
    if native.ggml_linear_path() == "amx":
        assert chosen in (*gemm_choice.ROWS, gemm_choice.NEVER) and native.amx_min_rows() == chosen
    else:
        assert chosen is None and native.amx_min_rows() == 32


@pytest.mark.skipif(not kernel_paths(), reason="the C++ kernels do not build here")
def test_the_choice_times_both_paths_on_the_largest_weight_amx_takes(monkeypatch):
    """The choice as it runs on an AMX CPU, on any CPU: the paths' names go to this CPU's best (the kernel checks
    each call's shapes), and the largest weight of a type AMX takes is the one timed, by both paths at each
    count of rows."""
    small, _ = packed_random("Q4_0", 32, 128, seed=2)
    large, _ = packed_random("Q8_0", 96, 256, seed=3)
    q6k, _ = packed_random("Q6_K", 512, 256, seed=1)
    calls = []
    real, best = native.ggml_linear, kernel_paths()[-1]

    def ggml_linear(x, weight, type_id, bias=None, path=None):
        calls.append((weight.data_ptr(), x.shape[0], path))
        return real(x, weight, type_id, bias, path=best)

    monkeypatch.setattr(native, "ggml_linear_path", lambda: "amx")
    monkeypatch.setattr(native, "ggml_linear", ggml_linear)
    chosen = choose_amx_rows([NativeWeight(w.data, ggml.TYPE_IDS[w.format]) for w in (small, q6k, large)])
    assert chosen in (*gemm_choice.ROWS, gemm_choice.NEVER) and native.amx_min_rows() == chosen
    assert {ptr for ptr, _, _ in calls} == {large.data.data_ptr()}
    timed = {(r, p) for r in gemm_choice.ROWS for p in ("amx", "avx512_vnni")}
    assert {(rows, path) for _, rows, path in calls} == timed


@pytest.mark.skipif(not kernel_paths(), reason="the C++ kernels do not build here")
def test_kernel_refuses_a_weight_of_the_wrong_width():
    packed, _ = packed_random("Q8_0", 4, 64, seed=4)
    with pytest.raises(RuntimeError, match="weight must be a contiguous uint8"):
        native.ggml_linear(torch.randn(1, 96), packed.data, ggml.TYPE_IDS["Q8_0"])
    with pytest.raises(RuntimeError, match="not a multiple"):
        native.ggml_linear(torch.randn(1, 48), packed.data, ggml.TYPE_IDS["Q8_0"])


def model_logits(path, quant) -> tuple[torch.Tensor, object]:
    from tests.helpers import cpu_model, dense_attention

    model = cpu_model(path, quant)
    sequences = [[5, 17, 3, 88, 41, 2, 9], [60, 1, 33], [7] * 12]
    ids = torch.tensor([t for s in sequences for t in s])
    positions = torch.tensor([p for s in sequences for p in range(len(s))])
    with torch.inference_mode():
        return model.compute_logits(model.forward(ids, positions, dense_attention([len(s) for s in sequences]))), model


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("format", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_the_gguf_method_keeps_the_file_packed_and_computes_the_dequantized_model(tmp_path, format, tied,
                                                                                  monkeypatch):
    """A tiny Llama written in each format: the gguf method holds exactly the file's bytes for every 2-D weight
    (embedding and head included); without the C++ kernels (dequantized per call) its logits are the
    dequantized model's; with them, within what the activations' int8 rounding moves."""
    from conveyor.plugins.quant import gguf as gguf_method
    from conveyor.plugins.quant.none import NoQuant
    from tests.gguf_writer import write_gguf
    from tests.test_model import tiny_hf_model

    model = tiny_hf_model(hidden_size=256, intermediate_size=512, tie_word_embeddings=tied)
    path = tmp_path / f"tiny-{format}.gguf"
    write_gguf(path, model, gguf.GGMLQuantizationType[format], quantize)
    cpu = torch.device("cpu")
    expected, _ = model_logits(path, NoQuant(None, torch.float32, cpu))
    reader = gguf.GGUFReader(str(path))
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors)

    monkeypatch.setattr(gguf_method, "kernels_run", lambda x: False)
    fallback, packed_model = model_logits(path, gguf_method.GGUFQuant(None, torch.float32, cpu))
    torch.testing.assert_close(fallback, expected, rtol=1e-4, atol=1e-4)
    assert packed_model.embed is None
    # (a tied Q4_0 / Q4_1 table is repacked with its head, one copy for both)
    assert packed_model.packed_embed.format == ("Q4_X2" if tied and format in ("Q4_0", "Q4_1") else format)
    assert packed_model.num_weight_bytes() == file_bytes  # (the norms are F32 in the file and in memory)

    if not native.load():
        return
    monkeypatch.undo()
    ours, _ = model_logits(path, gguf_method.GGUFQuant(None, torch.float32, cpu))
    error = float((ours - expected).abs().mean() / expected.abs().mean())
    agree = float((ours.argmax(-1) == expected.argmax(-1)).float().mean())
    print(f"{format} tied={tied}: mean logit error {error:.3%}, top-1 agreement {agree:.0%}")
    # (int8 activations per 32 values: about 0.3-1% here; a misread block or a dropped offset gives tens of %)
    assert error < 0.03, error
    assert agree >= 0.9


def test_auto_keeps_float_checkpoints_as_none_does(tmp_path):
    from conveyor.plugins.quant.gguf import AutoQuant
    from conveyor.plugins.quant.none import NoQuant
    from tests.test_model import tiny_hf_model

    tiny_hf_model().save_pretrained(tmp_path)
    cpu = torch.device("cpu")
    expected, _ = model_logits(tmp_path, NoQuant(None, torch.float32, cpu))
    ours, model = model_logits(tmp_path, AutoQuant(None, torch.float32, cpu))
    assert torch.equal(ours, expected) and model.packed_embed is None


def test_parts_in_different_formats_stack_in_order():
    """Q, K in one format and V in another (as Q4_K_M files have them): the layer's outputs are the parts'
    in order, runs of one format held as one tensor."""
    from conveyor.plugins.quant.gguf import GGUFQuant

    parts, references = zip(*(packed_random(f, rows, 256, seed=i)
                              for i, (f, rows) in enumerate([("Q4_1", 4), ("Q4_1", 2), ("Q6_K", 3), ("Q8_0", 5)])))
    method = GGUFQuant(None, torch.float32, torch.device("cpu"))
    params = method.prepare_packed(list(parts), torch.arange(14.0))
    assert [key.split(":")[1] for key in params if ":" in key] == ["Q4_1", "Q6_K", "Q8_0"]
    x = torch.randn(3, 256)
    weight = torch.cat(references)
    expected = x.double() @ weight.T + torch.arange(14.0).double()
    y = method.linear(x, params)
    assert y.shape == (3, 14)
    allowed = activation_bound(x, weight) + 1e-5 * (x.double().abs() @ weight.abs().T) + 1e-6
    assert ((y.double() - expected).abs() <= allowed).all()
    assert method.formats(params).keys() == {"Q4_1", "Q6_K", "Q8_0", "float32"}
