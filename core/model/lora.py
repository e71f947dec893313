"""LoRA adapters (PEFT's format) on the decoder's projections, many adapters in one batch.

An adapter adds ``scale * B @ A`` (rank r) to some of the base model's
projections: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``,
``up_proj``, ``down_proj``. The base weights never change, so requests for
different adapters (and for none) share a step: each projection computes its
base output for the whole batch, then adds every adapter's low-rank term to
its own tokens' rows.

Each projection that an adapter may touch holds ``max_loras`` slots of A and
B, stacked (``[slots, R, in]`` and ``[slots, out, R]``), allocated when the
model loads so that the KV cache is sized after them. A projection fused from
several (Q|K|V, gate|up) gives each part its own ``max_lora_rank`` columns of
R; its B is block diagonal. The scale is folded into B. Under tensor
parallelism each worker keeps A's input columns and B's output rows that
match its share of the base weight, and the row-parallel sums are
all-reduced with the base output.

On a CPU the low-rank terms run as two matmuls per projection: with every
token under one adapter, through that adapter's A and B; in a mixed batch,
through the A and B of every slot present side by side, each token's rank
columns of the other slots masked to zero (so the work grows with the
adapters in the step, not the number of ops). On CUDA they run as two Triton
kernels over all tokens at once (``conveyor.model.lora_kernels``), each
token reading its own slot.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from conveyor.model.lora_config import WEIGHTS_FILE, read_adapter_config

if TYPE_CHECKING:
    from conveyor.model.layers import Linear
    from conveyor.model.decoder_model import DecoderModel

# Hugging Face module name -> the decoder's projection and which of its parts (rank block) it is
MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0),
}
# steps of up to this many tokens take the float32 copies on a CPU (see LoraLinear)
SMALL_STEP = 16
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight$")


def read_adapter_weights(path: str | Path) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """``(layer, module) -> (A [r, in], B [out, r])`` from the adapter's safetensors file.

    Raises:
        ValueError: a tensor Conveyor cannot place (embeddings, the output head, experts), or an A without its B.
    """
    from safetensors.torch import load_file

    tensors = load_file(Path(path) / WEIGHTS_FILE)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None or match.group(3) not in MODULES:
            raise ValueError(f"{path}: {key}: adapters on {', '.join(MODULES)} of the decoder layers are supported")
        pairs.setdefault((int(match.group(1)), match.group(3)), {})[match.group(4)] = tensor
    weights = {}
    for (layer, module), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{path}: layer {layer} {module} has lora_{''.join(pair)} without its pair")
        weights[layer, module] = (pair["A"], pair["B"])
    return weights


@dataclass(frozen=True)
class LoraPart:
    """One Hugging Face module inside one of the decoder's projections, on this worker."""

    # its rank block in the projection (0 unless fused: q, k, v = 0, 1, 2; gate, up = 0, 1)
    block: int
    # the module's output rows this worker keeps, and where they start in the projection's output
    rows: slice
    offset: int


