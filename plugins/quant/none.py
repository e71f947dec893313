"""``none``: weights kept in the model dtype (float32, float16 or bfloat16)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.hookspecs import hookimpl
from conveyor.quant import Params, QuantMethod


class NoQuant(QuantMethod):
    """Weights in the model dtype; a plain matmul."""

    name = "none"

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Params:
        params = {"weight": weight.to(device=self.device, dtype=self.dtype).contiguous()}
        if bias is not None:
            params["bias"] = bias.to(device=self.device, dtype=self.dtype)
        return params

    def linear(self, x: torch.Tensor, params: Params) -> torch.Tensor:
        return F.linear(x, params["weight"], params.get("bias"))


@hookimpl
def conveyor_register_quant_methods(register):
    register(NoQuant)
