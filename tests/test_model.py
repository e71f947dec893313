"""Conveyor's Llama against transformers on tiny random checkpoints (safetensors and GGUF)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from conveyor import native
from conveyor.model.checkpoint import open_checkpoint
from conveyor.model.gguf_checkpoint import unpermute_rows
from tests.gguf_writer import llama_cpp_permute, write_gguf
from tests.helpers import cpu_model, dense_attention
from tests.kquants import quantize

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)


def tiny_hf_model(kind: str = "llama", **overrides):
    import transformers

    torch.manual_seed(0)
    if kind == "qwen2":
        config = transformers.Qwen2Config(**{**TINY, **overrides})
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**{**TINY, **overrides})
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # random norms and biases, so a swapped or missing norm weight or bias shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):  # (transformers starts them at zero)
                param.normal_(0, 0.5)
    return model.eval()


def conveyor_logits(path, sequences: list[list[int]], fused: bool = False) -> torch.Tensor:
    ckpt = open_checkpoint(path)
    model = cpu_model(ckpt, fused=fused)
    ids = torch.tensor([t for s in sequences for t in s])
    positions = torch.tensor([p for s in sequences for p in range(len(s))])
    with torch.inference_mode():
        return model.compute_logits(model.forward(ids, positions, dense_attention([len(s) for s in sequences])))


def hf_logits(model, sequences: list[list[int]]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.cat([model(torch.tensor([s])).logits[0] for s in sequences])


SEQUENCES = [[5, 17, 3, 88, 41, 2, 9], [60, 1, 33], [7] * 12]


@pytest.mark.parametrize(
    "kind, overrides",
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True}),
        ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
        ("qwen2", {}),
    ],
    ids=["llama", "tied", "llama3-rope", "linear-rope", "qwen2-bias"],
)
@pytest.mark.parametrize(
    "fused",
    [False, pytest.param(True, marks=pytest.mark.skipif(not native.load(), reason="no C++ compiler"))],
    ids=["torch-ops", "cpu-kernels"],
)
def test_safetensors_checkpoint_matches_transformers(tmp_path, kind, overrides, fused):
    model = tiny_hf_model(kind, **overrides)
    model.save_pretrained(tmp_path)
    ours = conveyor_logits(tmp_path, SEQUENCES, fused)
    torch.testing.assert_close(ours, hf_logits(model, SEQUENCES), rtol=1e-4, atol=1e-4)


def test_gguf_checkpoint_matches_transformers(tmp_path):
    model = tiny_hf_model()
    path = tmp_path / "tiny.gguf"
    write_gguf(path, model, gguf.GGMLQuantizationType.F32)
    torch.testing.assert_close(conveyor_logits(path, SEQUENCES), hf_logits(model, SEQUENCES), rtol=1e-4, atol=1e-4)


# the largest error each format allows, as a fraction of each 32-value block's absolute maximum: half a
# quantization step. K-quants, of each 256-value super-block's: half a step of the sub-block, plus what
# rounding the sub-block's scale (six bits; Q6_K eight) to the super-block's unit can clip at the top.
FORMAT_ERROR = {
    gguf.GGMLQuantizationType.F16: 1e-3,
    gguf.GGMLQuantizationType.BF16: 8e-3,
    gguf.GGMLQuantizationType.Q8_0: 1 / 127,
    gguf.GGMLQuantizationType.Q4_0: 1 / 7,
    gguf.GGMLQuantizationType.Q4_1: 2 / 15,
    gguf.GGMLQuantizationType.Q5_0: 1 / 15,
    gguf.GGMLQuantizationType.Q5_1: 2 / 31,
    gguf.GGMLQuantizationType.Q4_K: 1 / 15 + 1 / 42,
    gguf.GGMLQuantizationType.Q5_K: 1 / 31 + 1 / 42,
    gguf.GGMLQuantizationType.Q6_K: 1 / 62 + 1 / 254,
}
K_QUANTS = (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K, gguf.GGMLQuantizationType.Q6_K)


@pytest.mark.parametrize("qtype", list(FORMAT_ERROR), ids=lambda q: q.name)
def test_gguf_dequantization_of_each_format(tmp_path, qtype):
    """Every weight of a checkpoint written in each format reads back within the format's error (the
    K-quants need rows of 256: a wider model), and the model still computes nearly the same logits."""
    model = tiny_hf_model(hidden_size=256, intermediate_size=512)
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    originals = write_gguf(path, model, qtype, quantize)
    ckpt = open_checkpoint(path)
    assert {t.tensor_type for t in ckpt.file.tensors if len(t.shape) == 2} == {qtype}
    for name, original in originals.items():
        loaded = ckpt.get(name).numpy()
        assert loaded.shape == original.shape, name
        size = 256 if qtype in K_QUANTS else 32
        blocks = np.abs(original).reshape(-1, size).max(axis=1, keepdims=True) if original.ndim == 2 else np.abs(original)
        error = np.abs(loaded - original).reshape(blocks.shape[0], -1)
        assert (error <= FORMAT_ERROR[qtype] * blocks + 1e-7).all(), f"{name}: max error {error.max():.4g}"
    expected = hf_logits(model, SEQUENCES)
    error = float((conveyor_logits(path, SEQUENCES) - expected).abs().mean() / expected.abs().mean())
    # (mean logit errors here run 0.5-2.5x the format's weight error: 1.2% for Q8_0, 19% for Q4_K)
    assert error < 4 * FORMAT_ERROR[qtype], error


@pytest.mark.parametrize("num_heads, head_dim, cols", [(1, 2, 1), (4, 16, 8), (3, 64, 5)])
def test_unpermute_inverts_llama_cpp_permute(num_heads, head_dim, cols):
    weight = torch.randn(num_heads * head_dim, cols)
    permuted = torch.from_numpy(llama_cpp_permute(weight.numpy(), num_heads))
    assert torch.equal(unpermute_rows(permuted, num_heads), weight)
