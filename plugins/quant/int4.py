"""``int4``: any checkpoint's float linear weights served at 4 bits, quantized at load into GGUF's blocks of 32
values and then kept and multiplied exactly as the ``gguf`` method keeps a quantized file's (packed, by the C++
block kernels on a CPU: the activations rounded to int8 per 32 values).

The rounding is llama.cpp's reference quantizer, through the ``gguf`` package (``gguf.quants.quantize``):

- ``Q4_1`` (the default, 5 bits a weight): per block ``d = (max - min) / 15``, ``m = min``, each weight
  ``round((w - m) / d)`` in 0..15, d and m in float16;
- ``Q4_0`` (4.5 bits): per block ``d = v / -8`` where v is the block's value of largest magnitude, each weight
  ``round(w / d) + 8`` clamped to 0..15 (so v itself is exact), d in float16.

A layer whose input features are not a multiple of 32 stays in the model dtype. A GGUF checkpoint's quantized
tensors are kept as the file stores them, as under ``gguf``.
"""

from __future__ import annotations

import torch

from conveyor.model.ggml import QK, PackedWeight
from conveyor.plugins.quant.declarations import Int4Options
from conveyor.plugins.quant.gguf import GGUFQuant
from conveyor.quant import Params, QuantMethod


class Int4(GGUFQuant):
    """Float weights quantized at load into Q4_1 or Q4_0 blocks; a GGUF's blocks kept as they are."""

    name = "int4"
    Options = Int4Options

    def __init__(self, options: Int4Options | None, dtype: torch.dtype, device: torch.device):
        QuantMethod.__init__(self, options, dtype, device)
        self.copy_budget = 0  # (the layers left in the model dtype get no decode copies)

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Params:
        from gguf import GGMLQuantizationType, quants

        if weight.shape[1] % QK:
            return super().prepare(weight, bias)
        block = self.options.block
        data = quants.quantize(weight.float().numpy(), GGMLQuantizationType[block])
        return self.prepare_packed([PackedWeight(block, torch.from_numpy(data), weight.shape[1])], bias)
