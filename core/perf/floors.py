"""What this machine allows, measured in the run that compares against it: read bandwidth, matmul
throughput, and the model's own linear layers at a given number of rows."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from conveyor.model.decoder_model import DecoderModel


def median_seconds(fn: Callable[[], object], repeat: int) -> float:
    """The median of ``repeat`` timed calls, after one untimed call."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def read_bandwidth() -> float:
    """Bytes per second summing a 1 GiB float32 tensor on all threads (the best of several runs)."""
    x = torch.ones(2**28, dtype=torch.float32)
    return x.nbytes / min(median_seconds(x.sum, 3) for _ in range(3))


def matmul_flops(dtype: torch.dtype = torch.bfloat16, size: int = 2048) -> float:
    """FLOP/s of one ``size``-cubed matmul in ``dtype`` on all threads."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    return 2 * size**3 / median_seconds(lambda: a @ b, 5)


def linear_flops_per_token(model: DecoderModel) -> int:
    """FLOPs of every linear layer (not the output head) for one token."""
    total = 0
    for layer in model.layers:
        hidden = model.spec.hidden_size
        total += layer.qkv.out_features * hidden + hidden * layer.q_size
        total += layer.gate_up.out_features * hidden + hidden * layer.intermediate_size
    return 2 * total


@torch.inference_mode()
def linear_seconds(model: DecoderModel, rows: int, repeat: int = 10, head: bool = True) -> float:
    """Seconds for every linear layer and (``head``) the output head over ``rows`` tokens (each layer's weights
    in turn, as a forward pass reads them)."""
    hidden = torch.randn(rows, model.spec.hidden_size, dtype=model.dtype)
    wide = torch.randn(rows, model.layers[0].intermediate_size, dtype=model.dtype)
    attended = torch.randn(rows, model.layers[0].q_size, dtype=model.dtype)

    def linears() -> None:
        for layer in model.layers:
            layer.qkv(hidden)
            layer.o_proj(attended)
            layer.gate_up(hidden)
            layer.down(wide)
        if head:
            model.compute_logits(hidden)

    return median_seconds(linears, repeat)
