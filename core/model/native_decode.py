"""Decode steps whose every layer runs in one C++ call (``conveyor.native.decode_layers``).

A step of one-token decodes on a CPU spends as long between the kernels as in
them when the model is small: Python calls, torch ops and threads woken per
kernel (core/native/csrc/decode_layers.cpp says what was measured). Where the
model is Llama's plain block (no q/k norms, sandwich norms, biases, experts,
sliding windows or soft caps) with every linear layer in a format whose quant
method multiplies it with a C++ kernel (``QuantMethod.native_weight``: GGML
blocks, fp8), on one worker with the C++ attention kernels, a float KV cache
and no LoRA, such steps go through one call instead, which runs the same
kernels in the same order and so gives the same hidden states, bit for bit.
Other steps, and other models, run layer by layer (``[engine] native_decode =
"off"`` keeps every step there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from conveyor import native
from conveyor.model import ggml
from conveyor.quant import FP8_TYPE_ID, NativeWeight

if TYPE_CHECKING:
    from conveyor.attention.backend import AttentionBackend, StepAttention
    from conveyor.model.layers import Linear
    from conveyor.model.decoder_model import DecoderModel


def _native(linear: Linear, in_features: int) -> NativeWeight | None:
    """A linear layer's weights as ``decode_layers`` multiplies them, over exactly ``in_features`` inputs; None
    where its method offers none (float weights, several parts, a bias), or a LoRA slot or batch-invariant row
    blocks change how it runs."""
    if linear.lora is not None or linear.row_block:
        return None
    native_weight = linear.method.native_weight(linear.params)
    if native_weight is None:
        return None
    weight, type_id = native_weight.weight, native_weight.type_id
    if type_id == FP8_TYPE_ID:
        inputs = weight.shape[1]
    else:  # (a repacked row may hold a zero block more, which the layer-by-layer path pads its input for)
        values, size = ggml.BLOCKS[_TYPE_NAMES[type_id]]
        inputs = weight.shape[1] // size * values
    return native_weight if inputs == in_features else None


_TYPE_NAMES = {number: name for name, number in ggml.TYPE_IDS.items()}


class NativeDecode:
    """The model's weights as ``decode_layers`` takes them, and the step it runs."""

    def __init__(self, model: DecoderModel, attention: AttentionBackend, linears: list[NativeWeight],
                 norms: list[torch.Tensor]):
        self.model = model
        self.attention = attention
        self.weights = [linear.weight for linear in linears]
        self.types = [linear.type_id for linear in linears]
        empty = torch.empty(0)
        self.scales = [empty if linear.scale is None else linear.scale for linear in linears]
        self.norms = norms
        # the most rows a step may have: where a method multiplies more rows another way (fp8 past its kernel's
        # rows), the layer-by-layer path does
        limits = [linear.max_rows for linear in linears if linear.max_rows is not None]
        self.max_rows = min(limits, default=None)

    @classmethod
    def build(cls, model: DecoderModel, attention: AttentionBackend) -> NativeDecode | None:
        """For a model and attention backend it serves; None where some part of either needs the layer-by-layer
        path."""
        spec = model.spec
        storage = attention.storage
        if (model.device.type != "cpu" or not model.options.fused or attention.name != "cpu" or not native.load()
                or model.group.placement.world_size > 1 or not (model.first_stage and model.last_stage)):
            return None
        if (spec.qk_norm or spec.sandwich_norms or spec.attention_bias or spec.activation != "silu"
                or spec.local_rope_theta or spec.attn_softcap or spec.embedding_multiplier != 1.0):
            return None
        if storage.quantized or storage.dtype != model.dtype or attention.batch_invariant:
            return None
        scale = spec.softmax_scale
        if any(layer.window or layer.softcap or layer.scale != scale for layer in attention.layers):
            return None
        linears: list[NativeWeight] = []
        norms: list[torch.Tensor] = []
        for layer in model.layers:
            if layer.moe is not None or layer.cache_index != len(norms) // 2:
                return None
            inputs = (spec.hidden_size, layer.q_size, spec.hidden_size, layer.intermediate_size)
            for linear, width in zip(layer.linears(), inputs, strict=True):
                native_weight = _native(linear, width)
                if native_weight is None:
                    return None
                linears.append(native_weight)
            norms += [layer.input_norm.weight, layer.post_norm.weight]
        norms.append(model.norm.weight)
        return cls(model, attention, linears, norms)

    def accepts(self, attention: StepAttention, num_tokens: int) -> bool:
        """Whether a step is one this call runs: decodes only, one token each."""
        if self.max_rows is not None and num_tokens > self.max_rows:
            return False
        return attention.prefill_plan is None and attention.num_decodes == num_tokens and num_tokens > 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: StepAttention) -> torch.Tensor:
        """``DecoderModel.forward`` for a step ``accepts`` took: ``[M, hidden]`` final hidden states."""
        model, storage, plan = self.model, self.attention.storage, attention.decode_plan
        cos, sin = model.rotary.tables(positions, model.dtype)
        return native.decode_layers(
            model.embed_tokens(input_ids), storage.k, storage.v, attention.slot_mapping, plan.tables,
            plan.context_lens, cos, sin, self.weights, self.types, self.scales, self.norms, model.spec.rms_norm_eps,
            model.spec.softmax_scale, storage.block_size, model.layers[0].num_heads)
