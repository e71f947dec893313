"""``none``: weights kept in the model dtype (float32, float16 or bfloat16)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import msgspec

from conveyor.hookspecs import hookimpl
from conveyor.quant import Params, QuantMethod

if TYPE_CHECKING:
    import torch


class NoQuantOptions(msgspec.Struct, forbid_unknown_fields=True):
    # CPU, bfloat16: MB of memory for a second, row-major copy of the linear weights, which a C++ kernel
    # streams for steps of one token at about 1.2x the speed of oneDNN's prepacked layout (one stream
    # decodes 5-10% faster; benchmarks/latency.py). Layers get copies in order until the budget is spent;
    # 0 keeps none. Needs AVX-512 BF16; ignored elsewhere.
    cpu_one_token_copy_mb: Annotated[float, msgspec.Meta(ge=0)] = 1024.0


class NoQuant(QuantMethod):
    """Weights in the model dtype; a plain matmul (on CPU against oneDNN's prepacked layout)."""

    name = "none"
    Options = NoQuantOptions

    def __init__(self, options: NoQuantOptions | None, dtype: torch.dtype, device: torch.device):
        super().__init__(options, dtype, device)
        # bytes of row-major copies still allowed
        self.copy_budget = int(self.options.cpu_one_token_copy_mb * 2**20)

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Params:
        from conveyor.model.formats import one_token_kernel, prepack, prepacks

        weight = weight.to(device=self.device, dtype=self.dtype).contiguous()
        if not prepacks(self.device, self.dtype):
            params = {"weight": weight}
        elif weight.nbytes <= self.copy_budget and one_token_kernel(self.device, self.dtype):
            params = {"packed": prepack(weight), "rows": weight}
            self.copy_budget -= weight.nbytes
        else:
            params = {"packed": prepack(weight)}
        if bias is not None:
            params["bias"] = bias.to(device=self.device, dtype=self.dtype)
        return params

    def linear(self, x: torch.Tensor, params: Params) -> torch.Tensor:
        import torch.nn.functional as F

        from conveyor.model.formats import one_token_linear, packed_linear

        if "rows" in params and x.shape[0] == 1:
            return one_token_linear(x, params["rows"], params.get("bias"))
        if "packed" in params:
            return packed_linear(x, params["packed"], params.get("bias"))
        return F.linear(x, params["weight"], params.get("bias"))

    def num_bytes(self, params: Params) -> int:
        """Bytes one step reads (the row-major copy for one-token steps is the same weights again)."""
        return sum(t.numel() * t.element_size() for name, t in params.items() if name != "rows")


@hookimpl
def conveyor_register_quant_methods(register):
    register(NoQuant)
