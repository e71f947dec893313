"""Decode steps in one C++ call (conveyor.native.decode_layers, conveyor.model.native_decode).

The call runs every layer with the kernels the layer-by-layer path calls, in the same order, on a team of
threads; so its hidden states, keys and values must equal that path's bit for bit. Checked on a small random
model of GGML Q8_0 blocks, and of fp8 weights, against the kernels called one by one, at 1, 3 and 17 rows (the
tiles and the batched path), on one thread, on two and from a new thread; on SmolLM2's Q4_1 GGUF, and as fp8,
served both ways (tokens and logprobs); and a failure inside the team is an error, not a hang.
"""

from __future__ import annotations

import concurrent.futures
import math

import msgspec
import numpy as np
import pytest
import torch

from conveyor import native
from conveyor.model import ggml
from conveyor.quant import FP8_TYPE_ID

pytestmark = [
    pytest.mark.skipif(not native.load(), reason="no C++ compiler: the CPU kernels cannot be built here"),
    pytest.mark.usefixtures("random_seed"),
]

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, WIDTH, BLOCK = 2, 64, 4, 2, 16, 96, 16
Q_SIZE, KV_SIZE, EPS, SCALE = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, 1e-5, HEAD_DIM**-0.5


def q8_0(rows: int, columns: int) -> torch.Tensor:
    """A random weight as GGML Q8_0 blocks (gguf's own quantizer)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    weight = np.random.default_rng(int(torch.randint(2**31, ()))).standard_normal((rows, columns)) * 0.2
    return torch.from_numpy(quantize(weight.astype(np.float32), GGMLQuantizationType.Q8_0).copy())


def fp8(rows: int, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random fp8 e4m3 weight and its rows' scales."""
    return (torch.randn(rows, columns) * 100).clamp(-448, 448).to(torch.float8_e4m3fn), torch.rand(rows) / 1000


