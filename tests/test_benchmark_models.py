"""benchmarks/models.py: the benchmark models' GGUF files, written at tiny shapes through the code path of the real
ones (Q8_0 and Q4_0, Llama with Llama 3.1's RoPE scaling, Qwen2 with q/k/v biases), read back by Conveyor and by
transformers' own GGUF loader, the independent reference; the real shapes against their published sizes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from benchmarks import models
from conveyor.model.checkpoint import open_checkpoint, resolve_model_path
from conveyor.model.gguf_file import GGUFFile
from tests.helpers import cpu_model, dense_attention

SEQUENCES = [[5, 17, 3, 88, 41, 2, 9, 60, 1, 33, 12, 70, 8, 19, 54, 3, 90, 27, 4, 11], [60, 1, 33],
             list(range(300, 360))]
# parameters of the real models (their model cards' counts, with the real vocabularies): the shapes less the
# embedding rows (both tables' where untied) past our 49,152-token vocabulary
PUBLISHED = {"llama-3.2-1b": (1_235_814_400, 128_256), "qwen2.5-1.5b": (1_543_714_304, 151_936),
             "llama-3-8b": (8_030_261_248, 128_256)}


# (each format and each architecture once: transformers' loader reads the 49k-token vocabulary twice a file)
@pytest.fixture(scope="module", params=[("tiny-llama", "Q4_0"), ("tiny-qwen2", "Q8_0")], ids=lambda p: "-".join(p))
def written(request, tmp_path_factory):
    """(shape name, format, file) written by ``model_path`` into a fresh directory."""
    name, fmt = request.param
    path = models.model_path(name, fmt, directory=tmp_path_factory.mktemp("models"), log=lambda line: None)
    return name, fmt, path


@pytest.fixture(scope="module")
def hf_model(written):
    """transformers' model read from the same file by its GGUF loader (which dequantizes with the gguf package)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    _, _, path = written
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def test_the_file_loads_in_conveyor_with_the_shape_and_format_asked_for(written):
    name, fmt, path = written
    shape = models.SHAPES[name]
    ckpt = open_checkpoint(path)
    spec = ckpt.spec
    assert spec.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[shape.arch]
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.intermediate_size) == (
        shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.intermediate)
    assert spec.vocab_size == 49152
    assert spec.tie_word_embeddings == shape.tied
    assert spec.attention_bias == shape.qkv_bias
    assert spec.rope_theta == shape.rope_theta
    assert spec.max_position_embeddings == shape.context
    assert {t.tensor_type.name for t in ckpt.file.tensors if len(t.shape) == 2} == {fmt}
    assert ckpt.stored_formats() == {fmt}
    # the default model's tokenizer and chat template, copied
    default = GGUFFile(resolve_model_path(models.DEFAULT_MODEL)).fields
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template",
                "tokenizer.ggml.eos_token_id"):
        assert ckpt.field(key) == default[key], key


@pytest.mark.slow
def test_transformers_reads_the_same_weights_at_the_promised_scale(written, hf_model):
    """Both readers of the file (names, llama.cpp's q/k row order undone, tied head) agree bit for bit; the
    weights are normal with std 0.02 up to the format's rounding, the norms 1."""
    name, fmt, path = written
    shape = models.SHAPES[name]
    config = hf_model.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.vocab_size) == (shape.hidden, shape.layers, shape.heads,
                                                             shape.kv_heads, shape.intermediate, 49152)
    ckpt = open_checkpoint(path)
    state = hf_model.state_dict()
    assert any(n.endswith("q_proj.bias") for n in state) == shape.qkv_bias
    for hf_name, expected in state.items():
        ours = ckpt.get(hf_name)
        assert torch.equal(ours, expected), hf_name
        if "norm" in hf_name:
            assert torch.all(expected == 1.0), hf_name
        elif expected.numel() >= 4096:
            # (Q4_0's rounding adds up to half of 1/7 of a block's largest value: a few percent of the spread)
            assert abs(float(expected.std()) - models.WEIGHT_STD) < 0.1 * models.WEIGHT_STD, hf_name
            assert abs(float(expected.mean())) < 0.1 * models.WEIGHT_STD, hf_name


