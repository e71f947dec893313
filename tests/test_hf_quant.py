"""Hugging Face quantized checkpoints kept at their size: tiny Llama and Qwen3 models quantized in the test by
the compressed-tensors package (int4 and int8 "pack-quantized", fp8 "float-quantized"), and int4 checkpoints
written in the GPTQ and AWQ layouts as those formats describe them. Each is read packed, and its logits are
the model's with the weights the package (or the format's formula) dequantizes: exactly where no activation is
rounded, within the kernels' int8 or fp8 rounding where it is."""

from __future__ import annotations

import json

import pytest
import torch

from conveyor import native
from conveyor.config import ConfigError, ModelConfig
from conveyor.model import ggml
from conveyor.model.loader import open_model
from conveyor.plugins.quant import gguf as gguf_method
from conveyor.plugins.quant.gguf import AutoQuant
from conveyor.plugins.quant.none import NoQuant
from tests.test_ggml import model_logits

pytest.importorskip("compressed_tensors")

CPU = torch.device("cpu")
# shapes with groups of 128 (and a row of two of them)
SHAPE = dict(vocab_size=96, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)


def tiny(kind: str):
    import transformers

    torch.manual_seed(0)
    if kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SHAPE, head_dim=64))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE))
    return model.eval()


def compressed_tensors_checkpoint(path, model, scheme: str, group: int | None = None):
    """``model`` quantized by compressed-tensors' preset ``scheme`` (each linear's scales and zero points from
    its own minimum and maximum, as llm-compressor's min-max observer sets them), compressed and saved with
    the package's config."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, apply_quantization_config,
                                                 preset_name_to_scheme)
    from compressed_tensors.quantization.utils import calculate_qparams

    chosen = preset_name_to_scheme(scheme, ["Linear"])
    if group is not None:
        chosen.weights.group_size = group
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": chosen}, ignore=["lm_head"]))
    for module in model.modules():
        if not hasattr(module, "weight_scale"):
            continue
        args, weight = module.quantization_scheme.weights, module.weight.data.float()
        if args.strategy == "group":
            weight = weight.unflatten(-1, (-1, args.group_size))
        elif args.strategy == "tensor":
            weight = weight.reshape(1, -1)
        low, high = weight.amin(-1), weight.amax(-1)
        scale, zero = calculate_qparams(low, high, args)
        # (scales a float16 holds, as a bfloat16 or float16 model's are: the package dequantizes in float32 here,
        # exactly, so the reference is the weights the checkpoint stands for, not their rounding to bfloat16)
        scale = scale.half().float()
        module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype).reshape(
                module.weight_zero_point.shape)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)
    return path


def decompressed_checkpoint(path, quantized):
    """The package's own reading of a quantized checkpoint (``dequantize=True``), saved as floats."""
    import transformers
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = transformers.AutoModelForCausalLM.from_pretrained(
        quantized, quantization_config=CompressedTensorsConfig(dequantize=True))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    model.config = type(model.config).from_dict(config)
    model.save_pretrained(path)
    return path


def linear_names(model) -> list[str]:
    return [f"{name}.weight" for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name != "lm_head"]


