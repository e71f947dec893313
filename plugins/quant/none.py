"""``none``: weights kept in the model dtype (float32, float16 or bfloat16)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from conveyor.hookspecs import hookimpl
from conveyor.quant import Params, QuantMethod

if TYPE_CHECKING:
    import torch


class NoQuant(QuantMethod):
    """Weights in the model dtype; a plain matmul (on CPU against oneDNN's prepacked layout)."""

    name = "none"

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Params:
        from conveyor.model.formats import prepack, prepacks

        weight = weight.to(device=self.device, dtype=self.dtype).contiguous()
        params = {"packed": prepack(weight)} if prepacks(self.device, self.dtype) else {"weight": weight}
        if bias is not None:
            params["bias"] = bias.to(device=self.device, dtype=self.dtype)
        return params

    def linear(self, x: torch.Tensor, params: Params) -> torch.Tensor:
        import torch.nn.functional as F

        from conveyor.model.formats import packed_linear

        if "packed" in params:
            return packed_linear(x, params["packed"], params.get("bias"))
        return F.linear(x, params["weight"], params.get("bias"))


@hookimpl
def conveyor_register_quant_methods(register):
    register(NoQuant)
