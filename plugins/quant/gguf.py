"""``gguf``: llama.cpp's quantized blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) kept as the GGUF
file stores them, and ``auto``, the default: the same for a checkpoint with such tensors (and for a Hugging Face
int4 or int8 checkpoint's weights, which ``conveyor.model.hf_quant`` turns into Q4_0, Q4_1 or Q8_0 blocks),
``fp8``'s kernels for one stored in fp8, the model dtype for the rest.

A quantized GGUF is served at its size: its blocks are never expanded to bf16 or fp32 (a Q4_1 weight is 5
bits, not 16), the embedding table and a tied output head included. On a CPU with the C++ kernels a step
multiplies the blocks as they are (``conveyor.native.ggml_linear``: each row of x quantized per 32 values to
int8, as llama.cpp does); on CUDA a Triton GEMM unpacks them in registers (``ggml_kernels.ggml_matmul``,
activations in the model dtype); on a CPU without a compiler each layer is dequantized into the model dtype when
it runs and multiplied there, which is correct but gives back the time, not the memory. Tensors
the file stores as floats (norms; F16/BF16/F32 weights) take the ``none`` method's path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.model import ggml
from conveyor.model.ggml import PackedWeight
from conveyor.plugins.quant.fp8 import FP8
from conveyor.plugins.quant.none import NoQuant
from conveyor.quant import NativeWeight, Params

# the GGML types a file stores (conveyor.model.ggml.BLOCKS also holds the layouts the kernels repack them into)
FORMATS = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"})


class GGUFQuant(NoQuant):
    """GGUF blocks kept packed; float weights as ``none`` keeps them."""

    name = "gguf"
    packed_formats = FORMATS

    def prepare_packed(self, parts: list[PackedWeight], bias: torch.Tensor | None = None) -> Params:
        """Params ``"{i}:{format}:{layout}"`` hold the blocks of the i-th run of parts in one format, in order
        (``uint8 [rows, row bytes]``), as the file stores them or, where the kernels run, repacked losslessly
        into the layout they read fastest (``conveyor.model.ggml.repack``: Q4_0 and Q4_1 two blocks to a unit)."""
        repack = self.device.type == "cpu" and kernels_built()
        kept = [(part.format, ggml.repack(part) if repack else part) for part in parts]
        # consecutive parts in one format (Q, K and V; gate and up, as a file usually has them) become one
        # tensor: one kernel call and no concatenation of outputs per step
        runs: list[tuple[str, list[PackedWeight]]] = []
        for format, part in kept:
            if runs and runs[-1][0] == format and runs[-1][1][-1].format == part.format:
                runs[-1][1].append(part)
            else:
                runs.append((format, [part]))
        params = {}
        for i, (format, run) in enumerate(runs):
            data = run[0].data if len(run) == 1 else torch.cat([part.data for part in run])
            params[f"{i}:{format}:{run[0].format}"] = data.to(self.device).contiguous()
        if bias is not None:
            params["bias"] = bias.to(device=self.device, dtype=self.dtype)
        return params

    def packed_table(self, params: Params) -> PackedWeight | None:
        parts = [(key.rpartition(":")[2], data) for key, data in params.items() if ":" in key]
        if len(parts) != 1:
            return None
        layout, data = parts[0]
        values, size = ggml.BLOCKS[layout]
        return PackedWeight(layout, data, data.shape[1] // size * values)

    def native_weight(self, params: Params) -> NativeWeight | None:
        table = self.packed_table(params)
        if table is None or "bias" in params or not kernels_built():
            return None  # (several parts, a bias, or float weights)
        return NativeWeight(table.data, ggml.TYPE_IDS[table.format])

    def linear(self, x: torch.Tensor, params: Params) -> torch.Tensor:
        parts = [(key.rpartition(":")[2], data) for key, data in params.items() if ":" in key]
        if not parts:
            return super().linear(x, params)
        outputs = [_multiply(x, format, data) for format, data in parts]
        y = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)
        bias = params.get("bias")
        return y if bias is None else y + bias

    def num_bytes(self, params: Params) -> int:
        if not any(":" in key for key in params):
            return super().num_bytes(params)
        return sum(t.numel() * t.element_size() for t in params.values())

    def formats(self, params: Params) -> dict[str, int]:
        if not any(":" in key for key in params):
            return super().formats(params)
        formats: dict[str, int] = {}
        for key, t in params.items():
            # (the file's format; the bias: the model dtype)
            format = key.split(":")[1] if ":" in key else str(t.dtype).removeprefix("torch.")
            formats[format] = formats.get(format, 0) + t.numel() * t.element_size()
        return formats


def _multiply(x: torch.Tensor, format: str, data: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for one part's blocks: the C++ kernels where they run, else dequantized per call."""
    values, size = ggml.BLOCKS[format]
    in_features = data.shape[1] // size * values
    if x.shape[1] < in_features:  # (a repacked row's zero block)
        x = F.pad(x, (0, in_features - x.shape[1]))
    if kernels_run(x):
        from conveyor import native

        return native.ggml_linear(x, data, ggml.TYPE_IDS[format])
    if x.device.type == "cuda":
        from conveyor.plugins.quant.ggml_kernels import ggml_matmul

        return ggml_matmul(x, data, format)
    return F.linear(x, ggml.dequantize(PackedWeight(format, data, in_features), x.dtype))


def kernels_built() -> bool:
    """Whether the C++ block kernels build here."""
    from conveyor import native

    return native.load()


def kernels_run(x: torch.Tensor) -> bool:
    """Whether the C++ block kernels multiply ``x`` here (a CPU where they build)."""
    return x.device.type == "cpu" and kernels_built()


class AutoQuant(GGUFQuant):
    """The default: each weight kept as the checkpoint stores it, quantized or not.

    A quantized GGUF's blocks as ``gguf`` keeps them (and a Hugging Face int4 or int8 checkpoint's weights,
    turned into those blocks), fp8 weights as ``fp8`` keeps them, float weights in the model dtype (``none``)."""

    name = "auto"
    packed_formats = FORMATS | FP8.packed_formats

    def __init__(self, options, dtype: torch.dtype, device: torch.device):
        super().__init__(options, dtype, device)
        self.fp8 = FP8(None, dtype, device)

    def prepare_packed(self, parts: list[PackedWeight], bias: torch.Tensor | None = None) -> Params:
        if parts[0].format in self.fp8.packed_formats:
            return self.fp8.prepare_packed(parts, bias)
        return super().prepare_packed(parts, bias)

    def linear(self, x: torch.Tensor, params: Params) -> torch.Tensor:
        if "qweight" in params:  # (fp8)
            return self.fp8.linear(x, params)
        return super().linear(x, params)

    def native_weight(self, params: Params) -> NativeWeight | None:
        if "qweight" in params:
            return self.fp8.native_weight(params)
        return super().native_weight(params)

    def formats(self, params: Params) -> dict[str, int]:
        if "qweight" in params:
            return self.fp8.formats(params)
        return super().formats(params)