class LoraBatch:
    """Which tokens of the step run under which adapter slot (set by the runner before each forward pass)."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        # whether any token runs under an adapter
        self.active = False
        # every token under this one slot; else None
        self.slot: int | None = None
        # mixed batches (some tokens under other adapters or none): the slots present (a slice where they are
        # consecutive, so the weights are views), and per token a one-hot row over them (zeros: the base model)
        self.slots: slice | torch.Tensor = slice(0)
        self.mask: torch.Tensor | None = None
        # on CUDA, every token's slot (-1: none) for the kernels
        self.token_slots: torch.Tensor | None = None


class LoraLinear:
    """Every slot's A and B for one projection, and the low-rank term they add."""

    def __init__(self, parts: dict[str, LoraPart], in_features: int, out_features: int, inputs: slice | None,
                 num_slots: int, max_rank: int, batch: LoraBatch, dtype: torch.dtype, device: torch.device):
        """
        Args:
            inputs: the input columns this worker keeps (a row-parallel projection), or None for all.
        """
        self.parts = parts
        self.inputs = inputs
        self.max_rank = max_rank
        self.batch = batch
        width = max_rank * (1 + max(part.block for part in parts.values()))
        # A [slots, R, in]; B [out, slots, R], so that any run of consecutive slots is a [out, slots * R] view
        self.a = torch.zeros(num_slots, width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(out_features, num_slots, width, dtype=dtype, device=device)
        # on a CPU with 16-bit weights, float32 copies for steps of few tokens: there a bf16 matmul this small
        # takes about 5x as long as a float32 one (oneDNN's fixed cost), while from about 32 rows bf16 wins
        self.a32 = self.b32 = None
        if device.type == "cpu" and dtype != torch.float32:
            self.a32, self.b32 = self.a.float(), self.b.float()

    def set(self, slot: int, module: str, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        """Write one module's ``A [r, in]`` and ``B [out, r]`` into a slot (this worker's share of them)."""
        part = self.parts[module]
        rank = a.shape[0]
        columns = slice(part.block * self.max_rank, part.block * self.max_rank + rank)
        if self.inputs is not None:
            a = a[:, self.inputs]
        b = b[part.rows]
        if a.shape[1] != self.a.shape[2] or b.shape[0] + part.offset > self.b.shape[0]:
            raise ValueError(f"{module}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit this model's layer")
        rows = slice(part.offset, part.offset + b.shape[0])
        for a_all, b_all in self.copies():
            a_all[slot, columns] = a.to(a_all.dtype)
            b_all[rows, slot, columns] = (b.double() * scale).to(b_all.dtype)

    def clear(self, slot: int) -> None:
        for a_all, b_all in self.copies():
            a_all[slot].zero_()
            b_all[:, slot].zero_()

    def copies(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(A, B) as the model runs them, and their float32 copies where kept."""
        return [(self.a, self.b)] + ([(self.a32, self.b32)] if self.a32 is not None else [])

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base output for ``x``) plus each token's adapter term, in place."""
        batch = self.batch
        if batch.token_slots is not None:
            from conveyor.model.lora_kernels import lora_add

            lora_add(x, y, self.a, self.b.permute(1, 0, 2), batch.token_slots)
            return y
        a_all, b_all = self.a, self.b
        if self.a32 is not None and x.shape[0] <= SMALL_STEP:
            a_all, b_all, x = self.a32, self.b32, x.float()
        if batch.slot is not None:
            return y.add_((x @ a_all[batch.slot].T) @ b_all[:, batch.slot].T)
        # one pass over every slot present: each token's rank columns of the others are masked to zero
        a, b = a_all[batch.slots], b_all[:, batch.slots]
        v = x @ a.flatten(0, 1).T
        v.view(x.shape[0], batch.mask.shape[1], -1).mul_(batch.mask[:, :, None])
        return y.add_(v @ b.flatten(1, 2).T)


@dataclass(frozen=True)
class LoraTarget:
    """A projection of one decoder layer that adapters may change, before its slots exist."""

    linear: Linear
    parts: dict[str, LoraPart]
    in_features: int
    inputs: slice | None


class Adapters:
    """The slots of every adaptable projection of a worker's model, and the step's batch of adapter tokens."""

    def __init__(self, model: DecoderModel, num_slots: int, max_rank: int):
        self.model = model
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.batch = LoraBatch()
        self.kernels = model.device.type == "cuda"
        # (checkpoint layer, Hugging Face module) -> its projection's slots
        self.modules: dict[tuple[int, str], LoraLinear] = {}
        self.linears: list[LoraLinear] = []
        for layer in model.layers:
            for target in layer.lora_targets():
                lora = LoraLinear(target.parts, target.in_features, target.linear.out_features, target.inputs,
                                  num_slots, max_rank, self.batch, model.dtype, model.device)
                target.linear.lora = lora
                self.linears.append(lora)
                for module in target.parts:
                    self.modules[layer.index, module] = lora

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for lora in self.linears for pair in lora.copies() for t in pair)

    def load(self, slot: int, path: str) -> None:
        """Put the adapter at ``path`` in ``slot`` (replacing what was there).

        Raises:
            ValueError: it does not fit this model (the slot is left empty).
        """
        config = read_adapter_config(path, self.max_rank)
        weights = read_adapter_weights(path)
        for lora in self.linears:
            lora.clear(slot)
        num_layers = self.model.spec.num_layers
        try:
            for (layer, module), (a, b) in weights.items():
                if layer >= num_layers:
                    raise ValueError(f"layer {layer}: the model has {num_layers} layers")
                if a.shape[0] != config.rank or b.shape[1] != config.rank:
                    raise ValueError(f"layer {layer} {module}: rank {a.shape[0]}, but r = {config.rank}")
                lora = self.modules.get((layer, module))
                if lora is None:
                    if not any(key[0] == layer for key in self.modules):
                        continue  # another pipeline stage's layer
                    raise ValueError(f"layer {layer} {module}: a mixture-of-experts MLP takes no adapter")
                lora.set(slot, module, a, b, config.scale)
        except ValueError as e:
            for lora in self.linears:
                lora.clear(slot)
            raise ValueError(f"{path}: {e}") from None

    def prepare(self, token_slots: list[tuple[int, int]]) -> None:
        """Set the step's adapter tokens from ``(slot or -1, tokens)`` per request, in the batch's order."""
        batch = self.batch
        batch.clear()
        present = sorted({slot for slot, _ in token_slots if slot >= 0})
        if not present:
            return
        batch.active = True
        device = self.model.device
        if self.kernels:
            per_token = [slot for slot, n in token_slots for _ in range(n)]
            batch.token_slots = torch.tensor(per_token, dtype=torch.int32, device=device)
        elif len(present) == 1 and all(slot >= 0 for slot, _ in token_slots):
            batch.slot = present[0]
        else:
            consecutive = present[-1] - present[0] + 1 == len(present)
            batch.slots = (slice(present[0], present[-1] + 1) if consecutive
                           else torch.tensor(present, device=device))
            column = {slot: i for i, slot in enumerate(present)}
            rows = [column.get(slot, -1) for slot, n in token_slots for _ in range(n)]
            batch.mask = torch.zeros(len(rows), len(present) + 1, device=device)  # (float32: exact 0/1 for any v)
            batch.mask[torch.arange(len(rows)), torch.tensor(rows)] = 1  # (-1: the spare last column)
            batch.mask = batch.mask[:, :-1]
