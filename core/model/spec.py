"""The architecture hyperparameters of a Llama-family checkpoint."""

from __future__ import annotations

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