def assert_served_packed(path, reference_path, tolerance: float, monkeypatch) -> None:
    """Every linear layer kept in a quantized format (the only float bytes: the embedding and the head), and
    the logits the dequantized model's: within ``tolerance`` without the block kernels' activation rounding
    (float32 rounding where the blocks hold the weights exactly), within that rounding with the kernels."""
    expected, _ = model_logits(reference_path, NoQuant(None, torch.float32, CPU))
    monkeypatch.setattr(gguf_method, "kernels_run", lambda x: False)
    fallback, model = model_logits(path, AutoQuant(None, torch.float32, CPU))
    floats = 2 * SHAPE["vocab_size"] * SHAPE["hidden_size"] * 4  # (the embedding and the untied head)
    formats = model.weight_formats()
    assert formats.pop("float32") == floats, formats
    assert set(formats) <= {"Q4_0", "Q4_1", "Q8_0", "Q4_X2", "fp8", "copies"}, formats
    largest = float((fallback - expected).abs().max())
    print(f"{path.name}: without the block kernels, largest logit difference {largest:.2e}")
    torch.testing.assert_close(fallback, expected, rtol=tolerance, atol=tolerance)
    monkeypatch.undo()
    if not native.load():
        return
    ours, _ = model_logits(path, AutoQuant(None, torch.float32, CPU))
    error = float((ours - expected).abs().mean() / expected.abs().mean())
    agree = float((ours.argmax(-1) == expected.argmax(-1)).float().mean())
    print(f"{path.name}: mean logit error {error:.3%}, top-1 agreement {agree:.0%}")
    # (int8 activations per 32 values, or fp8 weights times float32 activations: about 1% here; a misread
    # nibble order, scale or zero point gives tens of percent)
    assert error < 0.03, error
    assert agree >= 0.9


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("scheme, group, stored", [
    ("W4A16", 128, "Q4_0"), ("W4A16", 32, "Q4_0"), ("W4A16_ASYM", 128, "Q4_1"), ("W8A16", None, "Q8_0"),
    ("FP8_DYNAMIC", None, "F8_E4M3"), ("FP8", None, "F8_E4M3"),
])
def test_compressed_tensors_checkpoints_load_packed_and_compute_the_decompressed_model(
        tmp_path, monkeypatch, kind, scheme, group, stored):
    """W4A16 (symmetric, groups of 128 and 32), W4A16_ASYM (zero points), W8A16 (per channel), FP8_DYNAMIC
    (per channel), FP8 (per tensor): each weight kept in the format it maps to, dequantized as the package
    dequantizes it, and the model's logits as the package's decompressed model's."""
    from conveyor.model.checkpoint import open_checkpoint

    model = tiny(kind)
    quantized = compressed_tensors_checkpoint(tmp_path / "quantized", model, scheme, group)
    reference = decompressed_checkpoint(tmp_path / "reference", quantized)
    ours, theirs = open_checkpoint(quantized), open_checkpoint(reference)
    for name in linear_names(model):
        assert ours.packed(name).format == stored, name
        expected = theirs.get(name)
        # (zero points: Q4_1's offset, -scale * zero, is rounded to float16: a few thousandths of a step)
        tolerance = 1e-3 * float(expected.abs().max()) if scheme.endswith("ASYM") else 0.0
        torch.testing.assert_close(ours.get(name), expected, rtol=0, atol=tolerance)
    assert ours.packed("model.embed_tokens.weight") is None and ours.packed("lm_head.weight") is None
    assert_served_packed(quantized, reference, 1e-4 if scheme in ("W4A16", "W8A16") else 3e-3, monkeypatch)


def pack_words(values: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """Unsigned values ``[..., n]`` -> int32 ``[..., n * bits / 32]``: consecutive values share a word, the
    first in its lowest bits."""
    per_word = 32 // bits
    v = values.to(torch.int64).reshape(*values.shape[:-1], -1, per_word)
    words = (v << (torch.arange(per_word) * bits)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def int_quantize(weight: torch.Tensor, group: int, symmetric: bool):
    """Round to nearest per group of input features, 4 bits: unsigned q with ``w ~= scale * (q - zero)``,
    scales in float16, zero 8 where symmetric; and the weights that stands for."""
    out, columns = weight.shape
    w = weight.double().reshape(out, columns // group, group)
    if symmetric:
        scale = (w.abs().amax(-1) / 7).half().double()
        zero = torch.full_like(scale, 8)
    else:
        low, high = w.amin(-1).clamp_max(0), w.amax(-1).clamp_min(0)
        scale = ((high - low) / 15).half().double()
        zero = (-low / scale).round().clamp(1, 15)  # (GPTQ's original format stores zero - 1: not 0)
    q = (w / scale[..., None] + zero[..., None]).round().clamp(0, 15)
    dequantized = ((q - zero[..., None]) * scale[..., None]).reshape(out, columns).float()
    return q.reshape(out, columns).to(torch.uint8), scale, zero.to(torch.uint8), dequantized


def write_int4_checkpoint(path, reference_path, model, layout: str, group: int, symmetric: bool = True,
                          act_order: bool = False):
    """``model``'s linear layers in GPTQ's or AWQ's layout at ``path``; the weights they stand for (``scale *
    (q - zero)``) as a float checkpoint at ``reference_path``."""
    from safetensors.torch import save_file

    model = model.float()
    model.save_pretrained(reference_path)  # (its config.json; its weights are replaced below)
    floats = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    packed = {}
    for name in linear_names(model):
        layer = name.removesuffix(".weight")
        q, scale, zero, floats[name] = int_quantize(floats[name], group, symmetric)
        out, columns = q.shape
        qt = q.t()  # [in, out]
        if layout == "gptq":  # eight input features to a word, down the columns
            words = {"qweight": pack_words(qt.reshape(columns // 8, 8, out).transpose(1, 2)).squeeze(-1),
                     "qzeros": pack_words(zero.t() - 1), "scales": scale.t().half(),
                     "g_idx": (torch.arange(columns) // group).int()}
            if act_order:  # (groups of input features that are not runs: the features' order permuted)
                words["g_idx"] = words["g_idx"][torch.randperm(columns, generator=torch.Generator().manual_seed(0))]
        else:  # AWQ: eight outputs to a word, in its order
            order = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])
            interleave = lambda t: t.reshape(t.shape[0], -1, 8)[..., order]  # noqa: E731
            words = {"qweight": pack_words(interleave(qt)).flatten(1),
                     "qzeros": pack_words(interleave(zero.t())).flatten(1), "scales": scale.t().half()}
        packed.update({f"{layer}.{key}": value.contiguous() for key, value in words.items()})
    save_file(floats, str(reference_path / "model.safetensors"))
    path.mkdir()
    kept = {k: v for k, v in floats.items() if k not in linear_names(model)}
    save_file({**kept, **packed}, str(path / "model.safetensors"))
    config = json.loads((reference_path / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order, "sym": symmetric,
         "checkpoint_format": "gptq"} if layout == "gptq" else
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"})
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("layout, symmetric, stored", [("gptq", True, "Q4_0"), ("gptq", False, "Q4_1"),
                                                       ("awq", False, "Q4_1")])
def test_gptq_and_awq_int4_checkpoints_load_packed_and_compute_the_model_they_stand_for(
        tmp_path, monkeypatch, layout, symmetric, stored):
    """A tiny Llama written in GPTQ's layout (symmetric; with zero points, stored minus one) and AWQ's (its
    word order), groups of 128: each weight read back as ``scale * (q - zero)``, kept packed, and the logits
    the model's with those weights."""
    from conveyor.model.checkpoint import open_checkpoint

    model = tiny("llama")
    path = write_int4_checkpoint(tmp_path / "quantized", tmp_path / "reference", model, layout, 128, symmetric)
    ours, theirs = open_checkpoint(path), open_checkpoint(tmp_path / "reference")
    for name in linear_names(model):
        assert ours.packed(name).format == stored, name
        expected = theirs.get(name)
        tolerance = 0.0 if symmetric else 1e-3 * float(expected.abs().max())
        torch.testing.assert_close(ours.get(name), expected, rtol=0, atol=tolerance)
    assert_served_packed(path, tmp_path / "reference", 1e-4 if symmetric else 3e-3, monkeypatch)


def test_unsupported_quantization_is_refused_in_one_line_naming_what_is_supported(tmp_path):
    """GPTQ with act-order groups, compressed-tensors in groups of 16, 3-bit GPTQ and an unknown method:
    each refused when the checkpoint is opened, in one line that names the supported formats."""
    model = tiny("llama")
    checkpoints = {
        "act-order": write_int4_checkpoint(tmp_path / "act", tmp_path / "act-ref", model, "gptq", 128,
                                           act_order=True),
        "groups of 16": compressed_tensors_checkpoint(tmp_path / "g16", tiny("llama"), "W4A16", 16),
    }
    for name, change in {"3-bit": {"bits": 3}, "unknown": {"quant_method": "hqq"}}.items():
        other = tmp_path / name
        other.mkdir()
        (other / "model.safetensors").symlink_to(checkpoints["act-order"] / "model.safetensors")
        config = json.loads((checkpoints["act-order"] / "config.json").read_text())
        config["quantization_config"].update(change, desc_act=False)
        (other / "config.json").write_text(json.dumps(config))
        checkpoints[name] = other
    for name, path in checkpoints.items():
        with pytest.raises(ConfigError) as error:
            open_model(ModelConfig(path=str(path)))
        message = str(error.value)
        assert "\n" not in message and "supported: compressed-tensors" in message, (name, message)
