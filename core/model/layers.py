"""The decoder's building blocks: RMSNorm, the linear layers (float, quantized, GGUF blocks kept packed,
split for tensor parallelism), the rotary embedding, and the output head over the vocabulary."""

from __future__ import annotations

import logging
import math

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
from conveyor.quant import Params, QuantMethod

logger = logging.getLogger(__name__)


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
