"""One decoder layer of every family Conveyor runs (``conveyor.model.decoder_model``): norms, Q/K/V with the
rotary embedding, attention through the backend, the output projection, and the MLP (gated, or a
mixture of experts), with each family's quirks switched on by the ``ModelSpec``."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from conveyor import native
from conveyor.model.layers import LayerOptions, Linear, RMSNorm, apply_rotary
from conveyor.model.lora import LoraPart, LoraTarget
from conveyor.model.moe import MoE
from conveyor.model.parallel import Placement
from conveyor.model.spec import ModelSpec

# attention(layer_index, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DecoderLayer:
    def __init__(self, spec: ModelSpec, index: int, options: LayerOptions, cache_index: int | None = None):
        """The layer's blocks, declared: ``loaders()`` fills them from a checkpoint.

        Args:
            index: the layer's number in the checkpoint.
            options: ``options.group`` is this worker's place under tensor parallelism: it keeps its heads' rows
                of Q, K, V, its columns of o_proj, its part of the MLP (column-parallel gate/up, row-parallel
                down), and all-reduces after o_proj and down.
            cache_index: the layer's number in this worker's KV storage (its stage's layers count from 0).
        """
        prefix = f"model.layers.{index}."
        quant = options.quant
        self.group = options.group
        placement = self.group.placement
        head_dim = spec.head_dim
        heads, kv_heads = placement.heads(spec.num_heads), placement.kv_heads(spec.num_kv_heads)
        columns = placement.split(spec.intermediate_size)

        def norm(name: str, fuse: bool = options.fused) -> RMSNorm:
            return RMSNorm(spec.rms_norm_eps, fuse, prefix + name, spec.norm_weight_offset)

        attn = prefix + "self_attn."
        self.index = index
        self.cache_index = index if cache_index is None else cache_index
        self.num_heads = len(heads)
        self.num_kv_heads = len(kv_heads)
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.input_norm = norm("input_layernorm.weight")
        # (per head, on views of the qkv output: torch ops)
        self.q_norm = norm("self_attn.q_norm.weight", False) if spec.qk_norm else None
        self.k_norm = norm("self_attn.k_norm.weight", False) if spec.qk_norm else None
        self.local_rope = bool(spec.local_rope_theta and spec.window(index))
        # Q, K, V in one matmul and gate, up in another: fewer, larger GEMMs.
        self.qkv = Linear(quant, [(attn + p + ".weight", part, head_dim) for p, part in
                                  (("q_proj", heads), ("k_proj", kv_heads), ("v_proj", kv_heads))],
                          bias=spec.attention_bias)
        self.o_proj = Linear(quant, [(attn + "o_proj.weight", None, 1)], inputs=_part(heads, head_dim, placement))
        # Gemma: attention output -> post_attention_layernorm; the MLP: pre_ and post_feedforward_layernorm
        self.attn_out_norm = norm("post_attention_layernorm.weight") if spec.sandwich_norms else None
        self.post_norm = norm("pre_feedforward_layernorm.weight" if spec.sandwich_norms else
                              "post_attention_layernorm.weight")
        self.mlp_out_norm = norm("post_feedforward_layernorm.weight") if spec.sandwich_norms else None
        self.activation = spec.activation
        mlp = prefix + "mlp."
        self.moe: MoE | None = None
        if spec.is_moe(index):
            # (the Triton grouped kernel reads the experts' weights as they are: CUDA, unquantized)
            stacked = options.device.type == "cuda" and quant.name == "none"
            self.moe = MoE(spec, mlp, options, stacked)
        else:
            self.gate_up = Linear(quant, [(mlp + "gate_proj.weight", columns, 1), (mlp + "up_proj.weight", columns, 1)])
            self.down = Linear(quant, [(mlp + "down_proj.weight", None, 1)], inputs=_part(columns, 1, placement))
        self.intermediate_size = len(columns)
        self.fused = options.fused
        self._shares = (heads, kv_heads, columns, spec.hidden_size, placement)

    def loaders(self) -> list[RMSNorm | Linear | MoE]:
        """The blocks that read the checkpoint, each by its own ``load(ckpt, options)``."""
        mlp: list[Linear | MoE] = [self.moe] if self.moe is not None else [self.gate_up, self.down]
        return [*self.norms(), self.qkv, self.o_proj, *mlp]

    def __call__(
        self,
        h: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionFn,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One block over the residual stream ``h + delta`` (``cos``, ``sin``: its rotary tables).

        ``h`` is updated in place (the residual adds are folded into the norms);
        returns it and the MLP's output, which the next block (or the final norm) adds.
        """
        num_tokens = h.shape[0]
        qkv = self.qkv(self.input_norm(h, delta))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.fused:
            native.rotary_(q, cos, sin)
            native.rotary_(k, cos, sin)
        else:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = attention(self.cache_index, q, k, v)
        attended = self.group.all_reduce(self.o_proj(out.reshape(num_tokens, self.q_size)))
        if self.attn_out_norm is not None:
            attended = self.attn_out_norm(attended)
        x = self.post_norm(h, attended)
        if self.moe is not None:
            mlp = self.group.all_reduce(self.moe(x))
            return h, mlp if self.mlp_out_norm is None else self.mlp_out_norm(mlp)
        gate_up = self.gate_up(x)
        if self.fused and self.activation == "silu":
            mlp = self.group.all_reduce(self.down(native.silu_mul(gate_up)))
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            if self.activation == "silu":
                gate = F.silu(gate)
            else:
                gate = F.gelu(gate, approximate="tanh" if self.activation == "gelu_tanh" else "none")
            mlp = self.group.all_reduce(self.down(gate * up))
        return h, mlp if self.mlp_out_norm is None else self.mlp_out_norm(mlp)

    def lora_targets(self) -> list[LoraTarget]:
        """The projections LoRA adapters may change, with where each Hugging Face module's rows sit in them."""
        heads, kv_heads, columns, hidden, placement = self._shares
        q, kv, hd = self.q_size, self.kv_size, self.head_dim

        def part(block: int, share: range, unit: int, offset: int) -> LoraPart:
            return LoraPart(block, slice(share.start * unit, share.stop * unit), offset)

        whole = LoraPart(0, slice(None), 0)
        targets = [
            LoraTarget(self.qkv, {"q_proj": part(0, heads, hd, 0), "k_proj": part(1, kv_heads, hd, q),
                                  "v_proj": part(2, kv_heads, hd, q + kv)}, hidden, None),
            LoraTarget(self.o_proj, {"o_proj": whole}, q, _part(heads, hd, placement)),
        ]
        if self.moe is None:
            width = self.intermediate_size
            targets += [
                LoraTarget(self.gate_up, {"gate_proj": part(0, columns, 1, 0), "up_proj": part(1, columns, 1, width)},
                           hidden, None),
                LoraTarget(self.down, {"down_proj": whole}, width, _part(columns, 1, placement)),
            ]
        return targets

    def linears(self) -> list[Linear]:
        if self.moe is not None:
            return [self.qkv, self.o_proj, *self.moe.linears()]
        return [self.qkv, self.o_proj, self.gate_up, self.down]

    def norms(self) -> list[RMSNorm]:
        norms = (self.input_norm, self.q_norm, self.k_norm, self.attn_out_norm, self.post_norm, self.mlp_out_norm)
        return [n for n in norms if n is not None]


def _part(part: range, unit: int, placement: Placement) -> slice | None:
    """The input columns a row-parallel layer keeps (None: all of them, no tensor parallelism)."""
    return slice(part.start * unit, part.stop * unit) if placement.tp_size > 1 else None
