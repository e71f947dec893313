"""GGUF checkpoints (llama.cpp's format), dequantized with the ``gguf`` package."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import torch

from conveyor.model.checkpoint import Checkpoint
from conveyor.model.spec import ModelSpec

# GGUF tensor name -> Hugging Face name ({i} is the layer)
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for tensors we do not map."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    return None


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp's converter reorders each head's rows from the half-split RoPE
    layout (x[:d/2], x[d/2:]) to interleaved pairs (x0, x1, x2, ...); this
    puts them back so one RoPE implementation serves GGUF and safetensors.
    """
    shape = weight.shape
    return weight.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


class GGUFCheckpoint(Checkpoint):
    """A ``.gguf`` file of a Llama-architecture model."""

    def __init__(self, path: Path):
        self.path = path
        self.reader = gguf.GGUFReader(str(path))
        self.metadata = self.reader.fields
        arch = self.field("general.architecture")
        if arch != "llama":
            raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; supported: 'llama'")
        self._tensors = {}
        for tensor in self.reader.tensors:
            name = hf_name(tensor.name)
            if name is not None:
                self._tensors[name] = tensor
        self._extra = {t.name: t for t in self.reader.tensors}
        self.spec = self._spec()

    def field(self, key: str, default=None):
        field = self.metadata.get(key)
        return default if field is None else field.contents()

    def _spec(self) -> ModelSpec:
        a = "llama."
        num_heads = self.field(a + "attention.head_count")
        hidden = self.field(a + "embedding_length")
        tokens = self.field("tokenizer.ggml.tokens") if "tokenizer.ggml.tokens" in self.metadata else None
        vocab = self.field(a + "vocab_size") or (len(tokens) if tokens else None)
        if vocab is None:
            vocab = int(self._tensors["model.embed_tokens.weight"].shape[1])
        scaling = None
        if self.field(a + "rope.scaling.type") == "linear":
            scaling = {"rope_type": "linear", "factor": float(self.field(a + "rope.scaling.factor"))}
        return ModelSpec(
            architecture="LlamaForCausalLM",
            vocab_size=int(vocab),
            hidden_size=int(hidden),
            intermediate_size=int(self.field(a + "feed_forward_length")),
            num_layers=int(self.field(a + "block_count")),
            num_heads=int(num_heads),
            num_kv_heads=int(self.field(a + "attention.head_count_kv", num_heads)),
            head_dim=int(self.field(a + "attention.key_length", hidden // num_heads)),
            rope_theta=float(self.field(a + "rope.freq_base", 10000.0)),
            rms_norm_eps=float(self.field(a + "attention.layer_norm_rms_epsilon", 1e-5)),
            max_position_embeddings=int(self.field(a + "context_length", 2048)),
            tie_word_embeddings="lm_head.weight" not in self._tensors,
            rope_scaling=scaling,
        )

    def _read(self, tensor) -> torch.Tensor:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        # GGUF lists dimensions fastest-first; torch wants them slowest-first.
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        return torch.from_numpy(np.array(array, dtype=np.float32).reshape(shape))

    def get(self, name: str) -> torch.Tensor:
        if name == "lm_head.weight" and self.spec.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        try:
            tensor = self._tensors[name]
        except KeyError:
            raise KeyError(f"{self.path}: tensor {name!r} is missing") from None
        weight = self._read(tensor)
        if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
            weight = unpermute_rows(weight, self.spec.num_heads)
        elif name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
            weight = unpermute_rows(weight, self.spec.num_kv_heads)
        return weight

    def rope_freq_factors(self) -> torch.Tensor | None:
        tensor = self._extra.get("rope_freqs.weight")
        return None if tensor is None else self._read(tensor)
