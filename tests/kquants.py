"""Quantizers for llama.cpp's K-quant formats (Q4_K, Q5_K, Q6_K), which the gguf package reads but cannot
write: round to nearest with one scale per sub-block, packed as ggml's block structs lay them out. Plain,
not llama.cpp's search for the best scales: enough to write test checkpoints whose bytes any GGUF reader
decodes, within each format's rounding error."""

from __future__ import annotations

import gguf
import numpy as np

QK_K = 256


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _pack_scales_mins(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per block -> ggml's 12 bytes (get_scale_min_k4's layout)."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return out


def _scales_and_mins(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Per 32-value sub-block: x ~= d * sc * q - dmin * m with q in [0, levels]; sc, m six-bit."""
    sub = x.reshape(-1, 8, 32)
    low = np.minimum(sub.min(axis=-1), 0.0)
    scale = (sub.max(axis=-1) - low) / levels
    d = scale.max(axis=-1) / 63
    dmin = (-low).max(axis=-1) / 63
    d, dmin = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.where(d[:, None] > 0, np.round(scale / np.where(d > 0, d, 1)[:, None]), 0).clip(0, 63).astype(np.uint8)
    m = np.where(dmin[:, None] > 0, np.round(-low / np.where(dmin > 0, dmin, 1)[:, None]), 0).clip(0, 63)
    m = m.astype(np.uint8)
    step = d[:, None] * sc
    offset = dmin[:, None] * m
    q = np.where(step[..., None] > 0, np.round((sub + offset[..., None]) / np.where(step > 0, step, 1)[..., None]), 0)
    return d, dmin, sc, m, q.clip(0, levels).astype(np.uint8).reshape(-1, QK_K)


def _low_nibbles(q: np.ndarray) -> np.ndarray:
    """256 values -> 128 bytes: in each 64-value chunk, byte i holds value i (low) and value 32 + i (high)."""
    chunks = (q & 0x0F).reshape(-1, 4, 2, 32)
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(-1, 128)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _scales_and_mins(x, 15)
    return np.concatenate([_f16(d), _f16(dmin), _pack_scales_mins(sc, m), _low_nibbles(q)], axis=1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _scales_and_mins(x, 31)
    # qh byte i: bit b is the fifth bit of value 32 * b + i
    high = (q >> 4).reshape(-1, 8, 32)
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for bit in range(8):
        qh |= high[:, bit] << bit
    return np.concatenate([_f16(d), _f16(dmin), _pack_scales_mins(sc, m), qh, _low_nibbles(q)], axis=1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """x ~= d * scale * (q - 32): 16 sub-blocks of 16, int8 scales, six-bit q."""
    sub = x.reshape(-1, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31
    d = (np.abs(scale).max(axis=-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.where(d[:, None] > 0, np.round(scale / np.where(d > 0, d, 1)[:, None]), 0).clip(-128, 127)
    step = d[:, None] * sc
    q = np.where(step[..., None] > 0, np.round(sub / np.where(step > 0, step, 1)[..., None]), 0) + 32
    q = q.clip(0, 63).astype(np.uint8).reshape(-1, 2, 128)  # two halves of 128 values
    low = q & 0x0F
    ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(-1, 128)
    high = (q >> 4).reshape(-1, 2, 4, 32)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _f16(d)], axis=1)


K_QUANTIZERS = {
    gguf.GGMLQuantizationType.Q4_K: quantize_q4_k,
    gguf.GGMLQuantizationType.Q5_K: quantize_q5_k,
    gguf.GGMLQuantizationType.Q6_K: quantize_q6_k,
}


def quantize(array: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """``array [..., n]`` (n a multiple of 256) -> the bytes GGUF stores, ``[..., n / 256 * block bytes]``;
    the other formats through the gguf package."""
    if qtype not in K_QUANTIZERS:
        return gguf.quants.quantize(array, qtype)
    rows = array.reshape(-1, QK_K).astype(np.float32)
    blocks = K_QUANTIZERS[qtype](rows)
    return blocks.reshape(*array.shape[:-1], -1)
