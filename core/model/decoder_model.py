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

import torch
import torch.nn.functional as F

from conveyor.model import ggml
from conveyor.model.checkpoint import Checkpoint
from conveyor.model.decoder import AttentionFn, DecoderLayer
from conveyor.model.graph_ops import linear_op
from conveyor.model.layers import LayerOptions, Linear, OutputHead, RMSNorm, Rotary
from conveyor.model.spec import LayerAttention, ModelSpec
from conveyor.quant import QuantMethod


class DecoderModel:
    """Llama-style decoder (RMSNorm, RoPE, GQA, a gated MLP) with the quirks of the families in
    ``conveyor.model.families``.

    Under pipeline parallelism a worker holds its stage's layers only (the
    first stage the embedding, the last the final norm and the output head);
    under tensor parallelism its share of every layer and of the vocabulary.
    """

    def __init__(self, spec: ModelSpec, options: LayerOptions, max_len: int):
        """The model's blocks, declared from its shape: ``conveyor.model.loader.load_weights`` fills them.

        Args:
            options: how every block is built (``options.group``: this worker's place among the engine's workers).
        """
        self.options = options
        self.group = group = options.group
        placement = group.placement
        self.spec = spec
        self.dtype = options.dtype
        self.device = options.device
        self.first_stage, self.last_stage = placement.first_stage, placement.last_stage
        self.vocab_rows, self.vocab_per_rank = placement.vocab(spec.vocab_size)
        self.embed: torch.Tensor | None = None
        # the table as the checkpoint stores it, where the quant method takes its format (rows dequantized
        # as they are looked up; a tied head multiplies by it through the method)
        self.packed_embed: ggml.PackedWeight | None = None
        self.head: OutputHead | Linear | None = None
        self.layers = [DecoderLayer(spec, i, options, local)
                       for local, i in enumerate(placement.layers(spec.num_layers))]
        self.norm: RMSNorm | None = None
        if self.last_stage:
            self.norm = RMSNorm(spec.rms_norm_eps, options.fused, "model.norm.weight", spec.norm_weight_offset)
        self.rotary = Rotary(spec.head_dim, spec.rope_theta, spec.rope_scaling, max_len)
        # Gemma 3's sliding-window layers: their own base, no scaling
        self.local_rotary = None
        if spec.local_rope_theta:
            self.local_rotary = Rotary(spec.head_dim, spec.local_rope_theta, None, max_len, stored_factors=False)

    def loaders(self) -> list:
        """The blocks outside the layers that read the checkpoint: the vocabulary's tables (this model's own
        ``load``), the final norm, the rotary tables (a checkpoint may store frequency factors)."""
        return [b for b in (self, self.norm, self.rotary, self.local_rotary) if b is not None]

    def load(self, ckpt: Checkpoint, options: LayerOptions) -> None:
        """The embedding table and the output head (which a tied model reads from the same table)."""
        spec, quant = self.spec, options.quant
        if self.first_stage or (self.last_stage and spec.tie_word_embeddings):
            table = self._packed_vocab_shard(ckpt, quant, "model.embed_tokens.weight")
            if table is not None:
                self.packed_embed = table
            else:
                self.embed = self._vocab_shard(ckpt.get("model.embed_tokens.weight"))
        if not self.last_stage:
            return
        tied = spec.tie_word_embeddings
        head = self.packed_embed if tied else self._packed_vocab_shard(ckpt, quant, "lm_head.weight")
        if head is not None:
            self.head = Linear.of(quant, [head])
            if tied:  # (where the method repacked the head's copy, the lookups read that one: one copy)
                self.packed_embed = quant.packed_table(self.head.params) or self.packed_embed
        else:
            self.head = OutputHead(self.embed if tied else self._vocab_shard(ckpt.get("lm_head.weight")), tied)

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
