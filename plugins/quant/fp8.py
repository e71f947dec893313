"""``fp8``: float8 e4m3 weights with one scale per output channel.

``activations = "bf16"`` (W8A16) keeps activations in the model dtype and
upcasts the weight in registers: in a Triton kernel on CUDA, in a C++ kernel
on a CPU with AVX2 (``csrc/fp8_linear.cpp``: a CPU has no fp8 arithmetic, so
the bytes become float32 there), up to ``cpu_kernel_max_rows`` rows where the
model dtype has a fast dense matmul (past them a dequantized copy of the layer,
made in one vectorized C++ pass, and that matmul) and at every row count where
it has none.

The kernel wins up to 8 rows; past them the dequantized copy and oneDNN do (docs/quantization.md, "int8 and
fp8 layer by layer").
``activations = "fp8"`` (W8A8) also quantizes each token's activations to
e4m3 with a dynamic scale and multiplies on fp8 matrix units: CUDA compute
capability 8.9 or newer (Ada, Hopper). ``"auto"`` picks W8A8 where the
hardware has fp8 units and W8A16 elsewhere. A checkpoint stored in fp8 with a scale per output channel or
per tensor (compressed-tensors' FP8) is kept as it is, not quantized again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.model.formats import prepacks, quantize_fp8
from conveyor.model.ggml import PackedWeight
from conveyor.plugins.quant.declarations import FP8Options
from conveyor.quant import FP8_TYPE_ID, NativeWeight, Params, QuantMethod


def upcast(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 -> ``dtype``, exactly. On CPU through float16 bits, 1.7x faster than ``q.to(dtype)`` there.

    The e4m3 sign, exponent and mantissa fields, moved into float16's, give
    the same number times 2^-8, for normal and subnormal values alike.
    """
    if q.device.type != "cpu":
        return q.to(dtype)
    bits = q.view(torch.uint8).to(torch.int16)
    half = (((bits & 0x80) << 8) | ((bits & 0x7F) << 7)).view(torch.float16)
    return half.to(dtype) * 256


def has_fp8_units(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class FP8(QuantMethod):
    """e4m3 weights; W8A16 or W8A8."""

    name = "fp8"
    Options = FP8Options
    # a checkpoint's e4m3 weights with a scale per row (compressed-tensors' FP8), kept as they are
    packed_formats = frozenset({"F8_E4M3"})

    def __init__(self, options: FP8Options | None, dtype: torch.dtype, device: torch.device):
        super().__init__(options, dtype, device)
        mode = self.options.activations
        if mode == "auto":
            mode = "fp8" if has_fp8_units(device) else "bf16"
        if mode == "fp8" and device.type == "cuda" and not has_fp8_units(device):
            raise ValueError("[quant] activations = 'fp8' needs a GPU with fp8 matrix units (compute capability >= 8.9)")
        self.w8a8 = mode == "fp8"
        self.kernel = self.fast_dense = False
        if device.type == "cpu" and not self.w8a8:
            from conveyor import native

            # the C++ kernel (converting the weights in registers), and whether the model dtype has a fast dense
            # matmul here (else the kernel takes every row count)
            self.kernel = native.load() and native.fp8_linear_supported()
            self.fast_dense = prepacks(device, dtype)

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Params:
        return self._params(*quantize_fp8(weight.float()), bias)

    def prepare_input_shard(self, weight: torch.Tensor, columns: slice) -> Params:
        q, scale = quantize_fp8(weight.float())
        return self._params(q[:, columns], scale)

    def prepare_packed(self, parts: list[PackedWeight], bias: torch.Tensor | None = None) -> Params:
        if any(part.format != "F8_E4M3" for part in parts):
            raise ValueError(f"the fp8 method takes F8_E4M3 weights, not {sorted({p.format for p in parts})}")
        q = torch.cat([part.data for part in parts]).view(torch.float8_e4m3fn)
        return self._params(q, torch.cat([part.scale for part in parts]).float(), bias)

    def _params(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> Params:
        params = {"qweight": q.to(self.device).contiguous(), "scale": scale.to(self.device)}
        if bias is not None:
            params["bias"] = bias.to(device=self.device, dtype=self.dtype)
        return params

    def native_weight(self, params: Params) -> NativeWeight | None:
        if not self.kernel or "bias" in params:  # (a CPU without W8A8 only)
            return None
        return NativeWeight(params["qweight"], FP8_TYPE_ID, params["scale"],
                            self.options.cpu_kernel_max_rows if self.fast_dense else None)

    def linear(self, x: torch.Tensor, params: Params) -> torch.Tensor:
        q, scale = params["qweight"], params["scale"]
        if x.device.type == "cuda":
            from conveyor.plugins.quant.kernels import w8a8_fp8_matmul, w8a16_matmul

            y = (w8a8_fp8_matmul if self.w8a8 else w8a16_matmul)(x, q, scale)
        elif self.w8a8:
            xq, x_scale = quantize_fp8(x)
            y = torch._scaled_mm(xq, q.t(), scale_a=x_scale[:, None], scale_b=scale[None, :], out_dtype=x.dtype)
        elif self.kernel and (x.shape[0] <= self.options.cpu_kernel_max_rows or not self.fast_dense):
            from conveyor import native

            return native.fp8_linear(x, q, scale, params.get("bias"))
        elif self.kernel:  # (the same bits as below, in one vectorized pass)
            from conveyor import native

            y = F.linear(x, native.fp8_upcast(q, scale, x.dtype))
        else:
            y = F.linear(x, upcast(q, x.dtype) * scale[:, None].to(x.dtype))
        bias = params.get("bias")
        return y if bias is None else y + bias
