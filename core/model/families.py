"""The model families Conveyor runs, read from Hugging Face's config.json.

Every family is the one decoder of ``conveyor.model.decoder_model`` with its quirks
switched on in the ``ModelSpec``; a family here is only how its config names
them. Adding one is a function that returns those fields, and an entry in
``FAMILIES``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from conveyor.model.spec import ModelSpec

# Hugging Face activation names -> the decoder's
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "gelu": "gelu"}


def _windows(config: dict, default_sliding: Callable[[int], bool]) -> tuple[int, ...]:
    """Each layer's sliding window: from ``layer_types`` where the config lists them, else by the family's rule."""
    window = config.get("sliding_window") or 0
    layers = config["num_hidden_layers"]
    if not window:
        return ()
    types = config.get("layer_types")
    sliding = [t == "sliding_attention" for t in types] if types else [default_sliding(i) for i in range(layers)]
    return tuple(window if s else 0 for s in sliding) if any(sliding) else ()


def _llama(config: dict) -> dict:
    return {}


def _mistral(config: dict) -> dict:
    # Mistral (and Phi-3) slide every layer's window where the config sets one
    return {"layer_windows": _windows(config, lambda i: True)}


def _qwen2(config: dict) -> dict:
    use = bool(config.get("use_sliding_window"))
    first = config.get("max_window_layers", config["num_hidden_layers"])
    fields = {"attention_bias": True}
    if use:
        fields["layer_windows"] = _windows(config, lambda i: i >= first)
    return fields


def _qwen3(config: dict) -> dict:
    fields = {**_qwen2(config), "qk_norm": True}
    fields["attention_bias"] = bool(config.get("attention_bias", False))
    return fields


def _phi3(config: dict) -> dict:
    rope = config.get("rope_parameters") or {}
    partial = config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"Phi-3 with partial_rotary_factor {partial} is not supported; supported: 1.0")
    return _mistral(config)


def _moe(config: dict, width: int) -> dict:
    layers = config["num_hidden_layers"]
    dense = set(config.get("mlp_only_layers") or [])
    step = config.get("decoder_sparse_step") or 1
    return {
        "num_experts": config.get("num_experts") or config.get("num_local_experts"),
        "num_experts_per_tok": config["num_experts_per_tok"],
        "moe_intermediate_size": width,
        "moe_layers": tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)),
    }


def _mixtral(config: dict) -> dict:
    return {**_mistral(config), **_moe(config, config["intermediate_size"]), "norm_topk_prob": True}


def _qwen2_moe(config: dict) -> dict:
    return {
        **_qwen2(config), **_moe(config, config["moe_intermediate_size"]),
        "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
        "shared_expert_intermediate_size": config.get("shared_expert_intermediate_size") or 0,
    }


def _qwen3_moe(config: dict) -> dict:
    return {**_qwen3(config), **_moe(config, config["moe_intermediate_size"]),
            "norm_topk_prob": bool(config.get("norm_topk_prob", True))}


def _gemma2(config: dict) -> dict:
    return {
        **_gemma(config, lambda i: i % 2 == 0),
        "attn_softcap": float(config.get("attn_logit_softcapping") or 0.0),
        "final_softcap": float(config.get("final_logit_softcapping") or 0.0),
    }


def _gemma3(config: dict) -> dict:
    pattern = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6
    fields = {**_gemma2(config), **_gemma(config, lambda i: (i + 1) % pattern != 0), "qk_norm": True}
    rope = config.get("rope_parameters") or {}
    if "sliding_attention" in rope:  # per layer type (transformers 5)
        fields["local_rope_theta"] = float(rope["sliding_attention"].get("rope_theta", 10_000.0))
        fields["rope_theta"] = float(rope["full_attention"].get("rope_theta", 1_000_000.0))
        fields["rope_scaling"] = rope["full_attention"]
    else:
        fields["local_rope_theta"] = float(config.get("rope_local_base_freq", 10_000.0))
    return fields


def _gemma(config: dict, default_sliding: Callable[[int], bool]) -> dict:
    hidden = config["hidden_size"]
    return {
        "norm_weight_offset": 1.0,
        "sandwich_norms": True,
        "embedding_multiplier": math.sqrt(hidden),
        "attention_scale": float(config.get("query_pre_attn_scalar") or config.get("head_dim") or 1) ** -0.5,
        "layer_windows": _windows(config, default_sliding),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", True)),
    }


# Hugging Face architecture -> the spec fields its config sets beyond Llama's
FAMILIES: dict[str, Callable[[dict], dict]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _mistral,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "Phi3ForCausalLM": _phi3,
    "Gemma2ForCausalLM": _gemma2,
    "Gemma3ForCausalLM": _gemma3,
    "MixtralForCausalLM": _mixtral,
    "Qwen2MoeForCausalLM": _qwen2_moe,
    "Qwen3MoeForCausalLM": _qwen3_moe,
}


def spec_from_hf_config(config: dict) -> ModelSpec:
    """ModelSpec from a Hugging Face config.json dict.

    Raises:
        ValueError: the architecture, its activation or its rope scaling is not supported (the message lists
            what is).
    """
    arch = (config.get("architectures") or ["?"])[0]
    if arch not in FAMILIES:
        raise ValueError(f"architecture {arch!r} is not supported; supported: {', '.join(FAMILIES)}")
    num_heads = config["num_attention_heads"]
    hidden = config["hidden_size"]
    act = config.get("hidden_activation") or config.get("hidden_act") or "silu"
    if act not in ACTIVATIONS:
        raise ValueError(f"{arch}: activation {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    rope = config.get("rope_parameters") or {}
    fields = {
        "architecture": arch,
        "vocab_size": config["vocab_size"],
        "hidden_size": hidden,
        "intermediate_size": config["intermediate_size"],
        "num_layers": config["num_hidden_layers"],
        "num_heads": num_heads,
        "num_kv_heads": config.get("num_key_value_heads") or num_heads,
        "head_dim": config.get("head_dim") or hidden // num_heads,
        "rope_theta": float(config.get("rope_theta", rope.get("rope_theta", 10000.0))),
        "rms_norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "max_position_embeddings": config.get("max_position_embeddings", 2048),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        "rope_scaling": config.get("rope_scaling") or rope or None,
        "attention_bias": bool(config.get("attention_bias", False)),
        "activation": ACTIVATIONS[act],
    }
    fields.update(FAMILIES[arch](config))
    return ModelSpec(**fields)
