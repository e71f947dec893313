"""GGUF checkpoints (llama.cpp's format), dequantized with the ``gguf`` package (or kept packed).

Tensors are renamed to Hugging Face's names and undone where llama.cpp's
converter changed them (Llama's Q/K row order; Gemma's norms, stored with
the +1 added), and the hyperparameters are read from the ``{arch}.*`` keys,
so the decoder sees one checkpoint whatever the format.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import gguf
import numpy as np
import torch

from conveyor.model import ggml
from conveyor.model.checkpoint import Checkpoint
from conveyor.model.gguf_file import GGUFFile
from conveyor.model.spec import ModelSpec

# GGUF tensor name -> Hugging Face name ({i} is the layer)
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixtures of experts: the router, every expert's weights stacked [experts, rows, columns], the shared expert
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# where an architecture names a part otherwise
_ARCH_LAYER_NAMES = {
    # Gemma: ffn_norm is the MLP's input norm; the attention's and the MLP's outputs have norms of their own
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    # Phi-3: ffn_up holds gate and up, fused
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
}
_ARCH_LAYER_NAMES["gemma3"] = _ARCH_LAYER_NAMES["gemma2"]
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# GGUF architecture -> the Hugging Face architecture of the same model
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
# llama.cpp's mixtures: whether the top-k weights are renormalized (where the file does not say)
_RENORMALIZED = {"llama": True, "qwen2moe": False, "qwen3moe": True}
_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(\w+)\.weight")
# weight formats read (dequantized to float32 at load)
T = gguf.GGMLQuantizationType
TYPES = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K)


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for tensors we do not map."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    if match is None:
        return None
    layer, part, kind = match.groups()
    name = _ARCH_LAYER_NAMES.get(arch, {}).get(part) or _LAYER_NAMES.get(part)
    return None if name is None else f"model.layers.{layer}.{name}.{kind}"


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp's converter reorders each head's rows from the half-split RoPE
    layout (x[:d/2], x[d/2:]) to interleaved pairs (x0, x1, x2, ...); this
    puts them back so one RoPE implementation serves GGUF and safetensors.
    """
    shape = weight.shape
    return weight.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


