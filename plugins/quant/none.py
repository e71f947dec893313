"""``none``: weights kept in the model dtype (float32, float16 or bfloat16)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.model.formats import (
    decode_copy,
    decode_layout,
    decode_linear,
    decode_rows,
    packed_linear,
    prepack,
    prepacks,
)
from conveyor.plugins.quant.declarations import NoQuantOptions
from conveyor.quant import Params, QuantMethod


class NoQuant(QuantMethod):
    """Weights in the model dtype; a plain matmul (on CPU against oneDNN's prepacked layout)."""

    name = "none"
    Options = NoQuantOptions

    def __init__(self, options: NoQuantOptions | None, dtype: torch.dtype, device: torch.device):
        super().__init__(options, dtype, device)
        # bytes of decode copies still allowed
        self.copy_budget = int(self.options.cpu_decode_copy_mb * 2**20)

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Params:
        weight = weight.to(device=self.device, dtype=self.dtype).contiguous()
        if not prepacks(self.device, self.dtype):
            params = {"weight": weight}
        else:
            params = {"packed": prepack(weight)}
            layout = decode_layout(self.device, self.dtype) if weight.nbytes <= self.copy_budget else None
            copy = decode_copy(layout, weight) if layout else None
            if copy is not None:
                params["decode"] = copy
                self.copy_budget -= weight.nbytes
        if bias is not None:
            params["bias"] = bias.to(device=self.device, dtype=self.dtype)
        return params

    def linear(self, x: torch.Tensor, params: Params) -> torch.Tensor:
        if "decode" in params and x.shape[0] <= decode_rows(params["decode"]):
            return decode_linear(x, params["decode"], params.get("bias"))
        if "packed" in params:
            return packed_linear(x, params["packed"], params.get("bias"))
        return F.linear(x, params["weight"], params.get("bias"))

    def num_bytes(self, params: Params) -> int:
        """Bytes one step reads (the decode copy is the same weights again)."""
        return sum(t.numel() * t.element_size() for name, t in params.items() if name != "decode")

    def formats(self, params: Params) -> dict[str, int]:
        formats = {str(self.dtype).removeprefix("torch."): self.num_bytes(params)}
        if "decode" in params:
            formats["copies"] = params["decode"].numel() * params["decode"].element_size()
        return formats
