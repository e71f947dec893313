"""A Triton GEMM over GGUF's quantized blocks (the CUDA path of the ``gguf`` and ``auto`` methods, and of ``int4``
and the Hugging Face int4/int8 checkpoints kept as those blocks).

``ggml_matmul(x, data, format)`` computes ``x @ w.T`` where ``w [N, K]`` is stored as
``conveyor.model.ggml`` keeps it (``uint8 [N, row bytes]``: each row a run of the format's blocks). Each
program reads its ``[BLOCK_N, BLOCK_K]`` tile's bytes and unpacks them into float32 in registers: the
values, the blocks' float16 scales and offsets, the K-quants' 6-bit sub-block scales (the same arithmetic
as the torch dequantizers in ``conveyor.model.ggml``, value by value). Activations stay in the model dtype
(W4A16, W8A16): no activation is rounded. The bytes read from memory are the packed weight's; every gather
of a tile's scales and bits beyond the first hits the cache.

Block sizes follow the shape: decode (up to 16 rows) a 16-row tile and long K steps, prefill 64 x 64.
``TRITON_INTERPRET=1`` runs it on CPU tensors (the tests do, at small shapes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.model.ggml import BLOCKS

# format ids in the kernel (a constexpr: one compiled branch per format)
FORMATS = {"Q4_0": 0, "Q4_1": 1, "Q5_0": 2, "Q5_1": 3, "Q8_0": 4, "Q4_K": 5, "Q5_K": 6, "Q6_K": 7}


@triton.jit
def _u8(ptr, offsets, mask):
    return tl.load(ptr + offsets, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(ptr, offsets, mask):
    """The little-endian float16 at byte ``offsets``, as float32."""
    bits = _u8(ptr, offsets, mask) | (_u8(ptr, offsets + 1, mask) << 8)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _k_scale_min(ptr, base, sub, mask):
    """A Q4_K / Q5_K block's 6-bit scale and min of sub-block ``sub`` (0..7), as float32 (ggml's
    get_scale_min_k4 over the 12 bytes q after d and dmin: sub < 4 takes the low 6 bits of q[sub] and
    q[sub + 4]; sub >= 4 the nibbles of q[sub + 4] and, as high bits, the top two of q[sub - 4] and q[sub])."""
    low = sub < 4
    a = _u8(ptr, base + 4 + sub, mask)
    b = _u8(ptr, base + 8 + sub, mask)
    c = _u8(ptr, base + 4 + tl.where(low, 0, sub - 4), mask)
    scale = tl.where(low, a & 63, (b & 0x0F) | ((c >> 6) << 4))
    minimum = tl.where(low, b & 63, (b >> 4) | ((a >> 6) << 4))
    return scale.to(tl.float32), minimum.to(tl.float32)


@triton.jit
def _weights(w_ptr, n, k, mask, row_bytes, FORMAT: tl.constexpr):
    """float32 weights ``w[n, k]`` of a tile (``n [1, BLOCK_N]``, ``k [BLOCK_K, 1]``)."""
    if FORMAT <= 4:  # blocks of 32 values
        # bytes per block (Q4_0 18, Q4_1 20, Q5_0 22, Q5_1 24, Q8_0 34), and where its 4-bit values start: after
        # d, m where the format has one, and four bytes of fifth bits where it has them
        size = 18 + 2 * FORMAT
        qs = 2 + 2 * FORMAT
        if FORMAT == 4:
            size = 34
        base = n.to(tl.int64) * row_bytes + (k // 32) * size
        j = k % 32
        d = _f16(w_ptr, base, mask)
        if FORMAT == 4:  # Q8_0: int8 values
            w = d * _u8(w_ptr, base + 2 + j, mask).to(tl.int8).to(tl.float32)
        else:
            q = (_u8(w_ptr, base + qs + j % 16, mask) >> (4 * (j // 16))) & 0x0F
            if FORMAT == 2 or FORMAT == 3:  # the fifth bit: bit j of the four bytes before the values
                q |= ((_u8(w_ptr, base + qs - 4 + j // 8, mask) >> (j % 8)) & 1) << 4
            if FORMAT == 0:
                w = d * (q - 8).to(tl.float32)
            elif FORMAT == 2:
                w = d * (q - 16).to(tl.float32)
            else:
                w = d * q.to(tl.float32) + _f16(w_ptr, base + 2, mask)
    else:  # K-quants: blocks of 256 values
        size = 144 + 32 * (FORMAT - 5)  # (Q4_K 144, Q5_K 176)
        if FORMAT == 7:
            size = 210
        base = n.to(tl.int64) * row_bytes + (k // 256) * size
        j = k % 256
        if FORMAT == 7:  # Q6_K: two halves of 128 values, each four runs (r) of 32 values (l)
            half = j // 128
            r = (j % 128) // 32
            l = j % 32
            low = (_u8(w_ptr, base + half * 64 + (r % 2) * 32 + l, mask) >> (4 * (r // 2))) & 0x0F
            high = (_u8(w_ptr, base + 128 + half * 32 + l, mask) >> (2 * r)) & 3
            scale = _u8(w_ptr, base + 192 + half * 8 + r * 2 + l // 16, mask).to(tl.int8).to(tl.float32)
            w = _f16(w_ptr, base + 208, mask) * scale * ((low | (high << 4)) - 32).to(tl.float32)
        else:  # Q4_K, Q5_K: eight sub-blocks of 32 with 6-bit scales and mins
            sub = j // 32
            l = j % 32
            scale, minimum = _k_scale_min(w_ptr, base, sub, mask)
            qs = 16 + 32 * (FORMAT - 5)  # (after d, dmin and the scales; Q5_K: and 32 bytes of fifth bits)
            q = (_u8(w_ptr, base + qs + (sub // 2) * 32 + l, mask) >> (4 * (sub % 2))) & 0x0F
            if FORMAT == 6:  # Q5_K: bit sub of byte l of the fifth bits is value l's
                q |= ((_u8(w_ptr, base + 16 + l, mask) >> sub) & 1) << 4
            w = _f16(w_ptr, base, mask) * scale * q.to(tl.float32) - _f16(w_ptr, base + 2, mask) * minimum
    return w


@triton.jit
def _ggml_kernel(
    x_ptr, w_ptr, y_ptr, M, N, K, row_bytes, stride_xm, stride_ym,
    FORMAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_mask = rows < M
    col_mask = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + ks) < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + (k0 + ks)[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = _weights(w_ptr, cols[None, :], (k0 + ks)[:, None], col_mask[None, :] & k_mask[:, None], row_bytes,
                     FORMAT)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(x.to(tl.float32), w)
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def ggml_matmul(x: torch.Tensor, data: torch.Tensor, format: str) -> torch.Tensor:
    """``x @ w.T`` for ``w`` stored as ``format``'s blocks in ``data`` (``uint8 [N, row bytes]``); x ``[M, K]``
    in float16, bfloat16 or float32 (K: the weight's input features); the result in x's dtype."""
    values, size = BLOCKS[format]
    m, k = x.shape
    n, row_bytes = data.shape
    if row_bytes != k // values * size or k % values:
        raise ValueError(f"a {format} weight of {row_bytes} bytes a row does not take {k} input features")
    x = x.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m, block_n, block_k = (16, 64, 128) if m <= 16 else (64, 64, 64)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _ggml_kernel[grid](x, data, y, m, n, k, row_bytes, x.stride(0), y.stride(0), FORMAT=FORMATS[format],
                       BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y
