"""The architecture hyperparameters of a decoder checkpoint, quirks of each family included."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec


class ModelSpec(msgspec.Struct, frozen=True):
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    # the context length the model was trained for
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Hugging Face's rope_scaling dict (rope_type "llama3" or "linear"), or None
    rope_scaling: dict | None = None
    # bias on the q/k/v projections (Qwen2)
    attention_bias: bool = False
    # q and k RMS-normed per head before the rotary embedding (Qwen3, Gemma 3)
    qk_norm: bool = False
    # norms scale by (offset + weight): Gemma stores weight - 1 (the loader adds the offset back)
    norm_weight_offset: float = 0.0
    # Gemma 2/3: the attention's and the MLP's outputs are normed before they join the residual stream
    # (post_attention_layernorm, post_feedforward_layernorm; the MLP's input norm is pre_feedforward_layernorm)
    sandwich_norms: bool = False
    # the MLP gate's activation: "silu" (SwiGLU), "gelu_tanh" or "gelu" (GeGLU)
    activation: str = "silu"
    # the embeddings are multiplied by this (Gemma: sqrt(hidden_size))
    embedding_multiplier: float = 1.0
    # what q . k is multiplied by; 0: head_dim ** -0.5
    attention_scale: float = 0.0
    # attention scores and final logits soft-capped: c * tanh(x / c) (Gemma 2; 0: not capped)
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    # per layer, the keys a query sees, its own included (a sliding window); 0 for global attention.
    # Empty: every layer global.
    layer_windows: tuple[int, ...] = ()
    # Gemma 3: the rotary base of the sliding-window layers (without rope scaling); 0: rope_theta everywhere
    local_rope_theta: float = 0.0
    # mixture of experts (Mixtral, Qwen MoE): experts in each MoE layer (0: dense MLPs only), how many each
    # token takes, and each expert's MLP width
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    # the top-k routing weights renormalized to sum to 1 (Mixtral always; Qwen where norm_topk_prob)
    norm_topk_prob: bool = True
    # Qwen2-MoE: an expert every token takes, this wide, gated by sigmoid(shared_expert_gate . x); 0: none
    shared_expert_intermediate_size: int = 0
    # per layer, whether its MLP is the mixture (empty: every layer's, where num_experts)
    moe_layers: tuple[bool, ...] = ()

    def is_moe(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts."""
        return bool(self.num_experts) and (self.moe_layers[layer] if self.moe_layers else True)

    def window(self, layer: int) -> int:
        """Layer ``layer``'s sliding window (0: global attention)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def softmax_scale(self) -> float:
        return self.attention_scale or self.head_dim**-0.5


@dataclass(frozen=True)
class LayerAttention:
    """How one layer attends (the model's choice; Llama's is the scale alone)."""

    # what q . k is multiplied by (head_dim ** -0.5 for most models)
    scale: float
    # keys each query sees, its own included: a sliding window (0: every key before it)
    window: int = 0
    # scores become softcap * tanh(score / softcap) before the softmax (Gemma 2; 0: not capped)
    softcap: float = 0.0
