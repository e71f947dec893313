"""llama.cpp's quantized block formats (GGML types), kept as their bytes: sizes, torch dequantizers, and
slicing along whole blocks.

A quantized GGUF tensor ``[rows, columns]`` is stored row by row, each row a run of blocks of
``block_values`` columns (32, or 256 for the K-quants) in ``block_bytes`` bytes. Conveyor keeps these
bytes as a ``uint8 [rows, row_bytes]`` tensor: rows (output features) can be cut and concatenated freely,
columns only at block edges. The dequantizers here are the torch fallback of the ``gguf`` quant method (one
layer at a time into a scratch buffer) and spell out each block's layout; the C++ kernels
(``csrc/ggml_linear.cpp``) read the same bytes. The tests check both against the ``gguf`` package's own
dequantizer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

QK = 32
QK_K = 256

# type name -> (values per block, bytes per block)
BLOCKS: dict[str, tuple[int, int]] = {
    "Q4_0": (QK, 18),
    "Q4_1": (QK, 20),
    "Q5_0": (QK, 22),
    "Q5_1": (QK, 24),
    "Q8_0": (QK, 34),
    "Q4_K": (QK_K, 144),
    "Q5_K": (QK_K, 176),
    "Q6_K": (QK_K, 210),
    # Q4_0 and Q4_1 as repack() lays them out for the C++ kernels: two blocks to a unit, their 32 bytes of
    # nibbles, then their float16 scales and offsets (Q4_0's offset: -8 times its scale)
    "Q4_X2": (2 * QK, 40),
    # Q8_0 blocks whose scales are one a row (the int8 method's per-channel weights): read as Q8_0 but by the
    # AMX path, which then quantizes x per 64 values rather than 32 (csrc/ggml_gemm.cpp, run_rows_gemm)
    "Q8_0R": (QK, 34),
}
# the order the C++ kernels number the types by (csrc/ggml_blocks.h's Type)
TYPE_IDS = {name: i for i, name in enumerate(BLOCKS)}


# formats with a byte per value and one scale per output row (``PackedWeight.scale``), not GGML's: fp8 e4m3, as
# Hugging Face checkpoints store it (``conveyor.model.hf_quant``); (values, bytes) of their one-value "block"
ROW_SCALED: dict[str, tuple[int, int]] = {"F8_E4M3": (1, 1)}


class PackedWeight(NamedTuple):
    """A linear weight ``[out_features, in_features]`` as a checkpoint stores it: ``data`` holds each output
    row's blocks of ``format`` (``uint8 [out_features, row_bytes]``); ``scale``: each row's scale (float32
    ``[out_features]``) for a format in ROW_SCALED, else None."""

    format: str
    data: torch.Tensor
    in_features: int
    scale: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    def rows(self, start: int, stop: int) -> PackedWeight:
        scale = None if self.scale is None else self.scale[start:stop]
        return PackedWeight(self.format, self.data[start:stop], self.in_features, scale)

    def columns(self, columns: slice) -> PackedWeight | None:
        """The input ``columns`` alone (a row-parallel shard, each row's scale whole); None where they do not
        start and end on block edges."""
        values, size = BLOCKS[self.format] if self.format in BLOCKS else ROW_SCALED[self.format]
        start, stop = columns.start or 0, self.in_features if columns.stop is None else columns.stop
        if start % values or stop % values:
            return None
        return PackedWeight(self.format, self.data[:, start // values * size : stop // values * size],
                            stop - start, self.scale)


def row_bytes(format: str, in_features: int) -> int:
    values, size = BLOCKS[format]
    return in_features // values * size


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 at byte ``offset`` of every block, as float32 ``[..., 1]``."""
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 values: the low nibbles, then the high ones (ggml's order within a block)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()


def _high_bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """Bit j of the little-endian bytes ``qh`` for j < count, as 0/1 values ``[..., count]``."""
    bits = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return ((qh[..., :, None] >> bits) & 1).reshape(*qh.shape[:-1], -1)[..., :count].float()


def _scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 bytes of a Q4_K/Q5_K block -> its 8 six-bit sub-block scales and mins (``get_scale_min_k4``)."""
    q = scales.to(torch.int32)
    low_sc, low_m = q[..., 0:4] & 63, q[..., 4:8] & 63
    high_sc = (q[..., 8:12] & 0x0F) | ((q[..., 0:4] >> 6) << 4)
    high_m = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    return torch.cat([low_sc, high_sc], -1).float(), torch.cat([low_m, high_m], -1).float()


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * (_nibbles(b[..., 2:18]) - 8)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _nibbles(b[..., 4:20]) + _f16(b, 2)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * (_nibbles(b[..., 6:22]) + 16 * _high_bits(b[..., 2:6], QK) - 16)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * (_nibbles(b[..., 8:24]) + 16 * _high_bits(b[..., 4:8], QK)) + _f16(b, 2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * b[..., 2:34].contiguous().view(torch.int8).float()


def _k_sub_blocks(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes of a Q4_K/Q5_K block -> ``[..., 8, 32]`` low 4-bit values: each 32 bytes hold two
    sub-blocks, the low nibbles then the high ones."""
    q = qs.reshape(*qs.shape[:-1], 4, 32)
    return torch.stack([q & 0x0F, q >> 4], dim=-2).reshape(*qs.shape[:-1], 8, 32).float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    sc, m = _scales_mins(b[..., 4:16])
    q = _k_sub_blocks(b[..., 16:144])
    return ((_f16(b, 0) * sc)[..., None] * q - (_f16(b, 2) * m)[..., None]).flatten(-2)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    sc, m = _scales_mins(b[..., 4:16])
    q = _k_sub_blocks(b[..., 48:176])
    # bit i of qh byte l is the fifth bit of value l of sub-block i
    bits = torch.arange(8, dtype=torch.uint8, device=b.device)
    high = ((b[..., 16:48, None] >> bits) & 1).transpose(-1, -2).float()
    return ((_f16(b, 0) * sc)[..., None] * (q + 16 * high) - (_f16(b, 2) * m)[..., None]).flatten(-2)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    ql = b[..., 0:128].reshape(*b.shape[:-1], 2, 2, 32)  # [half, first or second 32 bytes, l]
    qh = b[..., 128:192].reshape(*b.shape[:-1], 2, 32)  # [half, l]
    scales = b[..., 192:208].contiguous().view(torch.int8).float().reshape(*b.shape[:-1], 2, 4, 2)
    # within a half, value l + 32 * j (j = 0..3) takes ql's nibble (j // 2: high) of byte l + 32 * (j % 2)
    # and bits 2j, 2j + 1 of qh[l]; its scale is scales[j * 2 + l // 16]
    low = torch.stack([ql[..., 0, :] & 0x0F, ql[..., 1, :] & 0x0F, ql[..., 0, :] >> 4, ql[..., 1, :] >> 4], -2)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device)[:, None]
    high = (qh[..., None, :] >> shifts) & 3
    q = (low.to(torch.int32) | (high.to(torch.int32) << 4)).float() - 32  # [..., half, j, l]
    q = q.reshape(*q.shape[:-1], 2, 16) * scales[..., None]
    return (_f16(b, 208)[..., None, None, None] * q).flatten(-4)


def _q4_x2(b: torch.Tensor) -> torch.Tensor:
    values = torch.stack([_nibbles(b[..., 0:16]), _nibbles(b[..., 16:32])], dim=-2)  # [..., 2, 32]
    scales = b[..., 32:40].contiguous().view(torch.float16).float()  # [..., d0, d1, m0, m1]
    return (values * scales[..., 0:2, None] + scales[..., 2:4, None]).flatten(-2)


def repack(weight: PackedWeight) -> PackedWeight:
    """Q4_0 and Q4_1 as Q4_X2 (the same numbers: every scale and offset is exact in float16), a zero block
    added to rows of an odd number of blocks (``in_features`` then grows by 32: pad x with zeros); other
    formats as they are."""
    if weight.format not in ("Q4_0", "Q4_1"):
        return weight
    values, size = BLOCKS[weight.format]
    blocks = weight.data.reshape(weight.out_features, -1, size)
    if blocks.shape[1] % 2:
        blocks = torch.cat([blocks, blocks.new_zeros(blocks.shape[0], 1, size)], dim=1)
    d = blocks[..., 0:2]
    if weight.format == "Q4_0":
        qs = blocks[..., 2:18]
        m = (d.contiguous().view(torch.float16) * -8).view(torch.uint8)
    else:
        qs, m = blocks[..., 4:20], blocks[..., 2:4]
    units = blocks.shape[1] // 2
    pair = lambda t: t.reshape(weight.out_features, units, -1)  # noqa: E731 -- (the unit's two blocks side by side)
    data = torch.cat([pair(qs), pair(d), pair(m)], dim=-1).reshape(weight.out_features, -1)
    return PackedWeight("Q4_X2", data.contiguous(), units * 2 * QK)


_DEQUANTIZE = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
               "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "Q4_X2": _q4_x2,
               "Q8_0R": _q8_0}


