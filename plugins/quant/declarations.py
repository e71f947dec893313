"""The built-in quantization methods as the registry knows them before their code (and torch) is imported: their
options, and where each class is (``conveyor.hookspecs.Declaration``)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from conveyor.hookspecs import Declaration, hookimpl


class NoQuantOptions(msgspec.Struct, forbid_unknown_fields=True):
    # CPU, bfloat16: MB of memory for a second copy of the linear weights that a C++ kernel streams for
    # decode steps faster than oneDNN's prepacked layout: with AMX, laid out as AMX tiles for steps of up
    # to 64 tokens; with AVX-512 BF16 only, row-major for steps of one token (docs/performance.md, "Fast steps"). Layers
    # get copies in order until the budget is spent; 0 keeps none. Ignored elsewhere.
    cpu_decode_copy_mb: Annotated[float, msgspec.Meta(ge=0)] = 1024.0


class Int8Options(msgspec.Struct, forbid_unknown_fields=True):
    # CPU without the packed-block kernel's vector paths: batches of up to this many tokens multiply the int8 weights
    # directly; larger ones dequantize first where the model dtype has a fast dense matmul (AVX-512), else they
    # too multiply directly
    cpu_int8_max_rows: Annotated[int, msgspec.Meta(ge=0)] = 16


class Int4Options(msgspec.Struct, forbid_unknown_fields=True):
    # the block format weights are quantized into: "Q4_1" (a scale and a minimum per 32 values, 5 bits a weight)
    # or "Q4_0" (a scale per 32 values, symmetric, 4.5 bits a weight)
    block: Literal["Q4_1", "Q4_0"] = "Q4_1"


class FP8Options(msgspec.Struct, forbid_unknown_fields=True):
    # "auto": fp8 activations (W8A8) on CUDA >= 8.9, else the model dtype (W8A16)
    activations: Literal["auto", "bf16", "fp8"] = "auto"
    # CPU, W8A16: batches of up to this many tokens multiply the fp8 weights in the C++ kernel (converted in
    # registers); larger ones dequantize each layer first (one C++ pass) where the model dtype has a fast dense
    # matmul (AVX-512), else they take the kernel too
    cpu_kernel_max_rows: Annotated[int, msgspec.Meta(ge=0)] = 8


@hookimpl
def conveyor_register_quant_methods(register):
    package = "conveyor.plugins.quant"
    register(Declaration("none", NoQuantOptions, f"{package}.none:NoQuant",
                         "Weights in the model dtype; a plain matmul (on CPU against oneDNN's prepacked layout)."))
    register(Declaration("int8", Int8Options, f"{package}.int8:Int8WeightOnly",
                         "int8 weights with per-channel scales."))
    register(Declaration("int4", Int4Options, f"{package}.int4:Int4",
                         "Float weights quantized at load into Q4_1 or Q4_0 blocks; a GGUF's blocks kept as they are."))
    register(Declaration("fp8", FP8Options, f"{package}.fp8:FP8", "e4m3 weights; W8A16 or W8A8."))
    register(Declaration("gguf", NoQuantOptions, f"{package}.gguf:GGUFQuant",
                         "GGUF blocks kept packed; float weights as ``none`` keeps them."))
    register(Declaration("auto", NoQuantOptions, f"{package}.gguf:AutoQuant",
                         "The default: each weight kept as the checkpoint stores it, quantized or not."))
