"""The decoder's building blocks: RMSNorm, the linear layers (float, quantized, GGUF blocks kept packed,
split for tensor parallelism), the rotary embedding, and the output head over the vocabulary.

A block is declared from the model's shape and the ``LayerOptions`` alone: it names the checkpoint tensors it
reads and the share of them this worker keeps, and its ``load(ckpt, options)`` (the weight loader that
``conveyor.model.loader.load_weights`` calls) reads them. No constructor reads a checkpoint.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

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
from conveyor.model.lora import LoraLinear
from conveyor.model.parallel import ParallelGroup
from conveyor.quant import Params, QuantMethod

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerOptions:
    """How this worker builds every block of a model, passed whole where flags were threaded one by one."""

    quant: QuantMethod
    dtype: torch.dtype
    device: torch.device
    # norms, rotary and SwiGLU in the C++ CPU kernels (the "cpu" attention backend's choice) instead of torch ops
    fused: bool = False
    # this worker's place among the engine's workers (its share of every layer); default: the only one
    group: ParallelGroup = field(default_factory=ParallelGroup)


class RMSNorm:
    def __init__(self, eps: float, fused: bool = False, name: str = "", offset: float = 0.0):
        """
        Args:
            fused: use the C++ CPU kernel (one pass, the residual add folded in).
            name: the checkpoint's tensor of the weight; ``offset`` is added to it as it loads (Gemma's
                ``1 + weight``).
        """
        self.weight: torch.Tensor | None = None
        self.eps = eps
        self.fused = fused
        self.name = name
        self.offset = offset

    def load(self, ckpt: Checkpoint, options: LayerOptions) -> None:
        self.weight = (ckpt.get(self.name) + self.offset).to(device=options.device, dtype=options.dtype)

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


# a part of a fused linear layer: (the checkpoint's name, the rows kept (None: all), rows per unit of the range)
WeightPart = tuple[str, "range | None", int]


class Linear:
    """A linear layer stored and applied by the selected quant method: the rows of the named checkpoint weights
    stacked (Q, K, V; gate, up), each kept as the checkpoint stores it where the method takes its format and the
    shard falls on whole blocks, else read as float32."""

    def __init__(self, method: QuantMethod, parts: list[WeightPart], bias: bool = False,
                 inputs: slice | None = None):
        """
        Args:
            parts: the weights whose rows it stacks, with this worker's share of each.
            bias: read each part's ``.bias`` beside its ``.weight`` (the same rows).
            inputs: a row-parallel layer's share of the input columns (then ``parts`` holds one whole weight,
                and its sum is all-reduced after).
        """
        self.method = method
        self.parts = parts
        self.bias = bias
        self.inputs = inputs
        self.out_features = 0
        self.params: Params = {}
        self.number = register_linear(self)
        # LoRA adapters' slots for this projection ([lora] max_loras > 0)
        self.lora: LoraLinear | None = None
        # batch-invariant mode: rows of every matmul (0: as many as come)
        self.row_block = 0

    @classmethod
    def of(cls, method: QuantMethod, weight: torch.Tensor | list[ggml.PackedWeight]) -> Linear:
        """A layer of a weight already read: float32 ``[out, in]``, or stored blocks (a packed output head)."""
        linear = cls(method, [])
        linear.fill(weight)
        return linear

    def load(self, ckpt: Checkpoint, options: LayerOptions | None = None) -> None:
        bias = None
        if self.bias:
            bias = torch.cat([_rows(ckpt.get(name.removesuffix(".weight") + ".bias"), part, unit)
                              for name, part, unit in self.parts])
        packed = self._stored(ckpt)
        if packed is not None:
            self.fill(packed, bias)
        else:
            self.fill(torch.cat([_rows(ckpt.get(name), part, unit) for name, part, unit in self.parts]), bias)

    def _stored(self, ckpt: Checkpoint) -> list[ggml.PackedWeight] | None:
        """The parts' blocks as stored, or None where one of them must be read as floats."""
        packed = []
        for name, part, unit in self.parts:
            stored = ckpt.packed(name)
            if stored is None or stored.format not in self.method.packed_formats:
                return None
            if part is not None:
                stored = stored.rows(part.start * unit, part.stop * unit)
            if self.inputs is not None and (stored := stored.columns(self.inputs)) is None:
                logger.warning("%s: its columns %d-%d do not fall on whole blocks; it is expanded to %s",
                               name, self.inputs.start, self.inputs.stop, self.method.dtype)
                return None
            packed.append(stored)
        return packed

    def fill(self, weight: torch.Tensor | list[ggml.PackedWeight], bias: torch.Tensor | None = None) -> None:
        """Prepare ``weight`` (float32 ``[out, in]``, or the parts' stored blocks stacked along the outputs,
        already this worker's share) for the method."""
        if isinstance(weight, list):
            self.out_features = sum(part.out_features for part in weight)
            self.params = self.method.prepare_packed(weight, bias)
        elif self.inputs is None:
            self.out_features = weight.shape[0]
            self.params = self.method.prepare(weight, bias)
        else:
            self.out_features = weight.shape[0]
            self.params = self.method.prepare_input_shard(weight, self.inputs)

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


def _rows(t: torch.Tensor, part: range | None, unit: int) -> torch.Tensor:
    return t if part is None else t[part.start * unit : part.stop * unit]


class Rotary:
    """Rotary position embedding (the half-split layout of Hugging Face Llama)."""

    def __init__(self, dim: int, theta: float, scaling: dict | None, max_len: int, stored_factors: bool = True):
        """
        Args:
            stored_factors: divide by the per-frequency factors the checkpoint may store beside its weights.
        """
        self.dim, self.theta, self.scaling, self.max_len = dim, theta, scaling, max_len
        self.stored_factors = stored_factors
        self.cos = self.sin = torch.empty(0)

    def load(self, ckpt: Checkpoint, options: LayerOptions) -> None:
        dim = self.dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        inv_freq = _scale_inv_freq(inv_freq, self.scaling)
        freq_factors = ckpt.rope_freq_factors() if self.stored_factors else None
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.to(torch.float64)
        angles = torch.outer(torch.arange(self.max_len, dtype=torch.float64), inv_freq)
        self.cos = angles.cos().float().to(options.device)
        self.sin = angles.sin().float().to(options.device)

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
