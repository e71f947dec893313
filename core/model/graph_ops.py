"""Torch custom ops that keep the model's opaque parts whole inside a compiled graph.

``torch.compile`` traces the model's Python into one graph and fuses what it
can see. Two parts it must not look into: a linear layer (its weights are in
whatever format the quant method keeps: oneDNN's prepacked tensors, int8 with
scales, a row-major copy for one-token steps) and paged attention (the KV
cache is written in place and read through block tables by a C++ or Triton
kernel). Each is a custom op here that names its object by a number, the way
a layer is looked up by name in vLLM's compiled attention; the compiler sees
an opaque call with a known output shape, and no graph breaks.
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from conveyor.attention.backend import AttentionBackend

# number -> object, for the ops' implementations; entries go when their object does
_linears: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_backends: weakref.WeakValueDictionary[int, AttentionBackend] = weakref.WeakValueDictionary()
_numbers = itertools.count()


def register_linear(linear: Any) -> int:
    """The number ``linear_op`` knows this layer by (an object with ``out_features`` and ``apply(x)``)."""
    number = next(_numbers)
    _linears[number] = linear
    return number


def register_backend(backend: AttentionBackend) -> int:
    """The number ``paged_decode_op`` knows this attention backend by."""
    number = next(_numbers)
    _backends[number] = backend
    return number


@torch.library.custom_op("conveyor::linear", mutates_args=())
def linear_op(x: torch.Tensor, layer: int) -> torch.Tensor:
    """``linear.apply(x)`` for the layer registered as ``layer``."""
    return _linears[layer].apply(x)


@linear_op.register_fake
def _(x: torch.Tensor, layer: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], _linears[layer].out_features)


@torch.library.custom_op("conveyor::paged_decode", mutates_args=())
def paged_decode_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, layer: int, backend: int,
) -> torch.Tensor:
    """Store one new token's K, V per sequence at its slot, then attend over each sequence's cache.

    Args:
        q: ``[B, Hq, D]``; k, v: ``[B, Hkv, D]``.
        slot_mapping: ``[B]`` int64; block_tables: ``[B, max_blocks]`` int32; context_lens: ``[B]`` int32.
        layer: the layer's number in the KV storage; backend: a ``register_backend`` number.
    """
    from conveyor.attention.backend import DecodeTables  # (the attention package imports the model's formats)

    attention = _backends[backend]
    attention.storage.write(layer, slot_mapping, k, v)
    out = torch.empty_like(q)
    attention.decode(layer, q, DecodeTables(block_tables, context_lens), out)
    return out


@paged_decode_op.register_fake
def _(q, k, v, slot_mapping, block_tables, context_lens, layer, backend) -> torch.Tensor:
    return torch.empty_like(q)
