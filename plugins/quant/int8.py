"""``int8``: int8 weights, symmetric, one scale per output channel; bf16 activations (W8A16), or int8 ones per
32 values (per 64 in AMX steps of 16 rows or more) inside the CPU kernel where it takes Q8_0 blocks (W8A8).

Each linear weight is stored as int8 with ``scale = max|w_row| / 127``. Decode reads half the bytes of bf16.

- On an x86 CPU (AVX2, or AVX-512 VNNI) where the C++ kernels build, the weight is kept as GGUF's Q8_0 blocks
  (32 int8 values and a float16 scale, here each block carrying its row's scale, rounded to float16 before the
  values are) and multiplied by the packed-block kernel (``conveyor.native.ggml_linear``): the activations
  rounded to int8 per 32 values (at most 1/254 of a block's largest) and integer dot products, each unpacked
  block reused for every row of a step (VPDPBUSD with VNNI), so int8 keeps its speed at any batch instead of
  dequantizing past a few rows, and decode steps run every layer in one call (``conveyor.model.native_decode``).
  1.06 bytes a weight (the scales). The blocks go to the kernel as Q8_0R, which says their scales are one a row:
  with AMX (Intel since Sapphire Rapids), steps of 16 rows or more then round x per 64 values (where K is a
  multiple of 64), and each 16 x 16 x 64 tile product needs only x's scale (``run_rows_gemm`` in
  csrc/ggml_gemm.cpp).
- Other CPUs take ``torch._weight_int8pack_mm`` (int8 weights straight into the matmul): up to
  ``cpu_int8_max_rows`` rows where the model dtype has a fast dense matmul (oneDNN's bf16 path: AVX-512), past
  them a dequantized copy and that matmul; at every row count where it has none (AVX2 alone: bf16 emulated).
- On CUDA the product runs in a Triton kernel that converts the weight tile in registers.

Which path wins where is measured in docs/quantization.md ("int8 and fp8 layer by layer"): on AVX2 alone
int8pack multiplies one layer faster than the Q8_0 tiles, but whole decode steps favour the blocks (every layer in
one call); with AMX, rounding x per 64 values is what lifts int8 above bf16 at 64 requests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.model.formats import prepacks
from conveyor.model.ggml import QK, TYPE_IDS, encode
from conveyor.plugins.quant.declarations import Int8Options
from conveyor.quant import NativeWeight, Params, QuantMethod

INT8_MAX = 127.0
# NOTE: torch._weight_int8pack_mm (CPU) crashes or miscomputes unless in_features is a multiple of 32;
# other layers take the dequantizing path. The Q8_0 blocks need the same multiple.
INT8PACK_K_MULTIPLE = 32


def quantize_int8(weight: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest per-row int8: ``weight ~= q * scale[:, None]``; ``scale``: given (else max|row| / 127)."""
    if scale is None:
        scale = (weight.abs().amax(dim=1) / INT8_MAX).clamp_min(1e-12)
    q = torch.round(weight / scale.clamp_min(1e-30)[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def q8_0_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 ``[N, K]`` with a float16-exact scale per row -> ``uint8 [N, K / 32 * 34]`` Q8_0 blocks."""
    n, k = q.shape
    return encode("Q8_0", q, scale[:, None].expand(n, k // QK)).data


class Int8WeightOnly(QuantMethod):
    """int8 weights with per-channel scales."""

    name = "int8"
    Options = Int8Options

    def __init__(self, options: Int8Options | None, dtype: torch.dtype, device: torch.device):
        super().__init__(options, dtype, device)
        # whether the model dtype has a fast dense matmul here (else int8pack takes every row count)
        self.fast_dense = prepacks(device, dtype)

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Params:
        q, scale, blocks = self._quantize(weight.float())
        return self._params(q, scale, blocks, bias)

    def prepare_input_shard(self, weight: torch.Tensor, columns: slice) -> Params:
        q, scale, blocks = self._quantize(weight.float())
        return self._params(q[:, columns], scale, blocks)

    def _quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The int8 values, the scales, and whether they go into Q8_0 blocks here (then each scale is rounded
        to float16 before the values are rounded against it)."""
        if self.device.type != "cpu" or weight.shape[1] % INT8PACK_K_MULTIPLE or not q8_0_kernel():
            return *quantize_int8(weight), False
        scale = (weight.abs().amax(dim=1) / INT8_MAX).to(torch.float16).float()
        if not scale.isfinite().all():  # (weights past float16's range times 127: never in a real model)
            return *quantize_int8(weight), False
        return *quantize_int8(weight, scale), True

    def _params(self, q: torch.Tensor, scale: torch.Tensor, blocks: bool, bias: torch.Tensor | None = None) -> Params:
        if blocks and q.shape[1] % INT8PACK_K_MULTIPLE == 0:  # (a shard's columns may not fall on blocks)
            params = {"q8_0": q8_0_blocks(q, scale)}
        else:
            params = {"qweight": q.to(self.device).contiguous(), "scale": scale.to(self.device)}
            if self.device.type == "cpu":
                params["scale_model_dtype"] = scale.to(self.dtype)
        if bias is not None:
            params["bias"] = bias.to(device=self.device, dtype=self.dtype)
        return params

    def native_weight(self, params: Params) -> NativeWeight | None:
        if "q8_0" not in params or "bias" in params:
            return None
        return NativeWeight(params["q8_0"], TYPE_IDS["Q8_0R"])

    def linear(self, x: torch.Tensor, params: Params) -> torch.Tensor:
        bias = params.get("bias")
        if "q8_0" in params:
            from conveyor import native

            return native.ggml_linear(x, params["q8_0"], TYPE_IDS["Q8_0R"], bias)
        q = params["qweight"]
        if x.device.type == "cuda":
            from conveyor.plugins.quant.kernels import w8a16_matmul

            y = w8a16_matmul(x, q, params["scale"])
        elif q.shape[1] % INT8PACK_K_MULTIPLE == 0 and (
                x.shape[0] <= self.options.cpu_int8_max_rows or not self.fast_dense):
            y = torch._weight_int8pack_mm(x.contiguous(), q, params["scale_model_dtype"])
        else:
            y = F.linear(x, q.to(x.dtype) * params["scale_model_dtype"][:, None])
        return y if bias is None else y + bias


def q8_0_kernel() -> bool:
    """Whether the packed-block kernel has a vector path here (AVX2, or AVX-512 VNNI), where Q8_0 blocks serve
    int8 weights (see the module's note)."""
    from conveyor import native
    from conveyor.plugins.quant.gguf import kernels_built

    return kernels_built() and native.ggml_linear_path() in ("avx2", "avx512_vnni", "amx")
