"""Tiny transformers checkpoints written as GGUF the way llama.cpp's converter writes them, with the names
from the ``gguf`` package's own tensor map; the tests read them back through Conveyor's loader."""

from __future__ import annotations

import gguf
import numpy as np

# transformers model_type -> llama.cpp architecture
GGUF_ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
              "gemma2": "gemma2", "gemma3_text": "gemma3", "mixtral": "llama", "qwen2_moe": "qwen2moe",
              "qwen3_moe": "qwen3moe"}


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter for Llama: half-split RoPE rows -> interleaved pairs."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape
    )


def write_gguf(path, model, qtype: gguf.GGMLQuantizationType, quantize=None) -> dict[str, np.ndarray]:
    """Write a transformers model as GGUF with its 2-D weights in ``qtype`` (``quantize(array, qtype)`` makes
    the bytes; default: the gguf package's quantizer); return the float weights by Hugging Face name."""
    cfg = model.config
    arch = GGUF_ARCHS[cfg.model_type]
    names = gguf.TensorNameMap(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), cfg.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = getattr(cfg, "rope_parameters", None) or {}
    writer.add_rope_freq_base((rope.get("full_attention") or rope).get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if getattr(cfg, "sliding_window", None):
        writer.add_sliding_window(cfg.sliding_window)
    if arch.startswith("gemma"):
        if cfg.query_pre_attn_scalar != head_dim:
            writer.add_attention_scale(cfg.query_pre_attn_scalar**-0.5)
        if arch == "gemma3":
            writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
        if getattr(cfg, "attn_logit_softcapping", None):
            writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        if getattr(cfg, "final_logit_softcapping", None):
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if arch != "llama":  # (Mixtral's experts are feed_forward_length wide)
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
            writer.add_expert_weights_norm(cfg.norm_topk_prob)
        if getattr(cfg, "shared_expert_intermediate_size", 0):
            writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    weights = {}
    for name, array in _tensors(model).items():
        weights[name] = array
        base, _, kind = name.rpartition(".")
        gguf_name = names.get_name(base)
        assert gguf_name is not None, f"the gguf package maps no {arch} tensor to {base!r}"
        if arch == "llama" and base.endswith("q_proj"):
            array = llama_cpp_permute(array, cfg.num_attention_heads)
        elif arch == "llama" and base.endswith("k_proj"):
            array = llama_cpp_permute(array, cfg.num_key_value_heads)
        elif arch.startswith("gemma") and base.endswith("norm"):
            array = array + 1.0  # llama.cpp's Gemma converters store 1 + weight
        name = f"{gguf_name}.{kind}"
        if array.ndim >= 2 and qtype != gguf.GGMLQuantizationType.F32 and not base.endswith("norm"):
            writer.add_tensor(name, (quantize or gguf.quants.quantize)(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


def _tensors(model) -> dict[str, np.ndarray]:
    """The model's float32 weights by Hugging Face name; a mixture's experts stacked per projection
    (``mlp.experts.gate_proj.weight`` ``[experts, rows, columns]``, as llama.cpp stores them)."""
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        array = tensor.float().numpy()
        if name.endswith("experts.gate_up_proj"):  # transformers keeps [experts, gate rows + up rows, columns]
            gate, up = np.split(array, 2, axis=1)
            tensors[name.replace("gate_up_proj", "gate_proj.weight")] = gate
            tensors[name.replace("gate_up_proj", "up_proj.weight")] = up
        elif name.endswith("experts.down_proj"):
            tensors[name + ".weight"] = array
        else:
            tensors[name] = array
    return tensors
