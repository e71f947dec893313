"""``int8``: weight-only int8 (W8A16), symmetric, one scale per output channel.

Each linear weight is stored as int8 with ``scale = max|w_row| / 127``; the
activations stay in the model dtype. Decode reads half the bytes of bf16.
On CUDA the product runs in a Triton kernel that converts the weight tile in
registers. On CPU, small batches use ``torch._weight_int8pack_mm`` (int8
weights straight into the matmul), larger ones dequantize and use the bf16
matmul, which is faster there; the switch-over row count is an option,
chosen by measurement (benchmarks/quant.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import msgspec

from conveyor.hookspecs import hookimpl
from conveyor.quant import Params, QuantMethod

if TYPE_CHECKING:
    import torch

INT8_MAX = 127.0
# NOTE: torch._weight_int8pack_mm (CPU) crashes or miscomputes unless in_features is a multiple of 32;
# other layers take the dequantizing path.
INT8PACK_K_MULTIPLE = 32


class Int8Options(msgspec.Struct, forbid_unknown_fields=True):
    # CPU: batches of up to this many tokens multiply the int8 weights directly; larger ones dequantize first
    cpu_int8_max_rows: Annotated[int, msgspec.Meta(ge=0)] = 16


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest per-row int8: ``weight ~= q * scale[:, None]``."""
    import torch

    scale = (weight.abs().amax(dim=1) / INT8_MAX).clamp_min(1e-12)
    q = torch.round(weight / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


class Int8WeightOnly(QuantMethod):
    """int8 weights with per-channel scales, model-dtype activations."""

    name = "int8"
    Options = Int8Options

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Params:
        return self._params(*quantize_int8(weight.float()), bias)

    def prepare_input_shard(self, weight: torch.Tensor, columns: slice) -> Params:
        q, scale = quantize_int8(weight.float())
        return self._params(q[:, columns], scale)

    def _params(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> Params:
        params = {"qweight": q.to(self.device).contiguous(), "scale": scale.to(self.device)}
        if self.device.type == "cpu":
            params["scale_model_dtype"] = scale.to(self.dtype)
        if bias is not None:
            params["bias"] = bias.to(device=self.device, dtype=self.dtype)
        return params

    def linear(self, x: torch.Tensor, params: Params) -> torch.Tensor:
        import torch
        import torch.nn.functional as F

        q = params["qweight"]
        if x.device.type == "cuda":
            from conveyor.plugins.quant.kernels import w8a16_matmul

            y = w8a16_matmul(x, q, params["scale"])
        elif x.shape[0] <= self.options.cpu_int8_max_rows and q.shape[1] % INT8PACK_K_MULTIPLE == 0:
            y = torch._weight_int8pack_mm(x.contiguous(), q, params["scale_model_dtype"])
        else:
            y = F.linear(x, q.to(x.dtype) * params["scale_model_dtype"][:, None])
        bias = params.get("bias")
        return y if bias is None else y + bias


@hookimpl
def conveyor_register_quant_methods(register):
    register(Int8WeightOnly)