class GGUFCheckpoint(Checkpoint):
    """A ``.gguf`` file of one of ``ARCHITECTURES``.

    Raises (at open):
        ValueError: the architecture or a weight's format is not supported (the message lists what is).
    """

    def __init__(self, path: Path):
        self.path = path
        self.file = GGUFFile(path)
        self.metadata = self.file.fields
        self.arch = arch = self.field("general.architecture")
        if arch not in ARCHITECTURES:
            raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                             f"{', '.join(ARCHITECTURES)}")
        self._tensors = {}
        for tensor in self.file.tensors:
            if tensor.tensor_type not in TYPES:
                raise ValueError(f"{path}: tensor {tensor.name!r} is stored as {tensor.tensor_type.name}, which is "
                                 f"not supported; supported: {', '.join(t.name for t in TYPES)}")
            name = hf_name(tensor.name, arch)
            if name is not None:
                self._tensors[name] = tensor
        self._extra = {t.name: t for t in self.file.tensors}
        # the last stacked experts tensor read, dequantized: (name, [experts, rows, columns])
        self._experts: tuple[str, torch.Tensor] | None = None
        self.spec = self._spec()

    def field(self, key: str, default=None):
        return self.metadata.get(key, default)

    def _spec(self) -> ModelSpec:
        a = self.arch + "."
        num_heads = int(self.field(a + "attention.head_count"))
        hidden = int(self.field(a + "embedding_length"))
        tokens = self.field("tokenizer.ggml.tokens")
        vocab = self.field(a + "vocab_size") or (len(tokens) if tokens else None)
        if vocab is None:
            vocab = int(self._tensors["model.embed_tokens.weight"].shape[1])
        scaling = None
        if self.field(a + "rope.scaling.type") == "linear":
            scaling = {"rope_type": "linear", "factor": float(self.field(a + "rope.scaling.factor"))}
        head_dim = int(self.field(a + "attention.key_length", hidden // num_heads))
        num_layers = int(self.field(a + "block_count"))
        fields = {}
        window = int(self.field(a + "attention.sliding_window", 0) or 0)
        if self.arch in ("gemma2", "gemma3"):
            # llama.cpp's rules where the file does not say: every other layer slides (Gemma 2), five of every
            # six (Gemma 3), whose sliding layers rotate with base 10,000; the 27B models scale q by
            # hidden / heads, the others by head_dim. Norms are stored with Gemma's +1 added.
            pattern = self.field(a + "attention.sliding_window_pattern", 2 if self.arch == "gemma2" else 6)
            sliding = pattern if isinstance(pattern, list) else [i % pattern < pattern - 1 for i in range(num_layers)]
            big = num_layers == {"gemma2": 46, "gemma3": 62}[self.arch]
            fields = {
                "sandwich_norms": True, "norm_weight_offset": 1.0, "activation": "gelu_tanh", "embedding_multiplier": math.sqrt(hidden),
                "attention_scale": float(self.field(a + "attention.scale", 0.0) or 0.0)
                or (hidden / num_heads if big else head_dim) ** -0.5,
                "attn_softcap": float(self.field(a + "attn_logit_softcapping", 0.0) or 0.0),
                "final_softcap": float(self.field(a + "final_logit_softcapping", 0.0) or 0.0),
                "layer_windows": tuple(window if s else 0 for s in sliding) if window else (),
            }
            if self.arch == "gemma3":
                fields["local_rope_theta"] = float(self.field(a + "rope.freq_base_swa", 10_000.0))
        elif window:  # (Phi-3, Mistral: every layer)
            fields["layer_windows"] = (window,) * num_layers
        experts = int(self.field(a + "expert_count", 0) or 0)
        architecture = ARCHITECTURES[self.arch]
        if experts:
            # (llama with experts is Mixtral; a layer with a router is a mixture, the others dense)
            architecture = "MixtralForCausalLM" if self.arch == "llama" else architecture
            fields.update(
                num_experts=experts,
                num_experts_per_tok=int(self.field(a + "expert_used_count")),
                moe_intermediate_size=int(self.field(a + "expert_feed_forward_length", 0)
                                          or self.field(a + "feed_forward_length")),
                norm_topk_prob=bool(self.field(a + "expert_weights_norm", _RENORMALIZED[self.arch])),
                shared_expert_intermediate_size=int(self.field(a + "expert_shared_feed_forward_length", 0) or 0),
                moe_layers=tuple(f"model.layers.{i}.mlp.gate.weight" in self._tensors for i in range(num_layers)),
            )
        return ModelSpec(
            architecture=architecture,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(self.field(a + "feed_forward_length", 0) or 0),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(self.field(a + "attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rope_theta=float(self.field(a + "rope.freq_base", 10000.0)),
            rms_norm_eps=float(self.field(a + "attention.layer_norm_rms_epsilon", 1e-5)),
            max_position_embeddings=int(self.field(a + "context_length", 2048)),
            tie_word_embeddings="lm_head.weight" not in self._tensors,
            rope_scaling=scaling,
            attention_bias="model.layers.0.self_attn.q_proj.bias" in self._tensors,
            qk_norm="model.layers.0.self_attn.q_norm.weight" in self._tensors,
            **fields,
        )

    def _read(self, tensor) -> torch.Tensor:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        # GGUF lists dimensions fastest-first; torch wants them slowest-first.
        shape = tuple(reversed(tensor.shape))
        return torch.from_numpy(np.array(array, dtype=np.float32).reshape(shape))

    def tensor(self, name: str) -> torch.Tensor:
        if name == "lm_head.weight" and self.spec.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        expert = _EXPERT.fullmatch(name)
        if expert is not None:  # one expert of a stacked tensor
            stacked = f"{expert.group(1)}.{expert.group(3)}.weight"
            if self._experts is None or self._experts[0] != stacked:
                self._experts = (stacked, self.tensor(stacked))
            return self._experts[1][int(expert.group(2))]
        try:
            tensor = self._tensors[name]
        except KeyError:
            raise KeyError(f"{self.path}: tensor {name!r} is missing") from None
        weight = self._read(tensor)
        if self.arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = unpermute_rows(weight, self.spec.num_heads)
        elif self.arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = unpermute_rows(weight, self.spec.num_kv_heads)
        elif self.spec.sandwich_norms and name.endswith("norm.weight"):
            weight = weight - 1.0  # (the decoder adds Gemma's +1 back, as for a Hugging Face checkpoint)
        return weight

    def packed(self, name: str) -> ggml.PackedWeight | None:
        if name == "lm_head.weight" and self.spec.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        tensor = self._tensors.get(name)
        if tensor is None or tensor.tensor_type.name not in ggml.BLOCKS or len(tensor.shape) != 2:
            return None  # (floats, one expert of a stacked tensor, a part of a fused one: read with get)
        rows, columns = tensor.shape[1], tensor.shape[0]
        # (the array maps the file: copied, so the weights do not keep the file open)
        data = torch.from_numpy(np.array(tensor.data, dtype=np.uint8).reshape(rows, -1))
        if self.arch == "llama" and name.endswith("q_proj.weight"):
            data = unpermute_rows(data, self.spec.num_heads)
        elif self.arch == "llama" and name.endswith("k_proj.weight"):
            data = unpermute_rows(data, self.spec.num_kv_heads)
        return ggml.PackedWeight(tensor.tensor_type.name, data.contiguous(), columns)

    def stored_formats(self) -> frozenset[str]:
        return frozenset(t.tensor_type.name for t in self._tensors.values() if t.tensor_type.name in ggml.BLOCKS)

    def rope_freq_factors(self) -> torch.Tensor | None:
        tensor = self._extra.get("rope_freqs.weight")
        return None if tensor is None else self._read(tensor)
