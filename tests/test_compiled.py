"""Fast steps: compiled decode graphs against the eager path, and the C++ linear kernels of decode steps."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from conveyor import native
from conveyor.bench.datasets import mixed
from conveyor.config import ConfigError
from conveyor.sampling import SamplingParams
from tests.conftest import CHAT_PROMPTS, NUM_TOKENS

needs_gemv = pytest.mark.skipif(not native.gemv_supported(), reason="the one-token kernel needs AVX-512 BF16")
needs_amx = pytest.mark.skipif(not native.tile_linear_supported(), reason="the tile kernel needs AMX-BF16")

BATCH_SIZES = [1, 64]


@needs_gemv
@pytest.mark.parametrize("shape", [(960, 576), (7, 100), (5, 33), (1, 32)])
def test_one_token_kernel_matches_a_float32_matmul(shape):
    n, k = shape
    generator = torch.Generator().manual_seed(n * 1000 + k)
    x = torch.randn(1, k, generator=generator).bfloat16()
    weight = torch.randn(n, k, generator=generator).bfloat16()
    bias = torch.randn(n, generator=generator).bfloat16()
    reference = x.float() @ weight.float().T + bias.float()
    out = native.gemv_bf16(x, weight, bias)
    # float32 sums rounded once to bfloat16 (8 bits of mantissa)
    torch.testing.assert_close(out.float(), reference, rtol=2**-7, atol=1e-3)
    torch.testing.assert_close(native.gemv_bf16(x, weight).float(), x.float() @ weight.float().T, rtol=2**-7,
                               atol=1e-3)


@needs_amx
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (16, 32)])
def test_tile_kernel_matches_a_float32_matmul(shape):
    from conveyor.model.formats import TILE_ROWS, decode_copy

    n, k = shape
    generator = torch.Generator().manual_seed(n * 1000 + k)
    weight = torch.randn(n, k, generator=generator).bfloat16()
    bias = torch.randn(n, generator=generator).bfloat16()
    tiles = decode_copy("tiles", weight)
    for rows in (1, 5, 16, 17, 33, 48, 63, TILE_ROWS):  # one to four row tiles, full and partial
        x = torch.randn(rows, k, generator=generator).bfloat16()
        out = native.tile_linear(x, tiles, bias)
        # float32 sums rounded once to bfloat16 (8 bits of mantissa)
        torch.testing.assert_close(out.float(), x.float() @ weight.float().T + bias.float(), rtol=2**-7, atol=1e-3)
        plain = native.tile_linear(x, tiles)
        torch.testing.assert_close(plain.float(), x.float() @ weight.float().T, rtol=2**-7, atol=1e-3)
        # a row's result does not depend on the rows beside it
        assert torch.equal(native.tile_linear(x[-1:].contiguous(), tiles), plain[-1:])
    with pytest.raises(RuntimeError, match="1 <= M <= 64"):
        native.tile_linear(torch.zeros(TILE_ROWS + 1, k).bfloat16(), tiles)


@pytest.mark.parametrize("shape", [(960, 576), (48, 64)])
def test_the_tile_layout_is_what_tdpbf16ps_multiplies(shape):
    """On any CPU: the tile kernel's weight layout, multiplied the way AMX's TDPBF16PS multiplies (Intel's
    definition: C[m][n] += A[m][2p] * B[p][2n] + A[m][2p + 1] * B[p][2n + 1] over the tile's 16 pairs p), gives
    x @ weight.T; the kernel itself runs only with AMX (test_tile_kernel_matches_a_float32_matmul)."""
    from conveyor.model.formats import decode_copy

    n, k = shape
    generator = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=generator).bfloat16()
    x = torch.randn(5, k, generator=generator).bfloat16()
    tiles = decode_copy("tiles", weight)
    assert tiles.shape == (n // 16, k // 32, 16, 32)
    out = torch.zeros(5, n, dtype=torch.float64)
    for j in range(n // 16):  # a tile of 16 output columns
        for t in range(k // 32):  # times a tile of 32 inputs (16 pairs)
            a = x[:, 32 * t:32 * t + 32].double().view(5, 16, 2)  # [row, pair, element]
            b = tiles[j, t].double().view(16, 16, 2)  # [pair, column, element]
            out[:, 16 * j:16 * j + 16] += torch.einsum("mpe,pce->mc", a, b)
    torch.testing.assert_close(out, x.double() @ weight.double().T)
    assert decode_copy("tiles", weight[:, :k - 16]) is None and decode_copy("tiles", weight[:n - 8]) is None


@needs_amx
def test_the_output_head_takes_the_tile_kernel_up_to_its_rows_and_onednn_past_them(monkeypatch):
    from conveyor.model import layers

    generator = torch.Generator().manual_seed(3)
    table = torch.randn(4096, 576, generator=generator).bfloat16()
    head = layers.OutputHead(table, tied=True)
    calls = []
    monkeypatch.setattr(layers, "decode_linear", lambda x, copy: calls.append(len(x)) or native.tile_linear(x, copy))
    for rows in (1, head.TILE_ROWS, head.TILE_ROWS + 1):
        x = torch.randn(rows, 576, generator=generator).bfloat16()
        torch.testing.assert_close(head.apply(x).float(), x.float() @ table.float().T, rtol=2**-7, atol=1e-3)
    assert calls == [1, head.TILE_ROWS]


@pytest.mark.skipif(not native.gemv_supported(), reason="decode copies need AVX-512 BF16")
def test_decode_copies_stay_within_their_budget_and_serve_the_steps_they_fit():
    from conveyor.model.formats import decode_rows
    from conveyor.plugins.quant.none import NoQuant, NoQuantOptions

    weights = [torch.randn(64, 128) for _ in range(3)] + [torch.randn(24, 40)]
    each = 64 * 128 * 2  # bytes of one bfloat16 copy
    method = NoQuant(NoQuantOptions(cpu_decode_copy_mb=2.5 * each / 2**20), torch.bfloat16, torch.device("cpu"))
    params = [method.prepare(w) for w in weights]
    copied = ["decode" in p for p in params]
    tiles = native.tile_linear_supported()
    # copies in order until the budget is spent; a shape the tiles cannot hold gets none (a row-major one fits)
    assert copied == [True, True, False, not tiles]
    without = NoQuant(NoQuantOptions(cpu_decode_copy_mb=0), torch.bfloat16, torch.device("cpu"))
    for w, p in zip(weights, params):
        # a step reads one copy: the bytes counted are those of the same weight kept without a copy
        plain = without.prepare(w)
        assert "decode" not in plain
        assert method.num_bytes(p) == without.num_bytes(plain)
        most = decode_rows(p["decode"]) if "decode" in p else 1
        for rows in {1, most, most + 1}:  # the copy's kernel, and oneDNN past its rows
            x = torch.randn(rows, w.shape[1]).bfloat16()
            torch.testing.assert_close(method.linear(x, p).float(), F.linear(x, w.bfloat16()).float(), rtol=2**-7,
                                       atol=1e-2)


def test_compile_on_refuses_an_attention_backend_it_cannot_hold():
    from conveyor.config import load_config
    from conveyor.registry import PluginRegistry
    from conveyor.worker.worker import Worker

    config = load_config(None, {"engine.compile": "on", "engine.attention": "torch"})
    with pytest.raises(ConfigError, match=r"\[engine\] compile = 'on' cannot run here: the 'torch' attention"):
        Worker(config, PluginRegistry.of(config))


# graphs made and graph breaks met while compiled_llm started
STARTUP: dict[str, int] = {}


@pytest.fixture(scope="module")
def compiled_llm():
    from conveyor import LLM

    logging.getLogger("conveyor").setLevel(logging.WARNING)
    counters = torch._dynamo.utils.counters
    before = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    llm = LLM(overrides={"model.dtype": "float32", "quant.plugin": "none", "engine.seed": 1234, "engine.compile": "on",
                         "engine.compile_batch_sizes": BATCH_SIZES})
    # (dynamo's counters are the process's: what this engine's start-up added, whatever ran before it)
    STARTUP["graphs"] = counters["stats"]["unique_graphs"] - before[0]
    STARTUP["breaks"] = sum(counters["graph_break"].values()) - before[1]
    yield llm
    llm.close()


def compiled_of(llm):
    return llm.engine.executor.worker.runner.compiled


def assert_same(eager, compiled):
    for a, b in zip(eager, compiled, strict=True):
        assert b.token_ids == a.token_ids, (a.text, b.text)
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert abs(x.logprob - y.logprob) <= 1e-4


@pytest.mark.slow
def test_compiled_decode_has_one_graph_per_batch_size_and_no_breaks(compiled_llm):
    compiled = compiled_of(compiled_llm)
    assert compiled is not None and compiled.batch_sizes == BATCH_SIZES
    counters = torch._dynamo.utils.counters
    assert STARTUP == {"graphs": len(BATCH_SIZES), "breaks": 0}, dict(counters["graph_break"])
    before = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    compiled_llm.generate(CHAT_PROMPTS[:3], SamplingParams(max_tokens=8, temperature=0))
    assert compiled.num_steps > 0
    # no recompilation and no break while serving
    assert (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())) == before


@pytest.mark.slow
def test_compiled_decode_matches_eager_alone(llm_fp32, compiled_llm):
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, logprobs=1)
    before = compiled_of(compiled_llm).num_steps
    decodes = 0
    prompts = CHAT_PROMPTS[:4]
    for prompt in prompts:
        compiled = compiled_llm.generate([prompt], params)
        assert_same(llm_fp32.generate([prompt], params), compiled)
        decodes += len(compiled[0].token_ids) - 1  # the first token comes from the prompt's step
    # every step after the prompt's ran in a graph
    assert decodes > len(prompts) and compiled_of(compiled_llm).num_steps - before == decodes


@pytest.mark.slow
def test_compiled_decode_matches_eager_in_a_batch_of_24_mixed_requests(llm_fp32, compiled_llm, tokenizer):
    requests = mixed(24, 7, lambda m: len(tokenizer.encode_chat(m)), input_len=(30, 120), output_len=(4, 40))
    prompts = [r.messages for r in requests]
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, logprobs=1, ignore_eos=True) for r in requests]
    before = compiled_of(compiled_llm).num_steps
    assert_same(llm_fp32.generate(prompts, params), compiled_llm.generate(prompts, params))
    assert compiled_of(compiled_llm).num_steps > before


@pytest.mark.slow
def test_a_second_compiled_engine_in_the_process_has_graphs_of_its_own(llm_fp32, compiled_llm):
    from conveyor import LLM

    params = SamplingParams(max_tokens=12, temperature=0, logprobs=1, ignore_eos=True)
    with LLM(overrides={"model.dtype": "float32", "quant.plugin": "none", "engine.compile": "on",
                        "engine.compile_batch_sizes": [1]}) as llm:
        assert_same(llm_fp32.generate(CHAT_PROMPTS[:1], params), llm.generate(CHAT_PROMPTS[:1], params))
        assert compiled_of(llm).num_steps > 0
    # the first engine's graphs still serve it
    before = compiled_of(compiled_llm).num_steps
    assert_same(llm_fp32.generate(CHAT_PROMPTS[:1], params), compiled_llm.generate(CHAT_PROMPTS[:1], params))
    assert compiled_of(compiled_llm).num_steps - before == 11