def encode(format: str, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None) -> PackedWeight:
    """Integers and their blocks' scales as ``format``'s blocks: Q4_0 (``q`` in 0..15 stands for
    ``d * (q - 8)``), Q4_1 (``d * q + m``) or Q8_0 (``q`` in -128..127: ``d * q``); ``q [out, in]``, ``d``
    and ``m`` one per block of 32 values ``[out, in / 32]``, rounded to float16 here."""
    out, columns = q.shape
    q = q.reshape(out, columns // QK, QK)
    half = lambda t: t.to(torch.float16).reshape(out, -1, 1).view(torch.uint8)  # noqa: E731 -- [out, blocks, 2]
    if format == "Q8_0":
        fields = [half(d), q.to(torch.int8).view(torch.uint8)]
    else:
        q = q.to(torch.uint8)
        nibbles = q[..., : QK // 2] | (q[..., QK // 2 :] << 4)  # (value j and value j + 16 share byte j)
        fields = [half(d), nibbles] if format == "Q4_0" else [half(d), half(m), nibbles]
    return PackedWeight(format, torch.cat(fields, dim=-1).reshape(out, -1).contiguous(), columns)


def dequantize(weight: PackedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[out_features, in_features]`` in ``dtype``."""
    if weight.format == "F8_E4M3":
        return (weight.data.view(torch.float8_e4m3fn).float() * weight.scale[:, None]).to(dtype)
    values, size = BLOCKS[weight.format]
    blocks = weight.data.reshape(weight.out_features, -1, size)
    return _DEQUANTIZE[weight.format](blocks).reshape(weight.out_features, weight.in_features).to(dtype)


def dequantize_rows(weight: PackedWeight, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``rows`` (int64 ``[T]``) of the weight: an embedding lookup in a packed table."""
    scale = None if weight.scale is None else weight.scale[rows]
    return dequantize(PackedWeight(weight.format, weight.data[rows], weight.in_features, scale), dtype)
