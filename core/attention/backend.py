"""The attention backend interface, and the attention function of one step.

A backend computes attention over the paged KV cache (``KVStorage``): for
single-token decodes (``decode``) and for prompt chunks, causally over what
their sequence has cached (``prefill``). Each writes into an ``out`` tensor
it is given. The worker's runner chooses one backend at start-up from
``[engine] attention``; per step it builds a ``StepAttention``, which plans
both parts once (block tables as tensors) and, in every layer, stores the new
K and V through the slot mapping before calling the backend.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from conveyor.attention.storage import KVStorage
from conveyor.messages import StepInput
from conveyor.model.spec import LayerAttention


class BackendUnavailable(ValueError):
    """The chosen attention backend cannot run on this machine; the message says why."""


class AttentionBackend(ABC):
    """Attention over the paged KV cache; one instance per worker."""

    name: ClassVar[str]
    # the model's norms, rotary embedding and SwiGLU run in the C++ CPU kernels alongside this backend
    fused_layers: ClassVar[bool] = False
    # ``decode`` takes a ``DecodeTables`` plan (block tables and context lengths as tensors), so a compiled
    # decode graph can hold it with its inputs in buffers written in place
    decode_tables: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def unavailable(cls, device: torch.device) -> str | None:
        """Why this backend cannot run on ``device`` here, or None when it can."""

    def __init__(self, storage: KVStorage, layers: Sequence[LayerAttention] | None = None,
                 batch_invariant: bool = False):
        """
        Args:
            layers: how each layer of the storage attends, from the first (the rest, or all by default: at
                ``head_dim ** -0.5``, no window, no cap).
            batch_invariant: every token of a step attends as a decode does, and a query's arithmetic does not
                depend on the other queries of its step (``[engine] batch_invariant``).
        """
        self.storage = storage
        self.batch_invariant = batch_invariant
        spec = storage.layout.spec
        layers = list(layers or [])
        if len(layers) > spec.num_layers:
            raise ValueError(f"{len(layers)} layers' attention given for a KV cache of {spec.num_layers} layers")
        # (a pipeline stage with fewer layers than the first leaves the cache's last ones unused)
        self.layers = layers + [LayerAttention(spec.head_dim**-0.5)] * (spec.num_layers - len(layers))

    @abstractmethod
    def plan_decodes(self, tables: list[list[int]], context_lens: list[int]) -> Any:
        """What ``decode`` needs for this step's decodes.

        Args:
            tables: each decode's block ids.
            context_lens: each decode's keys, its new token included.
        """

    @abstractmethod
    def plan_prefills(self, tables: list[list[int]], starts: list[int], lens: list[int], first_row: int) -> Any:
        """What ``prefill`` needs for this step's prompt chunks.

        Args:
            tables: each chunk's block ids.
            starts: position of each chunk's first token (tokens before it are cached).
            lens: tokens in each chunk.
            first_row: row of the first chunk in q (chunks follow the decodes, back to back).
        """

    @abstractmethod
    def decode(self, layer: int, q: torch.Tensor, plan: Any, out: torch.Tensor) -> None:
        """One query per decode over its cached keys: ``q``, ``out`` are ``[decodes, Hq, D]``. With
        ``batch_invariant``, each query's result must not depend on the others (no split of its keys chosen by
        the batch size, no padding to another query's length)."""

    @abstractmethod
    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Any,
                out: torch.Tensor) -> None:
        """Causal attention of each chunk over its sequence so far.

        Args:
            q, out: every row of the step ``[T, Hq, D]``; only the chunks' rows are written.
            k, v: the step's new keys and values ``[T, Hkv, D]`` (already in the cache too).
        """


class StepAttention:
    """The attention function of one forward pass: ``attention(layer, q, k, v) -> out``.

    A batch-invariant backend gets every token as a decode (a prompt chunk's token at position p attends over
    the p + 1 keys cached by then, its own stored first): a token's attention is then the same arithmetic
    whether it decodes alone, in a batch, or sits anywhere in a prompt chunk of any length.
    """

    def __init__(self, backend: AttentionBackend, step: StepInput):
        self.backend = backend
        self.storage = backend.storage
        slots = slot_mapping(step, self.storage.block_size)
        self.slot_mapping = torch.tensor(slots, dtype=torch.long, device=self.storage.device)
        if backend.batch_invariant:
            self.num_decodes = len(slots)
            self.decode_plan = backend.plan_decodes(
                [r.block_ids for r in step.requests for _ in r.token_ids],
                [p + 1 for r in step.requests for p in range(r.start, r.start + len(r.token_ids))],
            ) if slots else None
            self.prefill_plan = None
            return
        self.num_decodes = step.num_decodes
        decodes, chunks = step.requests[: step.num_decodes], step.requests[step.num_decodes :]
        self.decode_plan = None
        if decodes:
            self.decode_plan = backend.plan_decodes([r.block_ids for r in decodes], [r.start + 1 for r in decodes])
        self.prefill_plan = None
        if chunks:
            self.prefill_plan = backend.plan_prefills(
                [r.block_ids for r in chunks], [r.start for r in chunks], [len(r.token_ids) for r in chunks],
                step.num_decodes,
            )

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.storage.write(layer, self.slot_mapping, k, v)
        out = torch.empty_like(q)
        if self.decode_plan is not None:
            n = self.num_decodes
            self.backend.decode(layer, q[:n], self.decode_plan, out[:n])
        if self.prefill_plan is not None:
            self.backend.prefill(layer, q, k, v, self.prefill_plan, out)
        return out


def slot_mapping(step: StepInput, block_size: int) -> list[int]:
    """The KV cache slot of every token the step computes, in order: its block's id * block_size + its offset
    (the one place slots are made: the eager step and the compiled decode graphs take them from here)."""
    slots: list[int] = []
    for r in step.requests:
        table = r.block_ids
        slots.extend(table[p // block_size] * block_size + p % block_size
                     for p in range(r.start, r.start + len(r.token_ids)))
    return slots


def padded_int32(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """Block tables as one int32 tensor, each row padded with block 0 (never read past its length)."""
    width = max(len(t) for t in rows)
    return torch.tensor([t + [0] * (width - len(t)) for t in rows], dtype=torch.int32, device=device)


@dataclass
class DecodeTables:
    """Decodes as kernels over block tables take them."""

    # [B, max_blocks] int32
    tables: torch.Tensor
    # [B] int32, keys per sequence
    context_lens: torch.Tensor

    @classmethod
    def build(cls, tables: list[list[int]], context_lens: list[int], device: torch.device) -> DecodeTables:
        return cls(padded_int32(tables, device), torch.tensor(context_lens, dtype=torch.int32, device=device))


@dataclass
class PrefillTables:
    """Prompt chunks as kernels over block tables take them: ``[S]`` int32 each, and the longest chunk."""

    tables: torch.Tensor
    rows: torch.Tensor
    lens: torch.Tensor
    starts: torch.Tensor
    max_len: int

    @classmethod
    def build(cls, tables: list[list[int]], starts: list[int], lens: list[int], first_row: int,
              device: torch.device) -> PrefillTables:
        rows = list(itertools.accumulate(lens[:-1], initial=first_row))

        def int32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        return cls(padded_int32(tables, device), int32(rows), int32(lens), int32(starts), max(lens))
