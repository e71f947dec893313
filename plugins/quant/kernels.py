"""Triton GEMMs for quantized weights (the CUDA path of the int8 and fp8 quant methods).

All compute ``y[m, n] = sum_k x[m, k] * w[n, k] * w_scale[n]`` with ``w``
stored as int8 or float8_e4m3fn, one scale per output channel:

- ``w8a16_matmul``: activations stay in fp16/bf16/fp32; each weight tile is
  converted in registers (the bytes read from memory are the 1-byte weights).
- ``w8a8_fp8_matmul``: activations quantized per token to e4m3 as well, and
  the tile product runs on fp8 matrix units (CUDA compute capability >= 8.9).

Block sizes follow the shape: decode (few rows) uses 16-row tiles and wide
K steps, prefill (many rows) 64x64 tiles. Set ``TRITON_INTERPRET=1`` before
import to run on CPU tensors (tests do; it is slow, so test small shapes).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from conveyor.model.formats import quantize_fp8

# NOTE: the interpreter mishandles tl.dot on bf16 and fp8 operands; under it the operands go in as fp32.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _w8_kernel(
    x_ptr, w_ptr, w_scale_ptr, x_scale_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    X_SCALED: tl.constexpr,  # x is fp8 with a per-row scale (W8A8)
    UPCAST: tl.constexpr,  # dot in fp32 (interpreter)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
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
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_wn + (k0 + ks)[:, None],
                    mask=col_mask[None, :] & k_mask[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32))
        elif X_SCALED:
            acc += tl.dot(x, w)  # fp8 x fp8 on the matrix units
        else:
            acc += tl.dot(x, w.to(x.dtype))
    w_scale = tl.load(w_scale_ptr + cols, mask=col_mask, other=0.0)
    acc = acc * w_scale[None, :]
    if X_SCALED:
        x_scale = tl.load(x_scale_ptr + rows, mask=row_mask, other=0.0)
        acc = acc * x_scale[:, None]
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def _blocks(m: int) -> tuple[int, int, int]:
    if m <= 16:
        return 16, 64, 128  # decode: one row tile, long K steps over the weight
    return 64, 64, 64


def _launch(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, x_scale: torch.Tensor | None,
            out_dtype: torch.dtype) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    block_m, block_n, block_k = _blocks(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w8_kernel[grid](
        x, w, w_scale, x_scale if x_scale is not None else w_scale, y,
        m, n, k, x.stride(0), w.stride(0), y.stride(0),
        X_SCALED=x_scale is not None, UPCAST=INTERPRETED and (x.dtype != torch.float32),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return y


def w8a16_matmul(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """``x @ (w * w_scale[:, None]).T`` for int8 or float8_e4m3fn ``w`` [N, K]; x [M, K] in fp16/bf16/fp32."""
    return _launch(x.contiguous(), w, w_scale.float().contiguous(), None, x.dtype)


def w8a8_fp8_matmul(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """W8A8: x quantized per token to e4m3, then an fp8 x fp8 GEMM with both scales applied after."""
    q, x_scale = quantize_fp8(x)
    return _launch(q, w, w_scale.float().contiguous(), x_scale, x.dtype)
