"""Group-wise int4 weights for Conveyor (W4A16), written from ``conveyor.quant.QuantMethod`` alone.

Each run of ``group_size`` input features of a weight row shares one scale: the
weights become integers in [-8, 7] (symmetric, round to nearest), two to a
byte. A matmul unpacks them to the model dtype and multiplies: a quarter of the
bf16 bytes in memory, at the cost of the unpacking (a kernel that multiplies
the packed nibbles directly is what a fast method would add).

torch is imported inside the methods only: the server's frontend process loads
every plugin module to check the config and stays without torch.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from conveyor.hookspecs import hookimpl
from conveyor.quant import QuantMethod


class Int4Options(msgspec.Struct, forbid_unknown_fields=True):
    # input features that share one scale (in_features must be a multiple of it)
    group_size: Annotated[int, msgspec.Meta(ge=2, multiple_of=2)] = 32


class Int4(QuantMethod):
    """Group-wise symmetric int4 weights, unpacked to the model dtype for each matmul."""

    name = "int4_groups"  # (the built-in int4 keeps GGUF blocks for the kernels)
    Options = Int4Options

    def prepare(self, weight, bias=None):
        import torch

        out_features, in_features = weight.shape
        group = self.options.group_size
        if in_features % group:
            raise ValueError(f"[quant] group_size = {group} does not divide a layer's {in_features} input features")
        groups = weight.reshape(out_features, in_features // group, group)
        scale = groups.abs().amax(dim=2, keepdim=True).clamp(min=1e-12) / 7
        q = torch.clamp(torch.round(groups / scale), -8, 7).to(torch.int8).reshape(out_features, in_features)
        nibbles = (q + 8).to(torch.uint8)  # 0..15
        packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
        params = {"packed": packed.to(self.device), "scale": scale.squeeze(2).to(self.device, self.dtype)}
        if bias is not None:
            params["bias"] = bias.to(self.device, self.dtype)
        return params

    # (the default prepare_input_shard is right: a group's scale depends on its own columns only, and the
    # tensor-parallel split of in_features falls on group boundaries when group_size divides each share)

    def linear(self, x, params):
        y = x @ self.dequantize(params).T
        return y + params["bias"] if "bias" in params else y

    def dequantize(self, params):
        """The weight ``[out_features, in_features]`` in the model dtype."""
        import torch

        packed, scale = params["packed"], params["scale"]
        low = (packed & 0x0F).to(torch.int8) - 8
        high = (packed >> 4).to(torch.int8) - 8
        q = torch.stack((low, high), dim=2).reshape(packed.shape[0], -1)
        groups = q.reshape(q.shape[0], scale.shape[1], -1).to(self.dtype)
        return (groups * scale.unsqueeze(2)).reshape(q.shape)


@hookimpl
def conveyor_register_quant_methods(register):
    register(Int4)