def random_step(rows: int, dtype: torch.dtype, kind: str = "Q8_0") -> dict:
    """A model of LAYERS layers and a decode step of `rows` sequences over shuffled blocks, cached keys before."""
    num_blocks = 4 * rows
    lens = torch.randint(1, 3 * BLOCK, (rows,), dtype=torch.int32)
    tables = torch.randperm(num_blocks, dtype=torch.int32)[: rows * 3].view(rows, 3).contiguous()
    positions = (lens - 1).long()
    slots = tables.gather(1, (positions // BLOCK)[:, None]).squeeze(1).long() * BLOCK + positions % BLOCK
    shape = (LAYERS, KV_HEADS, num_blocks * BLOCK, HEAD_DIM)
    angles = positions[:, None].float() * torch.rand(HEAD_DIM // 2)
    outs = (Q_SIZE + 2 * KV_SIZE, HIDDEN, 2 * WIDTH, HIDDEN)
    ins = (HIDDEN, Q_SIZE, HIDDEN, WIDTH)
    shapes = [(n, k) for _ in range(LAYERS) for n, k in zip(outs, ins)]
    if kind == "fp8":
        weights, scales = zip(*(fp8(n, k) for n, k in shapes))
        types = [FP8_TYPE_ID] * len(shapes)
    else:
        weights, scales, types = [q8_0(n, k) for n, k in shapes], [torch.empty(0)] * len(shapes), [
            ggml.TYPE_IDS[kind]] * len(shapes)
    return dict(
        h=torch.randn(rows, HIDDEN).to(dtype), k_cache=torch.randn(shape).to(dtype),
        v_cache=torch.randn(shape).to(dtype), slot_mapping=slots, block_tables=tables, context_lens=lens,
        cos=angles.cos().to(dtype), sin=angles.sin().to(dtype),
        weights=list(weights), types=types, scales=list(scales),
        norms=[(1 + 0.1 * torch.randn(HIDDEN)).to(dtype) for _ in range(2 * LAYERS + 1)],
        eps=EPS, softmax_scale=SCALE, block_size=BLOCK, num_heads=HEADS,
    )


def layer_by_layer(s: dict) -> torch.Tensor:
    """The layers as conveyor.model.decoder runs them with the C++ kernels, one call each."""
    h, delta, rows, norms = s["h"].clone(), None, s["h"].shape[0], s["norms"]

    def linear(x: torch.Tensor, i: int) -> torch.Tensor:
        if s["types"][i] == FP8_TYPE_ID:
            return native.fp8_linear(x, s["weights"][i], s["scales"][i])
        return native.ggml_linear(x, s["weights"][i], s["types"][i])

    for layer in range(LAYERS):
        qkv = linear(native.rms_norm(h, norms[2 * layer], EPS, delta), 4 * layer)
        q, k, v = qkv.split([Q_SIZE, KV_SIZE, KV_SIZE], dim=-1)
        q, k, v = (x.view(rows, -1, HEAD_DIM) for x in (q, k, v))
        native.rotary_(q, s["cos"], s["sin"])
        native.rotary_(k, s["cos"], s["sin"])
        k_cache, v_cache = s["k_cache"][layer], s["v_cache"][layer]
        native.store_kv(k_cache, v_cache, s["slot_mapping"], k, v)
        out = native.paged_decode_attention(q, k_cache, v_cache, s["block_tables"], s["context_lens"], BLOCK,
                                            scale=SCALE)
        o = linear(out.reshape(rows, Q_SIZE), 4 * layer + 1)
        gate_up = linear(native.rms_norm(h, norms[2 * layer + 1], EPS, o), 4 * layer + 2)
        delta = linear(native.silu_mul(gate_up), 4 * layer + 3)
    return native.rms_norm(h, norms[-1], EPS, delta)


def copy(s: dict) -> dict:
    return {**s, "k_cache": s["k_cache"].clone(), "v_cache": s["v_cache"].clone()}


@pytest.mark.parametrize("kind", ["Q8_0", "Q8_0R", "fp8"])  # (Q8_0R: the int8 method's; per 64 with AMX)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_one_call_equals_the_kernels_called_layer_by_layer(rows, dtype, kind):
    if kind == "fp8" and not native.fp8_linear_supported():
        pytest.skip("the fp8 kernel needs AVX2, FMA and F16C")
    step = random_step(rows, dtype, kind)
    expected = copy(step)
    reference = layer_by_layer(expected)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in sorted({1, threads}):
            torch.set_num_threads(n)
            got = copy(step)
            results.append((f"{n} thread(s)", native.decode_layers(**got), got))
    finally:
        torch.set_num_threads(threads)
    # from a thread of its own, as the engine's executor calls it (each thread has its own OpenMP settings)
    got = copy(step)
    called = concurrent.futures.ThreadPoolExecutor(1).submit(lambda: native.decode_layers(**got))
    results.append(("a new thread", called.result(), got))
    for n, hidden, got in results:
        assert torch.equal(hidden, reference), f"{n}: hidden states differ"
        assert torch.equal(got["k_cache"], expected["k_cache"]) and torch.equal(got["v_cache"], expected["v_cache"])
    assert not torch.equal(step["h"], reference)  # (the layers did something)


def test_a_failure_inside_the_team_is_an_error_and_the_next_call_works():
    step = random_step(3, torch.bfloat16)
    bad = copy(step)
    bad["block_tables"] = bad["block_tables"].clone()
    bad["block_tables"][1, 0] = 10_000  # (checked by the attention kernel, inside the team)
    with pytest.raises(RuntimeError, match="uses block 10000"):
        native.decode_layers(**bad)
    good = copy(step)
    assert torch.equal(native.decode_layers(**good), layer_by_layer(copy(step)))


PROMPTS = [
    "Hi.",
    "What is the capital of France?",
    "Write a short poem about the sea, with rhymes, in four lines.",
    *[f"Count from {i} to {i + 5} and explain why numbers matter to sailors." for i in range(14)],
]


@pytest.fixture(scope="module", params=["auto", "fp8"])
def llms(request):
    """SmolLM2's GGUF served with steps of decodes in one call, and layer by layer: its blocks kept packed (the
    default config), and its weights as fp8."""
    from conveyor import LLM

    if request.param == "fp8" and not native.fp8_linear_supported():
        pytest.skip("the fp8 kernel needs AVX2, FMA and F16C")
    quant = {"quant.plugin": request.param}
    native_llm = LLM(overrides={**quant, "engine.native_decode": "auto"})
    layered = LLM(overrides={**quant, "engine.native_decode": "off"})
    yield native_llm, layered
    native_llm.close()
    layered.close()


def test_smollm2_served_in_one_call_gives_the_tokens_and_logprobs_of_layer_by_layer(llms):
    from conveyor import SamplingParams

    native_llm, layered = llms
    runner = native_llm.engine.executor.worker.runner
    assert runner.native_decode is not None and layered.engine.executor.worker.runner.native_decode is None
    rows_seen: list[int] = []
    forward = runner.native_decode.forward

    def counted(input_ids, positions, attention):
        rows_seen.append(len(input_ids))
        return forward(input_ids, positions, attention)

    runner.native_decode.forward = counted
    # one request first (the engine's first decode steps), then different lengths: the batch shrinks from 17
    # sequences to one as they finish
    params = [SamplingParams(max_tokens=4 + 2 * i, temperature=0.0, ignore_eos=True, logprobs=3)
              for i in range(len(PROMPTS))]
    for prompts, chosen in ((PROMPTS[1:2], params[-1:]), (PROMPTS, params)):
        got = native_llm.generate(prompts, chosen)
        want = layered.generate(prompts, chosen)
        for a, b in zip(got, want, strict=True):
            assert a.token_ids == b.token_ids
            assert a.logprobs == b.logprobs
    # (fp8: past its kernel's rows, layer by layer; where this machine computes prompt chunks as decode rows,
    # steps of prompt tokens come here too)
    limit = runner.native_decode.max_rows
    assert 1 in rows_seen and min(limit or len(PROMPTS), len(PROMPTS)) in rows_seen
    assert max(rows_seen) <= (limit or math.inf)


def test_at_float32_too_one_call_gives_the_tokens_and_logprobs_of_layer_by_layer():
    """The default packed weights with float32 activations. The kernels' work is compiled once for a team's threads
    and ATen's alike: when inlined into each, attention's sums differed in their last bits between the two, and
    the int8 rounding of the next layer's activations made that tokens apart within a few steps."""
    from conveyor import LLM, SamplingParams

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
    outputs = []
    for mode in ("auto", "off"):
        with LLM(overrides={"model.dtype": "float32", "engine.native_decode": mode}) as llm:
            assert (llm.engine.executor.worker.runner.native_decode is not None) == (mode == "auto")
            outputs.append(llm.generate(PROMPTS[:4], params))
    for got, want in zip(*outputs, strict=True):
        assert got.token_ids == want.token_ids
        assert got.logprobs == want.logprobs


def test_models_the_call_does_not_run_go_layer_by_layer(llms):
    from conveyor.model.native_decode import NativeDecode

    runner = llms[0].engine.executor.worker.runner
    model, spec = runner.model, runner.model.spec
    assert NativeDecode.build(model, runner.attention) is not None
    for change in ({"qk_norm": True}, {"activation": "gelu_tanh"}, {"attn_softcap": 50.0}):
        model.spec = msgspec.structs.replace(spec, **change)
        try:
            assert NativeDecode.build(model, runner.attention) is None, change
        finally:
            model.spec = spec
    linear = model.layers[0].o_proj
    linear.row_block = 16  # ([engine] batch_invariant)
    try:
        assert NativeDecode.build(model, runner.attention) is None
    finally:
        linear.row_block = 0