def conveyor_logits(path) -> torch.Tensor:
    model = cpu_model(path)
    ids = torch.tensor([t for s in SEQUENCES for t in s])
    positions = torch.tensor([p for s in SEQUENCES for p in range(len(s))])
    with torch.inference_mode():
        return model.compute_logits(model.forward(ids, positions, dense_attention([len(s) for s in SEQUENCES])))


def hf_logits(model) -> torch.Tensor:
    with torch.inference_mode():
        return torch.cat([model(torch.tensor([s])).logits[0] for s in SEQUENCES])


@pytest.mark.slow
def test_logits_match_transformers(written, hf_model):
    """Conveyor on the file computes transformers' logits. transformers' GGUF loader does not read llama.cpp's
    ``rope_freqs``: the reference for the Llama shape is transformers' own Llama 3.1 RoPE scaling, set from the
    shape, over the weights it read; the scaling changes the logits, so a file without it would fail."""
    name, _, path = written
    shape = models.SHAPES[name]
    reference = hf_model
    if shape.llama3_rope:
        factor, low, high, original = shape.llama3_rope
        config = type(hf_model.config)(**{**hf_model.config.to_dict(), "rope_parameters": {
            "rope_type": "llama3", "rope_theta": shape.rope_theta, "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": original}})
        config.quantization_config = None
        reference = type(hf_model)(config).eval()
        reference.load_state_dict(hf_model.state_dict())
    expected = hf_logits(reference)
    ours = conveyor_logits(path)
    assert torch.isfinite(ours).all() and float(ours.abs().max()) < 50  # (random weights at std 0.02: calm)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
    if shape.llama3_rope:
        assert (hf_logits(hf_model) - expected).abs().max() > 1e-3  # (ten times the tolerance)


@pytest.mark.slow
def test_freq_factors_are_llama_3_1_scaling_as_transformers_computes_it():
    """The 1B shape's RoPE divisors against transformers' own Llama 3.1 inverse frequencies."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    shape = models.SHAPES["llama-3.2-1b"]
    factor, low, high, original = shape.llama3_rope
    config = LlamaConfig(hidden_size=shape.hidden, num_attention_heads=shape.heads, rope_parameters={
        "rope_type": "llama3", "rope_theta": shape.rope_theta, "factor": factor, "low_freq_factor": low,
        "high_freq_factor": high, "original_max_position_embeddings": original})
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / shape.rope_theta ** (torch.arange(0, shape.head_dim, 2, dtype=torch.float64) / shape.head_dim)
    np.testing.assert_allclose(models.llama3_freq_factors(shape), (plain / scaled.double()).numpy(), rtol=1e-5)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_the_real_shapes_have_the_real_models_sizes(name):
    shape = models.SHAPES[name]
    published, vocab = PUBLISHED[name]
    extra_rows = (vocab - 49152) * shape.hidden * (1 if shape.tied else 2)
    assert models.num_parameters(shape, 49152) + extra_rows == published


def test_a_written_file_is_reused_from_the_cache_and_an_edited_shape_is_not(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path))
    lines = []
    first = models.model_path("tiny-qwen2", "Q8_0", log=lines.append)
    assert first.parent == tmp_path / "models" and lines  # (written: progress shown)
    lines.clear()
    assert models.model_path("tiny-qwen2", "Q8_0", log=lines.append) == first
    assert lines == []
    assert models.resolve_model("tiny-qwen2:Q8_0") == str(first)
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # (no partial file left behind)
    monkeypatch.setitem(models.SHAPES, "tiny-qwen2", dataclasses.replace(models.SHAPES["tiny-qwen2"], layers=3))
    assert models.file_name("tiny-qwen2", "Q8_0") != first.name


def test_resolve_model_passes_paths_and_aliases_through():
    assert models.resolve_model("/some/model.gguf") == "/some/model.gguf"
    assert models.resolve_model("smollm2-135m-instruct") == "smollm2-135m-instruct"


def test_q4_k_m_without_llama_quantize_says_how_to_get_it(tmp_path):
    with pytest.raises(ValueError, match="--llama-quantize"):
        models.model_path("tiny-llama", "Q4_K_M", directory=tmp_path)
    assert list(tmp_path.iterdir()) == []
