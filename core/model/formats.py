"""Weight and activation formats the quant methods, the model and the KV cache share: oneDNN's prepacked
dense weights (CPU) and fp8 e4m3 with one scale per row."""

from __future__ import annotations

import torch

# the largest finite float8_e4m3fn
FP8_MAX = 448.0


def prepacks(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether dense weights of this dtype go to oneDNN's prepacked layout here (CPU, float32 or bfloat16;
    bfloat16 only where oneDNN has a bfloat16 path on this CPU: AVX-512 or AVX-NE-CONVERT, not AVX2 alone)."""
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and (dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` -> an opaque oneDNN tensor for ``packed_linear``.

    NOTE: on CPU a matmul against a prepacked weight skips oneDNN's per-call
    reorder: measured 2x faster at one token and 1.1-1.3x at 32-64 tokens for
    SmolLM2's shapes, with identical results.
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for a weight from ``prepack``; x is ``[tokens, in]``."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def one_token_kernel(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``one_token_linear`` runs here (a CPU with AVX-512 BF16 where the C++ kernels build; bfloat16)."""
    from conveyor import native

    return device.type == "cpu" and dtype == torch.bfloat16 and native.gemv_supported()


def one_token_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x [1, in]`` against a row-major bfloat16 ``weight`` (where
    ``one_token_kernel``): one pass over the weight, streamed at close to the memory's read bandwidth."""
    from conveyor import native

    return native.gemv_bf16(x.contiguous(), weight, bias)


# The most tokens a step may have for the AMX kernel (tile_linear); the one-token kernel takes one.
TILE_ROWS = 64


def decode_layout(device: torch.device, dtype: torch.dtype) -> str | None:
    """The layout of a second copy of a dense weight that decode steps read faster here: "tiles" (AMX B tiles
    for ``tile_linear``, steps of up to TILE_ROWS tokens), "rows" (row-major for ``one_token_linear``, steps of
    one token: AVX-512 BF16 without AMX), or None (neither kernel runs: no copy)."""
    from conveyor import native

    if device.type != "cpu" or dtype != torch.bfloat16:
        return None
    if native.tile_linear_supported():
        return "tiles"
    return "rows" if native.gemv_supported() else None


def decode_copy(layout: str, weight: torch.Tensor) -> torch.Tensor | None:
    """``weight [out, in]`` in ``layout``; None where its shape does not tile (out % 16 or in % 32)."""
    if layout == "rows":
        return weight.contiguous()
    n, k = weight.shape
    if n % 16 or k % 32:
        return None
    # [n / 16, 16 (column), k / 32, 16 (pair), 2] -> tile (n / 16, k / 32): row = pair, then column, then its two
    return weight.reshape(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).reshape(n // 16, k // 32, 16, 32).contiguous()


def decode_rows(copy: torch.Tensor) -> int:
    """The most tokens ``decode_linear`` takes with this copy."""
    return TILE_ROWS if copy.dim() == 4 else 1


def decode_linear(x: torch.Tensor, copy: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` from ``decode_copy(layout, weight)``, ``x [tokens, in]`` with at most
    ``decode_rows(copy)`` tokens."""
    if copy.dim() == 4:
        from conveyor import native

        return native.tile_linear(x.contiguous(), copy, bias)
    return one_token_linear(x, copy, bias)


def quantize_fp8(x: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 with one scale per row (the last dimension): ``x ~= q * scale[..., None]``, each row's largest
    magnitude at FP8_MAX. Weights use it per output channel, activations per token, the KV cache per token
    and head (with bfloat16 scales; values are divided by the rounded scale, so dequantizing is exact)."""
    scale = (x.abs().amax(dim=-1).float() / FP8_MAX).clamp_min(1e-12).to(scale_dtype)
    q = (x.float() / scale.float()[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale
