"""A Llama-family decoder over a flat batch of tokens.

The forward pass takes the tokens of many sequences concatenated (no
padding), their positions, and an ``attention`` callable that knows where
each sequence starts and where its KV cache lives. The model itself holds no
per-sequence state: the worker's KV storage and attention backend do.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from conveyor import native
from conveyor.model.checkpoint import Checkpoint
from conveyor.model.formats import packed_linear, prepack, prepacks
from conveyor.model.spec import ModelSpec
from conveyor.quant import Params, QuantMethod

logger = logging.getLogger(__name__)

# attention(layer_index, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm:
    def __init__(self, weight: torch.Tensor, eps: float, fused: bool = False):
        """
        Args:
            fused: use the C++ CPU kernel (one pass, the residual add folded in).
        """
        self.weight = weight
        self.eps = eps
        self.fused = fused

    def __call__(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """``weight * norm(x)``; with ``delta``, first ``x += delta`` in place (the residual add)."""
        if self.fused:
            return native.rms_norm(x, self.weight, self.eps, delta)
        if delta is not None:
            x.add_(delta)
        # Normalize in float32 as the reference implementation does, then scale
        # in the model dtype.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Linear:
    """A linear layer stored and applied by the selected quant method."""

    def __init__(self, method: QuantMethod, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.method = method
        self.params: Params = method.prepare(weight, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.linear(x, self.params)

    def num_bytes(self) -> int:
        return self.method.num_bytes(self.params)


class Rotary:
    """Rotary position embedding (the half-split layout of Hugging Face Llama)."""

    def __init__(self, spec: ModelSpec, max_len: int, device: torch.device, freq_factors: torch.Tensor | None):
        dim = spec.head_dim
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        inv_freq = _scale_inv_freq(inv_freq, spec.rope_scaling)
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.to(torch.float64)
        angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
        self.cos = angles.cos().float().to(device)
        self.sin = angles.sin().float().to(device)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, head_dim / 2]`` for these positions."""
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported; supported: linear, llama3")


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]`` by ``cos``, ``sin`` ``[T, head_dim / 2]`` (a new tensor)."""
    half = x.shape[-1] // 2
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class DecoderLayer:
    def __init__(
        self, spec: ModelSpec, index: int, ckpt: Checkpoint, quant: QuantMethod, dtype, device, fused: bool = False
    ):
        """
        Args:
            fused: norms, rotary and SwiGLU in the C++ CPU kernels (conveyor.native) instead of torch ops.
        """
        prefix = f"model.layers.{index}."
        get = ckpt.get

        def norm(name: str) -> RMSNorm:
            return RMSNorm(get(prefix + name).to(device=device, dtype=dtype), spec.rms_norm_eps, fused)

        attn = prefix + "self_attn."
        qkv_bias = None
        if spec.attention_bias:
            qkv_bias = torch.cat([get(attn + p + ".bias") for p in ("q_proj", "k_proj", "v_proj")])
        self.index = index
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.input_norm = norm("input_layernorm.weight")
        # Q, K, V in one matmul and gate, up in another: fewer, larger GEMMs.
        self.qkv = Linear(
            quant,
            torch.cat([get(attn + p + ".weight") for p in ("q_proj", "k_proj", "v_proj")]),
            qkv_bias,
        )
        self.o_proj = Linear(quant, get(attn + "o_proj.weight"))
        self.post_norm = norm("post_attention_layernorm.weight")
        mlp = prefix + "mlp."
        self.gate_up = Linear(quant, torch.cat([get(mlp + "gate_proj.weight"), get(mlp + "up_proj.weight")]))
        self.down = Linear(quant, get(mlp + "down_proj.weight"))
        self.intermediate_size = spec.intermediate_size
        self.fused = fused

    def __call__(
        self,
        h: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionFn,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One block over the residual stream ``h + delta``.

        ``h`` is updated in place (the residual adds are folded into the norms);
        returns it and the MLP's output, which the next block (or the final norm) adds.
        """
        num_tokens = h.shape[0]
        qkv = self.qkv(self.input_norm(h, delta))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.fused:
            native.rotary_(q, cos, sin)
            native.rotary_(k, cos, sin)
        else:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = attention(self.index, q, k, v)
        gate_up = self.gate_up(self.post_norm(h, self.o_proj(out.reshape(num_tokens, self.q_size))))
        if self.fused:
            return h, self.down(native.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return h, self.down(F.silu(gate) * up)

    def linears(self) -> list[Linear]:
        return [self.qkv, self.o_proj, self.gate_up, self.down]


class LlamaModel:
    """Llama / Mistral / Qwen2-style decoder (RMSNorm, RoPE, GQA, SwiGLU)."""

    def __init__(
        self,
        ckpt: Checkpoint,
        quant: QuantMethod,
        dtype: torch.dtype,
        device: torch.device,
        max_len: int,
        progress: Callable[[str], None] | None = None,
        fused: bool = False,
    ):
        """
        Args:
            fused: norms, rotary and SwiGLU in the C++ CPU kernels (the "cpu" attention backend's choice).
        """
        spec = ckpt.spec
        self.fused = fused
        self.spec = spec
        self.dtype = dtype
        self.device = device
        start = time.perf_counter()
        self.embed = ckpt.get("model.embed_tokens.weight").to(device=device, dtype=dtype)
        self.layers: list[DecoderLayer] = []
        for i in range(spec.num_layers):
            self.layers.append(DecoderLayer(spec, i, ckpt, quant, dtype, device, fused))
            if progress and (i + 1) % max(1, spec.num_layers // 5) == 0:
                progress(f"loaded layer {i + 1}/{spec.num_layers} ({time.perf_counter() - start:.1f} s)")
        self.norm = RMSNorm(ckpt.get("model.norm.weight").to(device=device, dtype=dtype), spec.rms_norm_eps, fused)
        # An untied head is kept prepacked where that is faster; a tied one stays the embedding table
        # (a packed copy would cost the table's memory again).
        self.lm_head: torch.Tensor | None = self.embed
        self.packed_head: torch.Tensor | None = None
        if not spec.tie_word_embeddings:
            self.lm_head = ckpt.get("lm_head.weight").to(device=device, dtype=dtype)
            if prepacks(device, dtype):
                self.packed_head, self.lm_head = prepack(self.lm_head), None
        self.rotary = Rotary(spec, max_len, device, ckpt.rope_freq_factors())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        """Run the decoder over a flat batch.

        Args:
            input_ids: ``[T]`` token ids of every scheduled token, sequences back to back.
            positions: ``[T]`` each token's position in its own sequence.
            attention: computes attention for one layer (and stores K, V).

        Returns:
            ``[T, hidden_size]`` final hidden states (after the last norm).
        """
        h = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary.tables(positions, self.dtype)
        delta = None
        for layer in self.layers:
            h, delta = layer(h, delta, cos, sin, attention)
        return self.norm(h, delta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` -> ``[N, vocab_size]`` float32 logits."""
        if self.packed_head is not None:
            return packed_linear(hidden, self.packed_head).float()
        return F.linear(hidden, self.lm_head).float()

    def num_weight_bytes(self) -> int:
        """Bytes of every weight, as stored (quantized layers at their packed size)."""
        norms = [w for layer in self.layers for w in (layer.input_norm.weight, layer.post_norm.weight)]
        dense = [self.embed, self.norm.weight, *norms]
        dense += [t for t in (self.lm_head, self.packed_head) if t is not None and t is not self.embed]
        total = sum(t.numel() * t.element_size() for t in dense)
        return total + sum(linear.num_bytes() for layer in self.layers for linear in layer.linears())
