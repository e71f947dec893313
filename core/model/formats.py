"""Weight and activation formats the quant methods, the model and the KV cache share: oneDNN's prepacked
dense weights (CPU) and fp8 e4m3 with one scale per row."""

from __future__ import annotations

import torch

# the largest finite float8_e4m3fn
FP8_MAX = 448.0


def prepacks(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether dense weights of this dtype go to oneDNN's prepacked layout here (CPU, float32 or bfloat16)."""
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
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


def quantize_fp8(x: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 with one scale per row (the last dimension): ``x ~= q * scale[..., None]``, each row's largest
    magnitude at FP8_MAX. Weights use it per output channel, activations per token, the KV cache per token
    and head (with bfloat16 scales; values are divided by the rounded scale, so dequantizing is exact)."""
    scale = (x.abs().amax(dim=-1).float() / FP8_MAX).clamp_min(1e-12).to(scale_dtype)
    q = (x.float() / scale.float()[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale
