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

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from conveyor.attention.storage import KVStorage
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

    @property
    def prefills_as_decodes(self) -> bool:
        """Every token of a step goes to ``decode`` as a row of its own (a prompt chunk's token at position p
        over the p + 1 keys cached by then), to ``prefill`` none: in batch-invariant mode, or where the decode
        kernel is the faster way to compute prompt chunks (the C++ backend measures it)."""
        return self.batch_invariant

    def plan_decodes(self, tables: DecodeTables) -> Any:
        """What ``decode`` needs for this step's decodes (default: their tables, as kernels over block tables
        take them; called once a step, before the layers)."""
        return tables

    def plan_prefills(self, tables: PrefillTables) -> Any:
        """What ``prefill`` needs for this step's prompt chunks (default: their tables; once a step)."""
        return tables

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

    A backend with ``prefills_as_decodes`` gets every token as a decode (a prompt chunk's token at position p
    attends over the p + 1 keys cached by then, its own stored first): a token's attention is then the same
    arithmetic whether it decodes alone, in a batch, or sits anywhere in a prompt chunk of any length, and a step
    of prompt chunks can run where steps of decodes do (on a CPU, every layer in one C++ call). The runner's
    ``InputBuffers`` (conveyor.worker.inputs) build its tensors.
    """

    def __init__(self, backend: AttentionBackend, slot_mapping: torch.Tensor, decodes: DecodeTables | None,
                 prefills: PrefillTables | None):
        """
        Args:
            slot_mapping: ``[T]`` the KV cache slot of every token the step computes, in order.
            decodes: the decodes' tables (the first rows), None without any.
            prefills: the prompt chunks' tables (the rows after the decodes), None without any.
        """
        self.backend = backend
        self.storage = backend.storage
        self.slot_mapping = slot_mapping
        self.num_decodes = 0 if decodes is None else decodes.context_lens.shape[0]
        self.decode_plan = None if decodes is None else backend.plan_decodes(decodes)
        self.prefill_plan = None if prefills is None else backend.plan_prefills(prefills)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.storage.write(layer, self.slot_mapping, k, v)
        out = torch.empty_like(q)
        if self.decode_plan is not None:
            n = self.num_decodes
            self.backend.decode(layer, q[:n], self.decode_plan, out[:n])
        if self.prefill_plan is not None:
            self.backend.prefill(layer, q, k, v, self.prefill_plan, out)
        return out


@dataclass
class DecodeTables:
    """Decodes as kernels over block tables take them (a row's entries past its context are any blocks)."""

    # [B, max_blocks] int32, contiguous
    tables: torch.Tensor
    # [B] int32, keys per sequence
    context_lens: torch.Tensor


@dataclass
class PrefillTables:
    """Prompt chunks as kernels over block tables take them: ``[S]`` int32 each, and the longest chunk."""

    # [S, max_blocks] int32, contiguous
    tables: torch.Tensor
    # each chunk's first row in the step's q
    rows: torch.Tensor
    lens: torch.Tensor
    starts: torch.Tensor
    max_len: int
