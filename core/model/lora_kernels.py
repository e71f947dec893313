"""Triton kernels for LoRA terms of a batch with many adapters (the CUDA path of ``conveyor.model.lora``).

Each token reads its own adapter slot (-1: none, nothing added), so one
launch covers every adapter in the step. ``shrink`` computes ``v = x @ A.T``
per token (``[T, R]``, float32), one program per token and block of R;
``expand`` adds ``v @ B.T`` to the base output, one program per token and
tile of output columns. This is the batched gather matrix-vector form that
suits decode steps; a prefill chunk runs it per token too.

Their torch reference is ``lora_reference``; the tests compare both under
``TRITON_INTERPRET=1`` on a CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_R = 16
BLOCK_K = 64
BLOCK_N = 64


@triton.jit
def _shrink_kernel(
    x_ptr,  # [T, K]
    a_ptr,  # [S, R, K]
    slots_ptr,  # [T] int32, -1: no adapter
    v_ptr,  # [T, R] float32
    R, K,
    stride_xt, stride_as, stride_ar, stride_vt,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    # a token without an adapter reads nothing: its input width counts as 0
    width = tl.where(slot >= 0, K, 0)
    slot = tl.maximum(slot, 0)
    rs = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + token * stride_xt + ks, mask=ks < width, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + slot * stride_as + rs[:, None] * stride_ar + ks[None, :],
                    mask=(rs[:, None] < R) & (ks[None, :] < width), other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(v_ptr + token * stride_vt + rs, acc, mask=rs < R)


@triton.jit
def _expand_kernel(
    v_ptr,  # [T, R] float32
    b_ptr,  # [S, N, R]
    slots_ptr,  # [T] int32
    y_ptr,  # [T, N], updated in place
    N, R,
    stride_vt, stride_bs, stride_bn, stride_yt,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    # a token without an adapter writes nothing: its output width counts as 0
    width = tl.where(slot >= 0, N, 0)
    slot = tl.maximum(slot, 0)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rs = r0 + tl.arange(0, BLOCK_R)
        v = tl.load(v_ptr + token * stride_vt + rs, mask=rs < R, other=0.0)
        b = tl.load(b_ptr + slot * stride_bs + ns[:, None] * stride_bn + rs[None, :],
                    mask=(ns[:, None] < width) & (rs[None, :] < R), other=0.0).to(tl.float32)
        acc += tl.sum(b * v[None, :], axis=1)
    mask = ns < width
    y = tl.load(y_ptr + token * stride_yt + ns, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + token * stride_yt + ns, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


def lora_add(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor) -> None:
    """``y[t] += B[s] @ (A[s] @ x[t])`` with ``s = token_slots[t]`` (skipped where -1), in place.

    Args:
        x: ``[T, K]``; y: ``[T, N]``; a: ``[S, R, K]``; b: ``[S, N, R]`` (any strides with R's 1);
        token_slots: ``[T]`` int32.
    """
    tokens, k = x.shape
    _, r, _ = a.shape
    n = b.shape[1]
    if tokens == 0:
        return
    x, a = x.contiguous(), a.contiguous()
    assert y.stride(1) == 1 and b.stride(2) == 1, "the output's and B's last dimensions must be contiguous"
    v = torch.empty(tokens, r, dtype=torch.float32, device=x.device)
    _shrink_kernel[(tokens, triton.cdiv(r, BLOCK_R))](
        x, a, token_slots, v, r, k, x.stride(0), a.stride(0), a.stride(1), v.stride(0),
        BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K,
    )
    _expand_kernel[(tokens, triton.cdiv(n, BLOCK_N))](
        v, b, token_slots, y, n, r, v.stride(0), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R,
    )


def lora_reference(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   token_slots: torch.Tensor) -> torch.Tensor:
    """What ``lora_add`` leaves in ``y``, token by token in float64 (a new tensor)."""
    out = y.double().clone()
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            out[t] += b[slot].double() @ (a[slot].double() @ x[t].double())
    return out
