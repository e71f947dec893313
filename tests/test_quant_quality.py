"""Quantized SmolLM2 against the fp32 model, teacher-forced on 2,047 tokens of the GPL-3 text
(tests/data/GPL-3.txt, shipped verbatim): perplexity and next-token top-1 agreement; and what each
format saves in memory."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor import LLM, native
from conveyor.bench.quality import agreement, perplexity, teacher_forced
from conveyor.plugins.quant import int8

pytestmark = pytest.mark.slow

TEXT = Path(__file__).parent / "data" / "GPL-3.txt"
NUM_TOKENS = 2047  # (and one generated token: the default max_model_len, that of the shared fp32 model)
# (perplexity increase over fp32 allowed, top-1 agreement required)
BOUNDS = {
    "int8": ({"quant.plugin": "int8"}, 0.015, 0.95),
    # int8 as Q8_0 blocks (where the C++ kernel has its VNNI path; forced here) rounds the activations to int8
    # per 32 values as well (W8A8): measured +0.60% and 94.97% (W8A16 through torch: +0.61%, 96.29%)
    "int8-q8_0": ({"quant.plugin": "int8"}, 0.015, 0.94),
    "fp8": ({"quant.plugin": "fp8"}, 0.03, 0.89),
    "fp8-kv": ({"kvcache.dtype": "fp8"}, 0.03, 0.90),
    # the file's own Q4_1 blocks, against the fp32 model dequantized from them: only the activations' rounding
    # to int8 per 32 values differs (llama.cpp's own), within the 1% the issue of packed GGUF serving asks
    "gguf": ({"quant.plugin": "gguf"}, 0.01, 0.95),
}


@pytest.fixture(scope="module")
def text_ids(tokenizer) -> list[int]:
    ids = tokenizer.encode(TEXT.read_text())
    assert len(ids) > NUM_TOKENS
    return ids[:NUM_TOKENS]


def make_llm(**overrides) -> LLM:
    # the text is one prompt of NUM_TOKENS (and one generated token), computed in chunks of 512
    # (chunks of 512: later chunks read the earlier ones' K and V back from the cache, as an fp8 cache stores them)
    return LLM(overrides={"model.dtype": "float32", "quant.plugin": "none", "model.max_model_len": NUM_TOKENS + 1,
                          "kvcache.num_blocks": 160, "scheduler.max_num_batched_tokens": 512, **overrides})


@pytest.fixture(scope="module")
def reference(text_ids, llm_fp32):
    """The fp32 model's (the session's, its prompt in one step: an fp32 cache reads back what it was given)."""
    return teacher_forced(llm_fp32, text_ids)


@pytest.mark.parametrize("method", list(BOUNDS))
def test_quality_against_fp32(monkeypatch, method, text_ids, reference):
    overrides, max_ppl_increase, min_agreement = BOUNDS[method]
    if method.startswith("int8"):
        if method == "int8-q8_0" and not native.load():
            pytest.skip("the C++ kernels do not build here")
        monkeypatch.setattr(int8, "q8_0_kernel", lambda: method == "int8-q8_0")
    ref_logprobs, ref_predictions = reference
    logprobs, predictions = teacher_forced(make_llm(**overrides), text_ids)
    ref_ppl, ppl = perplexity(ref_logprobs), perplexity(logprobs)
    agree = agreement(predictions, ref_predictions)
    drift = float((logprobs - ref_logprobs).abs().mean())
    print(f"{method}: perplexity {ppl:.4f} vs fp32 {ref_ppl:.4f} ({ppl / ref_ppl - 1:+.2%}), agreement {agree:.2%}, "
          f"mean |logprob change| {drift:.4f}")
    assert ppl / ref_ppl - 1 <= max_ppl_increase
    assert agree >= min_agreement
    assert drift > 1e-3  # the quantization happened: an unquantized model would not move at all


def linear_bytes(llm: LLM) -> int:
    model = llm.engine.executor.worker.model
    return sum(linear.num_bytes() for layer in model.layers for linear in layer.linears())


def test_int8_and_fp8_weights_take_about_half_of_bf16():
    bf16 = LLM(overrides={"model.max_model_len": 256, "kvcache.num_blocks": 16, "quant.plugin": "none"})
    for method in ("int8", "fp8"):
        quantized = LLM(overrides={"model.max_model_len": 256, "kvcache.num_blocks": 16, "quant.plugin": method})
        # the quantized layers: one byte per weight plus a scale per output channel (int8 where the C++ kernel has
        # its VNNI path: Q8_0 blocks, that scale in float16 once per 32 values: 34 bytes where bf16 takes 64)
        assert linear_bytes(quantized) <= 0.54 * linear_bytes(bf16), method
        # the whole model (the tied embedding stays bf16)
        ratio = quantized.engine.info.weight_bytes / bf16.engine.info.weight_bytes
        assert ratio <= 0.65, (method, ratio)


def test_the_gguf_method_holds_the_file_at_its_size(smollm2_path):
    """The default GGUF (Q4_1 layers, a Q8_0 embedding that is also the tied head) at its file's size: every
    quantized tensor kept as its blocks, where the bf16 model takes 2.8x."""
    import gguf

    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(smollm2_path)).tensors)
    packed = LLM(overrides={"model.max_model_len": 256, "kvcache.num_blocks": 16, "quant.plugin": "gguf"})
    assert packed.engine.info.weight_bytes <= 1.1 * file_bytes
    model = packed.engine.executor.worker.model
    assert model.embed is None and model.packed_embed.format == "Q8_0"
    assert {key.split(":")[1] for layer in model.layers for linear in layer.linears()
            for key in linear.params if ":" in key} == {"Q4_1"}
    # what the banner and /metrics say: the bytes by format add up to the weights (less the float32 norms)
    formats = packed.engine.info.weight_formats
    assert set(formats) == {"Q4_1", "Q8_0"} and formats["Q8_0"] == model.packed_embed.data.numel()
    assert 0 < packed.engine.info.weight_bytes - sum(formats.values()) < 1e6
    from conveyor.serving.server import _weight_formats

    assert _weight_formats(packed.engine.ready(1.0)).startswith(" (quant gguf: Q4_1 ")
