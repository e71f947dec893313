"""Attention over the paged KV cache: the tensors (storage), the backends (torch, C++ CPU, Triton CUDA)
and the choice between them."""

from __future__ import annotations

import torch

from conveyor.attention.backend import AttentionBackend, BackendUnavailable
from conveyor.attention.cpu_backend import CpuAttention
from conveyor.attention.torch_backend import TorchAttention
from conveyor.attention.triton_backend import TritonAttention

BACKENDS: dict[str, type[AttentionBackend]] = {b.name: b for b in (TorchAttention, CpuAttention, TritonAttention)}


def select_backend(name: str, device: torch.device) -> type[AttentionBackend]:
    """The backend ``[engine] attention = name`` picks on ``device``.

    "auto" is Triton on CUDA and, on a CPU, the C++ kernels where they build, torch ops otherwise.

    Raises:
        BackendUnavailable: the named backend cannot run here; the message says why.
    """
    if name == "auto":
        if device.type == "cuda":
            name = "triton"
        else:
            name = "cpu" if CpuAttention.unavailable(device) is None else "torch"
    if name not in BACKENDS:
        raise BackendUnavailable(f"attention = {name!r}: allowed: 'auto', {', '.join(map(repr, BACKENDS))}")
    reason = BACKENDS[name].unavailable(device)
    if reason is not None:
        raise BackendUnavailable(f"attention = {name!r}: {reason}")
    return BACKENDS[name]
