"""A model is declared from its shape alone and filled by ``load_weights``: each family, from each checkpoint
format (Hugging Face safetensors, GGUF, GPTQ's int4 layout), computes what transformers computes with the same
weights, and no constructor is given a checkpoint."""

from __future__ import annotations

import gguf
import pytest
import torch

from conveyor.model.checkpoint import open_checkpoint
from conveyor.model.decoder_model import DecoderModel
from conveyor.model.layers import LayerOptions, Linear, RMSNorm
from conveyor.model.loader import load_weights
from conveyor.model.moe import MoE
from conveyor.plugins.quant import gguf as gguf_method
from conveyor.plugins.quant.gguf import AutoQuant
from conveyor.plugins.quant.none import NoQuant
from tests.gguf_writer import write_gguf
from tests.helpers import dense_attention
from tests.test_families import SEQUENCES, family, tiny_model  # noqa: F401 -- the fixture of every family
from tests.test_hf_quant import write_int4_checkpoint

CPU = torch.device("cpu")


def checkpoint_of(name: str, model, path, format: str, tmp_path):
    """``model`` written in ``format``; returns its path and the transformers model of the weights it holds."""
    if format == "safetensors":
        return path, model
    if format == "gguf":
        if name in ("qwen2-sliding", "qwen3-sliding"):
            pytest.skip("GGUF has no per-layer window for Qwen")
        if getattr(model.config, "mlp_only_layers", None):  # (every layer a mixture in GGUF)
            model = tiny_model(name, mlp_only_layers=[])
        write_gguf(tmp_path / "model.gguf", model, gguf.GGMLQuantizationType.F32)
        return tmp_path / "model.gguf", model
    import transformers

    if model.config.model_type in ("mixtral", "qwen2_moe", "qwen3_moe"):
        pytest.skip("the int4 writer reads the in-memory state dict, whose expert names are not the files' ones")
    # GPTQ, groups of 32 (the tiny shapes' widths), symmetric: Q4_0 blocks, which the method keeps as stored
    quantized = write_int4_checkpoint(tmp_path / "gptq", tmp_path / "reference", model, "gptq", 32)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "reference", torch_dtype=torch.float32)
    return quantized, reference.eval()


def blocks(model: DecoderModel) -> list:
    return [*model.loaders(), *(block for layer in model.layers for block in layer.loaders())]


def holds_weights(block) -> bool:
    if isinstance(block, RMSNorm):
        return block.weight is not None
    if isinstance(block, Linear):
        return bool(block.params)
    if isinstance(block, MoE):
        return block.router.numel() > 0 and all(linear.params for linear in block.linears())
    if isinstance(block, DecoderModel):
        return block.head is not None and (block.embed is not None or block.packed_embed is not None)
    return block.cos.numel() > 0  # (the rotary tables)


@pytest.mark.parametrize("format", ["safetensors", "gguf", "gptq"])
def test_each_family_is_declared_from_its_shape_and_filled_by_load_weights(family, format, tmp_path, monkeypatch):
    name, model, path = family
    path, reference = checkpoint_of(name, model, path, format, tmp_path)
    ckpt = open_checkpoint(path)
    quant = AutoQuant(None, torch.float32, CPU) if format == "gptq" else NoQuant(None, torch.float32, CPU)
    ours = DecoderModel(ckpt.spec, LayerOptions(quant, torch.float32, CPU), 128)
    assert not any(holds_weights(block) for block in blocks(ours)), "a block holds weights before loading"

    load_weights(ours, ckpt)

    assert all(holds_weights(block) for block in blocks(ours))
    if format == "gptq":  # the int4 blocks kept as stored, multiplied in float32 (exact: no activation rounding)
        assert "Q4_0" in ours.weight_formats()
        monkeypatch.setattr(gguf_method, "kernels_run", lambda x: False)
    ids = torch.tensor([t for s in SEQUENCES for t in s])
    positions = torch.tensor([p for s in SEQUENCES for p in range(len(s))])
    with torch.inference_mode():
        logits = ours.compute_logits(ours.forward(ids, positions, dense_attention([len(s) for s in SEQUENCES],
                                                                                  ours.attention_layers())))
        expected = torch.cat([reference(torch.tensor([s])).logits[0] for s in SEQUENCES])
    print(f"{name} ({format}): max |logit difference| {float((logits - expected).abs().max()):.2e}")
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
