"""The decoder of every family Conveyor runs, over a flat batch of tokens.

Llama's block (RMSNorm, RoPE, GQA attention, a gated MLP) with each
family's quirks switched on by the ``ModelSpec`` (``conveyor.model.families``
reads them from the checkpoint): q/k norms (Qwen3, Gemma 3), norms around
the attention and the MLP and a GeGLU MLP (Gemma), sliding windows and soft
caps (handed to the attention backend as ``LayerAttention``), a scaled
embedding and capped logits (Gemma 2).

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
from conveyor.model import ggml
from conveyor.model.checkpoint import Checkpoint
from conveyor.model.formats import (
    decode_copy,
    decode_layout,
    decode_linear,
    one_token_kernel,
    one_token_linear,
    packed_linear,
    prepack,
    prepacks,
)
from conveyor.model.graph_ops import linear_op, register_linear
from conveyor.model.invariant import in_row_blocks
from conveyor.model.lora import LoraLinear, LoraPart, LoraTarget
from conveyor.model.moe import MoE
from conveyor.model.spec import LayerAttention, ModelSpec
from conveyor.quant import Params, QuantMethod
from conveyor.worker.parallel import ParallelGroup, Placement

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

    def __init__(
        self, method: QuantMethod, weight: torch.Tensor | list[ggml.PackedWeight], bias: torch.Tensor | None = None,
        inputs: slice | None = None,
    ):
        """
        Args:
            weight: float32 ``[out, in]``, or the stored blocks of its parts stacked along the outputs (for a
                method whose ``packed_formats`` holds theirs; already this worker's share: see ``load_linear``).
            inputs: a row-parallel layer's share of the input columns (its sum is all-reduced after).
        """
        self.method = method
        if isinstance(weight, list):
            self.out_features = sum(part.out_features for part in weight)
            self.params: Params = method.prepare_packed(weight, bias)
        elif inputs is None:
            self.out_features = weight.shape[0]
            self.params = method.prepare(weight, bias)
        else:
            self.out_features = weight.shape[0]
            self.params = method.prepare_input_shard(weight, inputs)
        self.number = register_linear(self)
        # LoRA adapters' slots for this projection ([lora] max_loras > 0)
        self.lora: LoraLinear | None = None
        # batch-invariant mode: rows of every matmul (0: as many as come)
        self.row_block = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # one opaque op in a compiled graph, whatever the weights' format
            return linear_op(x, self.number)
        return self.apply(x)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_block:
            return in_row_blocks(self._apply, x, self.row_block)
        return self._apply(x)

    def _apply(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.linear(x, self.params)
        if self.lora is not None and self.lora.batch.active:
            return self.lora.add(x, y)
        return y

    def num_bytes(self) -> int:
        return self.method.num_bytes(self.params)


# a part of a fused linear layer: (the checkpoint's name, the rows kept (None: all), rows per unit of the range)
WeightPart = tuple[str, "range | None", int]


def load_linear(
    ckpt: Checkpoint, method: QuantMethod, parts: list[WeightPart], bias: torch.Tensor | None = None,
    inputs: slice | None = None,
) -> Linear:
    """A linear layer of the named weights' rows stacked (Q, K, V; gate, up), each kept as the checkpoint
    stores it where the method takes its format and the shard falls on whole blocks, else read as float32.

    Args:
        inputs: a row-parallel layer's share of the input columns (then ``parts`` holds one whole weight).
    """
    packed = []
    for name, part, unit in parts:
        stored = ckpt.packed(name)
        if stored is None or stored.format not in method.packed_formats:
            break
        if part is not None:
            stored = stored.rows(part.start * unit, part.stop * unit)
        if inputs is not None and (stored := stored.columns(inputs)) is None:
            logger.warning("%s: its columns %d-%d do not fall on whole blocks; it is expanded to %s",
                           name, inputs.start, inputs.stop, method.dtype)
            break
        packed.append(stored)
    else:
        return Linear(method, packed, bias)
    weights = [ckpt.get(name) for name, _, _ in parts]
    weight = torch.cat([w if part is None else w[part.start * unit : part.stop * unit]
                        for w, (_, part, unit) in zip(weights, parts)])
    return Linear(method, weight, bias, inputs)


class Rotary:
    """Rotary position embedding (the half-split layout of Hugging Face Llama)."""

    def __init__(self, dim: int, theta: float, scaling: dict | None, max_len: int, device: torch.device,
                 freq_factors: torch.Tensor | None):
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        inv_freq = _scale_inv_freq(inv_freq, scaling)
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
        self, spec: ModelSpec, index: int, ckpt: Checkpoint, quant: QuantMethod, dtype, device, fused: bool = False,
        group: ParallelGroup | None = None, cache_index: int | None = None,
    ):
        """
        Args:
            index: the layer's number in the checkpoint.
            fused: norms, rotary and SwiGLU in the C++ CPU kernels (conveyor.native) instead of torch ops.
            group: this worker's place under tensor parallelism: it keeps its heads' rows of Q, K, V, its
                columns of o_proj, its part of the MLP (column-parallel gate/up, row-parallel down), and
                all-reduces after o_proj and down.
            cache_index: the layer's number in this worker's KV storage (its stage's layers count from 0).
        """
        prefix = f"model.layers.{index}."
        get = ckpt.get
        self.group = group or ParallelGroup()
        placement = self.group.placement
        head_dim = spec.head_dim
        heads, kv_heads = placement.heads(spec.num_heads), placement.kv_heads(spec.num_kv_heads)
        columns = placement.split(spec.intermediate_size)

        def norm(name: str, fuse: bool = fused) -> RMSNorm:
            weight = get(prefix + name) + spec.norm_weight_offset
            return RMSNorm(weight.to(device=device, dtype=dtype), spec.rms_norm_eps, fuse)

        def rows(t: torch.Tensor, part: range, unit: int = 1) -> torch.Tensor:
            return t[part.start * unit : part.stop * unit]

        attn = prefix + "self_attn."
        qkv_parts = (("q_proj", heads), ("k_proj", kv_heads), ("v_proj", kv_heads))
        qkv_bias = None
        if spec.attention_bias:
            qkv_bias = torch.cat([rows(get(attn + p + ".bias"), part, head_dim) for p, part in qkv_parts])
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
        self.qkv = load_linear(ckpt, quant, [(attn + p + ".weight", part, head_dim) for p, part in qkv_parts],
                               qkv_bias)
        self.o_proj = load_linear(ckpt, quant, [(attn + "o_proj.weight", None, 1)],
                                  inputs=_part(heads, head_dim, placement))
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
            stacked = device.type == "cuda" and quant.name == "none"
            self.moe = MoE(spec, mlp, get, lambda w, inputs: Linear(quant, w, inputs=inputs), placement, dtype,
                           device, stacked)
        else:
            self.gate_up = load_linear(ckpt, quant, [(mlp + "gate_proj.weight", columns, 1),
                                                     (mlp + "up_proj.weight", columns, 1)])
            self.down = load_linear(ckpt, quant, [(mlp + "down_proj.weight", None, 1)],
                                    inputs=_part(columns, 1, placement))
        self.intermediate_size = len(columns)
        self.fused = fused
        self._shares = (heads, kv_heads, columns, spec.hidden_size, placement)

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


class OutputHead:
    """Hidden states to this worker's share of the logits (its rows of the vocabulary)."""

    # NOTE: the AMX kernel against oneDNN for SmolLM2's head (49,152 x 576, caches flushed): 2.5 vs 2.8 ms at
    # 1 row (the one-token kernel 2.9-3.0), 2.6 vs 2.9 at 16, 4.4 vs 5.2 at 34, but 4.5-6.1 vs 4.1-4.3 at 48
    # and even at 64: the kernel takes up to 32 rows here.
    TILE_ROWS = 32

    def __init__(self, weight: torch.Tensor, tied: bool):
        """
        Args:
            weight: ``[vocab rows, hidden]`` in the model dtype.
            tied: ``weight`` is the embedding table, which stays as it is; where prepacking is faster it
                gets a prepacked copy for batches (a batch of 64 computes its logits about 1.4x faster
                against it, for the table's memory again: 56 MB for SmolLM2). An untied head keeps only
                the prepacked copy.
        """
        self.weight: torch.Tensor | None = weight
        self.packed: torch.Tensor | None = None
        # with AMX, a copy as AMX tiles for steps of up to TILE_ROWS sampled rows (56 MB more for SmolLM2)
        self.tiles = decode_copy("tiles", weight) if decode_layout(weight.device, weight.dtype) == "tiles" else None
        if prepacks(weight.device, weight.dtype):
            self.packed = prepack(weight)
            if not tied:
                self.weight = None
        # else a plain head multiplies one token in the one-token C++ kernel where it runs
        self.one_token = self.tiles is None and self.weight is not None and one_token_kernel(weight.device, weight.dtype)
        self.out_features = weight.shape[0]
        self.number = register_linear(self)
        # batch-invariant mode: rows of every matmul (0: as many as come)
        self.row_block = 0

    def apply(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.row_block:
            return in_row_blocks(self._apply, hidden, self.row_block)
        return self._apply(hidden)

    def _apply(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tiles is not None and hidden.shape[0] <= self.TILE_ROWS:
            return decode_linear(hidden, self.tiles)
        if self.one_token and hidden.shape[0] == 1:
            return one_token_linear(hidden, self.weight)
        if self.packed is not None:
            return packed_linear(hidden, self.packed)
        return F.linear(hidden, self.weight)


class LlamaModel:
    """Llama-style decoder (RMSNorm, RoPE, GQA, a gated MLP) with the quirks of the families in
    ``conveyor.model.families``.

    Under pipeline parallelism a worker holds its stage's layers only (the
    first stage the embedding, the last the final norm and the output head);
    under tensor parallelism its share of every layer and of the vocabulary.
    """

    def __init__(
        self,
        ckpt: Checkpoint,
        quant: QuantMethod,
        dtype: torch.dtype,
        device: torch.device,
        max_len: int,
        progress: Callable[[str], None] | None = None,
        fused: bool = False,
        group: ParallelGroup | None = None,
    ):
        """
        Args:
            fused: norms, rotary and SwiGLU in the C++ CPU kernels (the "cpu" attention backend's choice).
            group: this worker's place among the engine's workers (default: the only one).
        """
        spec = ckpt.spec
        self.group = group = group or ParallelGroup()
        placement = group.placement
        self.fused = fused
        self.spec = spec
        self.dtype = dtype
        self.device = device
        self.first_stage, self.last_stage = placement.first_stage, placement.last_stage
        start = time.perf_counter()
        self.vocab_rows, self.vocab_per_rank = placement.vocab(spec.vocab_size)
        self.embed: torch.Tensor | None = None
        # the table as the checkpoint stores it, where the quant method takes its format (rows dequantized
        # as they are looked up; a tied head multiplies by it through the method)
        self.packed_embed: ggml.PackedWeight | None = None
        if self.first_stage or (self.last_stage and spec.tie_word_embeddings):
            table = self._packed_vocab_shard(ckpt, quant, "model.embed_tokens.weight")
            if table is not None:
                self.packed_embed = table
            else:
                self.embed = self._vocab_shard(ckpt.get("model.embed_tokens.weight"))
        layers = placement.layers(spec.num_layers)
        self.layers: list[DecoderLayer] = []
        for local, i in enumerate(layers):
            self.layers.append(DecoderLayer(spec, i, ckpt, quant, dtype, device, fused, group, local))
            if progress and (local + 1) % max(1, len(layers) // 5) == 0:
                progress(f"loaded layer {local + 1}/{len(layers)} ({time.perf_counter() - start:.1f} s)")
        self.norm: RMSNorm | None = None
        self.head: OutputHead | Linear | None = None
        if self.last_stage:
            weight = ckpt.get("model.norm.weight") + spec.norm_weight_offset
            self.norm = RMSNorm(weight.to(device=device, dtype=dtype), spec.rms_norm_eps, fused)
            tied = spec.tie_word_embeddings
            head = self.packed_embed if tied else self._packed_vocab_shard(ckpt, quant, "lm_head.weight")
            if head is not None:
                self.head = Linear(quant, [head])
                if tied:  # (where the method repacked the head's copy, the lookups read that one: one copy)
                    self.packed_embed = quant.packed_table(self.head.params) or self.packed_embed
            else:
                self.head = OutputHead(self.embed if tied else self._vocab_shard(ckpt.get("lm_head.weight")), tied)
        self.rotary = Rotary(spec.head_dim, spec.rope_theta, spec.rope_scaling, max_len, device,
                             ckpt.rope_freq_factors())
        # Gemma 3's sliding-window layers: their own base, no scaling
        self.local_rotary = None
        if spec.local_rope_theta:
            self.local_rotary = Rotary(spec.head_dim, spec.local_rope_theta, None, max_len, device, None)

    def _vocab_shard(self, table: torch.Tensor) -> torch.Tensor:
        """This worker's rows of an embedding-shaped table, zero-padded to the same count on every worker."""
        rows = table[self.vocab_rows.start : self.vocab_rows.stop]
        if len(rows) < self.vocab_per_rank:
            rows = torch.cat([rows, rows.new_zeros(self.vocab_per_rank - len(rows), rows.shape[1])])
        return rows.to(device=self.device, dtype=self.dtype)

    def _packed_vocab_shard(self, ckpt: Checkpoint, quant: QuantMethod, name: str) -> ggml.PackedWeight | None:
        """``_vocab_shard`` of a table kept as stored (zero bytes are zeros in every block format), or None
        where it is stored as floats or in a format the quant method does not take."""
        table = ckpt.packed(name)
        if table is None or table.format not in quant.packed_formats:
            return None
        data = table.data[self.vocab_rows.start : self.vocab_rows.stop]
        if len(data) < self.vocab_per_rank:
            data = torch.cat([data, data.new_zeros(self.vocab_per_rank - len(data), data.shape[1])])
        return ggml.PackedWeight(table.format, data.to(self.device).contiguous(), table.in_features)

    def _lookup(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.packed_embed is not None:  # (a repacked table may have a zero block more per row)
            return ggml.dequantize_rows(self.packed_embed, token_ids, self.dtype)[:, : self.spec.hidden_size]
        return F.embedding(token_ids, self.embed)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` -> ``[T, hidden]``; under TP each worker looks up its rows (zeros elsewhere), then all-reduce."""
        if self.group.placement.tp_size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_rows.start
        outside = (local < 0) | (local >= len(self.vocab_rows))
        h = self._lookup(local.masked_fill(outside, 0))
        return self.group.all_reduce(h.masked_fill_(outside[:, None], 0))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionFn,
        carried: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run this worker's layers over a flat batch.

        Args:
            input_ids: ``[T]`` token ids of every scheduled token, sequences back to back.
            positions: ``[T]`` each token's position in its own sequence.
            attention: computes attention for one layer (and stores K, V).
            carried: after the first pipeline stage, ``[2, T, hidden]``: the residual stream and the
                last layer's output from the previous stage.

        Returns:
            The last stage: ``[T, hidden_size]`` final hidden states (after the last norm). Earlier
            stages: ``[2, T, hidden]`` for the next one.
        """
        if carried is None:
            h, delta = self.embed_tokens(input_ids), None
            if self.spec.embedding_multiplier != 1.0:  # (rounded to the model dtype first, as Gemma does)
                h = h * torch.tensor(self.spec.embedding_multiplier, dtype=h.dtype)
        else:
            h, delta = carried[0], carried[1]
        tables = self.rotary.tables(positions, self.dtype)
        local = self.local_rotary.tables(positions, self.dtype) if self.local_rotary is not None else tables
        for layer in self.layers:
            h, delta = layer(h, delta, *(local if layer.local_rope else tables), attention)
        if not self.last_stage:
            return torch.stack([h, delta])
        return self.norm(h, delta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``[N, hidden_size]`` -> ``[N, vocab_size]`` float32 logits (on TP rank 0 of the last stage; every
        TP worker computes its vocabulary rows, and None comes back except on rank 0)."""
        if torch.compiler.is_compiling():
            logits = linear_op(hidden, self.head.number)
        else:
            logits = self.head.apply(hidden)
        gathered = self.group.gather_vocab(logits, self.spec.vocab_size)
        if gathered is None:
            return None
        cap = self.spec.final_softcap
        return gathered.float() if not cap else torch.tanh(gathered.float() / cap) * cap

    def fix_matmul_rows(self, rows: int) -> None:
        """Batch-invariant mode: every linear layer and the head multiply blocks of exactly ``rows`` rows."""
        for layer in self.layers:
            for linear in layer.linears():
                linear.row_block = rows
        if self.head is not None:
            self.head.row_block = rows

    def attention_layers(self) -> list[LayerAttention]:
        """How each of this worker's layers attends (scale, sliding window, soft cap), by cache layer."""
        spec = self.spec
        return [LayerAttention(spec.softmax_scale, spec.window(layer.index), spec.attn_softcap)
                for layer in self.layers]

    def _head_reads_embedding(self) -> bool:
        """Whether a packed head holds the embedding table's own bytes (tied, and kept in its format; a
        method that repacks the head's copy holds the table twice)."""
        if self.packed_embed is None or not isinstance(self.head, Linear):
            return False
        pointer = self.packed_embed.data.data_ptr()
        return any(t.data_ptr() == pointer for t in self.head.params.values())

    def weight_formats(self) -> dict[str, int]:
        """Bytes of the linear layers, the embedding and the head by the format each is kept in (as their quant
        method names it: ``QuantMethod.formats``); "copies": second copies that decode steps read instead of,
        not beside, the first (``cpu_decode_copy_mb``; a tied head's prepacked and tile copies)."""
        formats: dict[str, int] = {}

        def add(key: str, n: int) -> None:
            formats[key] = formats.get(key, 0) + n

        linears = [linear for layer in self.layers for linear in layer.linears()]
        if isinstance(self.head, Linear) and not self._head_reads_embedding():
            linears.append(self.head)
        for linear in linears:
            for format, n in linear.method.formats(linear.params).items():
                add(format, n)
        if self.packed_embed is not None:
            add(self.packed_embed.format, self.packed_embed.data.numel())
        dtype = str(self.dtype).removeprefix("torch.")
        if self.embed is not None:
            add(dtype, self.embed.numel() * self.embed.element_size())
        if isinstance(self.head, OutputHead):
            head = self.head
            if head.weight is not None and head.weight is not self.embed:
                add(dtype, head.weight.numel() * head.weight.element_size())
            if head.packed is not None:  # (a tied head's prepacked copy is a second copy of the table)
                add("copies" if head.weight is not None else dtype, head.packed.numel() * head.packed.element_size())
            if head.tiles is not None:
                add("copies", head.tiles.numel() * head.tiles.element_size())
        return formats

    def num_weight_bytes(self) -> int:
        """Bytes of every weight this worker holds, as stored (quantized layers at their packed size)."""
        norms = [norm.weight for layer in self.layers for norm in layer.norms()]
        dense = [self.embed, self.norm.weight if self.norm else None, *norms]
        if self.packed_embed is not None:
            dense.append(self.packed_embed.data)
        total = 0
        if isinstance(self.head, Linear):
            if not self._head_reads_embedding():
                total += self.head.num_bytes()
        elif self.head is not None and self.head.weight is not self.embed:  # (a tied head reads one copy a step)
            dense.append(self.head.weight if self.head.packed is None else self.head.packed)
        total += sum(t.numel() * t.element_size() for t in dense if t is not None)
        moe = sum(layer.moe.dense_bytes() for layer in self.layers if layer.moe is not None)
        return total + moe + sum(linear.num_bytes() for layer in self.layers for linear in layer.linears())
