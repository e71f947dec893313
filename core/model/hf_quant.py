"""Hugging Face checkpoints stored quantized, kept at their size: compressed-tensors (the format of vLLM's
llm-compressor), GPTQ and AWQ.

Each quantized linear weight becomes, at load and without a float copy, a ``PackedWeight`` in a format the
kernels already serve:

- int4, symmetric (compressed-tensors' W4A16, GPTQ with ``sym``): GGUF's Q4_0 blocks, ``d`` = the group's
  scale, each 4-bit value as stored (``q + 8``): exact;
- int4 with zero points (W4A16_ASYM, GPTQ without ``sym``, AWQ): Q4_1 blocks, ``d`` = scale,
  ``m = -scale * zero`` (``m`` rounded to float16: within 2^-11 of it, a few thousandths of a step);
- int8, symmetric (W8A16, GPTQ 8-bit): Q8_0 blocks, exact;
- fp8 e4m3 with a scale per output channel or per tensor (compressed-tensors' FP8, FP8_DYNAMIC): the bytes as
  they are with a scale per row, for the ``fp8`` method's kernels.

A group covers a multiple of 32 input features (or a whole row: per channel), so it is a run of whole
blocks, each carrying the group's scale. Scales become float16, as a GGUF block holds them: exact from
bfloat16 and float16 scales inside float16's range. Anything else (other bit widths, smaller groups, act-order
groups, fp8 in blocks, AWQ's GEMV layout) is refused when the checkpoint is opened, in one line naming what is
supported. A method that takes none of these formats (``none``, ``int8``) reads the weight dequantized to
float32 from the same blocks (``dense``).

Formats, as their authors describe them: compressed-tensors packs eight 4-bit values (stored ``q + 8``) or
four 8-bit ones (``q + 128``) into each int32 along the input features, lowest bits first (``weight_packed``
``[out, in / 8]``, ``weight_scale`` ``[out, groups]``, zero points packed the same way along the outputs);
GPTQ packs along the input features across rows (``qweight`` ``[in / 8, out]``, ``qzeros`` ``[groups, out /
8]`` holding ``zero - 1`` in its original format, ``scales`` ``[groups, out]``, ``g_idx`` each input feature's
group); AWQ packs along the outputs (``qweight`` ``[in, out / 8]``) in the order 0, 2, 4, 6, 1, 3, 5, 7.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

from conveyor.model.ggml import QK, PackedWeight, dequantize, encode

if TYPE_CHECKING:
    from safetensors import safe_open

SUPPORTED = ("compressed-tensors 'pack-quantized' int4 (symmetric or with zero points) and symmetric int8, per "
             "channel or in groups of a multiple of 32; compressed-tensors 'float-quantized' fp8 e4m3 per channel "
             "or per tensor; GPTQ int4 and symmetric int8 and AWQ (GEMM) int4 in groups of a multiple of 32, "
             "without act-order")


class UnsupportedQuantization(ValueError):
    """A checkpoint quantized in a way Conveyor does not serve; the message names what it does serve."""


def quantized_weights(config: dict[str, Any], where: dict[str, safe_open]) -> QuantizedWeights | None:
    """The reader of a checkpoint's quantized linear weights, from its config.json; None: stored as floats.

    Args:
        config: config.json's contents.
        where: each tensor's name -> the safetensors file holding it.

    Raises:
        UnsupportedQuantization: the quantization config names something not in SUPPORTED.
    """
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    readers = {"compressed-tensors": CompressedTensors, "gptq": GPTQ, "awq": AWQ}
    if method not in readers:
        raise UnsupportedQuantization(f"quantization_config.quant_method = {method!r} is not supported; "
                                      f"supported: {SUPPORTED}")
    return readers[method](qc, where)


class QuantizedWeights(ABC):
    """A checkpoint's quantized linear weights, by the Hugging Face name of the layer (``...q_proj``)."""

    def __init__(self, config: dict[str, Any], where: dict[str, safe_open]):
        self.config = config
        self._where = where

    def _get(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def _refuse(self, what: str) -> UnsupportedQuantization:
        return UnsupportedQuantization(f"{what} is not supported; supported: {SUPPORTED}")

    @abstractmethod
    def holds(self, layer: str) -> bool:
        """Whether the layer's weight is stored quantized."""

    @abstractmethod
    def packed(self, layer: str) -> PackedWeight:
        """The layer's weight in a kernel format (of a layer ``holds``)."""

    def dense(self, layer: str) -> torch.Tensor:
        """The layer's weight dequantized to float32 ``[out, in]``, from the same blocks."""
        return dequantize(self.packed(layer))


def _unpack(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``[rows, words]`` -> uint8 ``[rows, words * 32 / bits]``: each word's values, lowest bits first."""
    data = words.contiguous().view(torch.uint8)  # (little-endian: a word's bytes lowest first)
    if bits == 8:
        return data
    return torch.stack([data & 0x0F, data >> 4], dim=-1).reshape(data.shape[0], -1)


def _blocks(q: torch.Tensor, bits: int, scale: torch.Tensor, zero: torch.Tensor | None, what: str) -> PackedWeight:
    """Unsigned values ``q`` (uint8 ``[out, in]``) that stand for ``scale * (q - zero)``, per group of input
    features (``scale`` and ``zero`` ``[out, groups]``; ``zero`` None: the midpoint, 2^(bits - 1)), as GGUF
    blocks."""
    out, columns = q.shape
    group = columns // scale.shape[1]
    if group * scale.shape[1] != columns or group % QK:
        raise UnsupportedQuantization(f"{what}: groups of {columns / scale.shape[1]:g} input features are not "
                                      f"supported; supported: {SUPPORTED}")
    per_block = lambda t: t.float().repeat_interleave(group // QK, dim=1)  # noqa: E731 -- one per 32 values
    mid = 1 << (bits - 1)
    if zero is not None and bool((zero == mid).all()):
        zero = None
    if bits == 8:
        if zero is not None:
            raise UnsupportedQuantization(f"{what}: int8 with zero points is not supported; supported: {SUPPORTED}")
        return encode("Q8_0", q.to(torch.int16) - mid, per_block(scale))
    if zero is None:
        return encode("Q4_0", q, per_block(scale))
    return encode("Q4_1", q, per_block(scale), -per_block(scale) * per_block(zero))


class CompressedTensors(QuantizedWeights):
    """compressed-tensors' ``pack-quantized`` int weights and ``float-quantized`` fp8 weights."""

    def __init__(self, config: dict[str, Any], where: dict[str, safe_open]):
        super().__init__(config, where)
        for name, group in (config.get("config_groups") or {}).items():
            args = group.get("weights") or {}
            fmt = group.get("format") or config.get("format")
            what = f"quantization_config.config_groups.{name}"
            kind, bits, strategy = args.get("type"), args.get("num_bits"), args.get("strategy")
            if fmt not in ("pack-quantized", "float-quantized"):
                raise self._refuse(f"{what}: format {fmt!r}")
            if kind not in ("int", "float"):
                raise self._refuse(f"{what}: weights of type {kind!r}")
            if kind == "int" and (bits not in (4, 8) or strategy not in ("channel", "group")):
                raise self._refuse(f"{what}: int{bits} weights with strategy {strategy!r}")
            if kind == "int" and bits == 8 and not args.get("symmetric", True):
                raise self._refuse(f"{what}: int8 weights with zero points")
            if kind == "float" and (bits != 8 or strategy not in ("channel", "tensor")):
                raise self._refuse(f"{what}: {bits}-bit float weights with strategy {strategy!r}")
            if strategy == "group" and (args.get("group_size") or 0) % QK:
                raise self._refuse(f"{what}: groups of {args.get('group_size')} input features")
            if args.get("actorder") == "group":
                raise self._refuse(f"{what}: actorder = 'group'")

    def holds(self, layer: str) -> bool:
        if f"{layer}.weight_packed" in self._where:
            return True
        weight = self._where.get(f"{layer}.weight")
        return weight is not None and f"{layer}.weight_scale" in self._where

    def packed(self, layer: str) -> PackedWeight:
        scale = self._get(f"{layer}.weight_scale")
        if f"{layer}.weight_packed" not in self._where:  # fp8 e4m3, a scale per row or one for the tensor
            weight = self._get(f"{layer}.weight")
            if weight.dtype != torch.float8_e4m3fn or scale.numel() not in (1, weight.shape[0]):
                raise self._refuse(f"{layer}: a {weight.dtype} weight with {scale.numel()} scales")
            rows = scale.float().reshape(-1).expand(weight.shape[0]).contiguous()
            return PackedWeight("F8_E4M3", weight.view(torch.uint8), weight.shape[1], rows)
        out, columns = self._get(f"{layer}.weight_shape").tolist()
        words = self._get(f"{layer}.weight_packed")
        bits = words.shape[1] * 32 // columns
        q = _unpack(words, bits)[:, :columns]
        zero = None
        if f"{layer}.weight_zero_point" in self._where:  # (packed along the outputs, stored ``z + 2^(bits - 1)``)
            zero = _unpack(self._get(f"{layer}.weight_zero_point").t(), bits).t()[:out]
        return _blocks(q, bits, scale.reshape(out, -1), zero, layer)


class GPTQ(QuantizedWeights):
    """GPTQ's int4 and int8 layout (AutoGPTQ, GPTQModel, optimum)."""

    def __init__(self, config: dict[str, Any], where: dict[str, safe_open]):
        super().__init__(config, where)
        self.bits = config.get("bits")
        self.group = config.get("group_size", -1)
        if self.bits not in (4, 8):
            raise self._refuse(f"GPTQ with bits = {self.bits}")
        if self.group != -1 and self.group % QK:
            raise self._refuse(f"GPTQ with group_size = {self.group}")
        if self.bits == 8 and not config.get("sym", True):
            raise self._refuse("GPTQ int8 without sym")
        if config.get("desc_act"):
            raise self._refuse("GPTQ with desc_act (act-order)")
        # the original format stores zero - 1 (the "v1" checkpoints); "gptq_v2" stores the zero itself
        self.zero_offset = 0 if config.get("checkpoint_format") == "gptq_v2" else 1

    def holds(self, layer: str) -> bool:
        return f"{layer}.qweight" in self._where

    def packed(self, layer: str) -> PackedWeight:
        q = _unpack(self._get(f"{layer}.qweight").t(), self.bits)  # [out, in]
        scale = self._get(f"{layer}.scales").t()  # [out, groups]
        zero = _unpack(self._get(f"{layer}.qzeros"), self.bits).t()[: q.shape[0]].to(torch.int16) + self.zero_offset
        if f"{layer}.g_idx" in self._where:
            g_idx = self._get(f"{layer}.g_idx")
            group = q.shape[1] // scale.shape[1]
            if not torch.equal(g_idx.long(), torch.arange(q.shape[1]) // group):
                raise self._refuse(f"{layer}: act-order (desc_act: a g_idx that is not input feature // group_size)")
        return _blocks(q, self.bits, scale, zero, layer)


# AWQ's order of the eight 4-bit values in a word: value i holds output column AWQ_ORDER[i] of its eight
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


class AWQ(QuantizedWeights):
    """AWQ's int4 GEMM layout (AutoAWQ, llm-awq)."""

    def __init__(self, config: dict[str, Any], where: dict[str, safe_open]):
        super().__init__(config, where)
        bits = config.get("bits", config.get("w_bit"))
        group = config.get("group_size", config.get("q_group_size"))
        version = str(config.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm" or not isinstance(group, int) or group % QK:
            raise self._refuse(f"AWQ with bits = {bits}, group_size = {group}, version = {version!r}")

    def holds(self, layer: str) -> bool:
        return f"{layer}.qweight" in self._where

    def packed(self, layer: str) -> PackedWeight:
        columns = torch.tensor(AWQ_ORDER).argsort()  # (the value that holds column c of its word's eight)

        def outputs(words: torch.Tensor) -> torch.Tensor:  # [rows, out / 8] -> [rows, out] in column order
            q = _unpack(words, 4)
            return q.reshape(q.shape[0], -1, 8)[..., columns].reshape(q.shape[0], -1)

        q = outputs(self._get(f"{layer}.qweight")).t()  # [out, in]
        zero = outputs(self._get(f"{layer}.qzeros")).t()
        return _blocks(q, 4, self._get(f"{layer}.scales").t(), zero, layer)
