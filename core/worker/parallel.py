"""Where one worker stands among an engine's workers, and the collectives between them.

Workers are numbered ``rank = pp_rank * tp_size + tp_rank``: the tensor-parallel
group of a pipeline stage is a run of consecutive ranks. Collectives run on
torch.distributed (gloo on CPU, NCCL on CUDA); with one worker every method
returns its input and the process group is never created.

Each collective and each point-to-point transfer adds its time to
``comm_time``, and waiting for the previous stage's activations adds to
``wait_time``: the runner reports both per step (time in communication vs
compute, the pipeline's bubbles).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from conveyor.config import ParallelConfig


@dataclass(frozen=True)
class Placement:
    """One worker's coordinates (pure numbers: no process group needed to compute shards)."""

    rank: int = 0
    tp_size: int = 1
    pp_size: int = 1

    @classmethod
    def of(cls, config: ParallelConfig, rank: int) -> Placement:
        return cls(rank, config.tensor_parallel_size, config.pipeline_parallel_size)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def driver(self) -> bool:
        """The worker that samples: TP rank 0 of the last stage."""
        return self.last_stage and self.tp_rank == 0

    def layers(self, num_layers: int) -> range:
        """The contiguous layers of this stage; earlier stages take one more where they do not divide."""
        base, extra = divmod(num_layers, self.pp_size)
        start = self.pp_rank * base + min(self.pp_rank, extra)
        return range(start, start + base + (self.pp_rank < extra))

    def heads(self, num_heads: int) -> range:
        """This worker's query heads (they divide evenly: checked at start-up)."""
        per = num_heads // self.tp_size
        return range(self.tp_rank * per, (self.tp_rank + 1) * per)

    def kv_heads(self, num_kv_heads: int) -> range:
        """This worker's KV heads: an even share, or, with more workers than KV heads, the one its query
        heads read (each KV head copied on ``tp_size / num_kv_heads`` workers)."""
        start = self.tp_rank * num_kv_heads // self.tp_size
        return range(start, start + max(1, num_kv_heads // self.tp_size))

    def split(self, size: int) -> range:
        """This worker's part of a dimension of ``size`` that divides evenly (MLP columns)."""
        per = size // self.tp_size
        return range(self.tp_rank * per, (self.tp_rank + 1) * per)

    def vocab(self, vocab_size: int) -> tuple[range, int]:
        """This worker's rows of the embedding and the output head, and the padded rows per worker (the
        vocabulary is padded up to a multiple of ``tp_size``; padded rows are zeros)."""
        per = -(-vocab_size // self.tp_size)
        start = self.tp_rank * per
        return range(start, min(start + per, vocab_size)), per


def check_divisible(placement: Placement, num_heads: int, num_kv_heads: int, intermediate_size: int,
                    num_layers: int, expert_widths: tuple[int, ...] = ()) -> str | None:
    """Why this model cannot be split ``tp_size`` x ``pp_size`` ways (None when it can); ``expert_widths``: the
    MLP widths of a mixture's experts (and shared expert), split like the dense MLP's."""
    tp = placement.tp_size
    if num_heads % tp:
        return f"tensor_parallel_size = {tp} does not divide the model's {num_heads} attention heads"
    if num_kv_heads % tp and tp % num_kv_heads:
        return (f"tensor_parallel_size = {tp} and the model's {num_kv_heads} KV heads: one must divide the other "
                "(KV heads are split, or copied when there are fewer than workers)")
    for width in (intermediate_size, *expert_widths):
        if width % tp:
            return f"tensor_parallel_size = {tp} does not divide the model's MLP width {width}"
    if num_layers < placement.pp_size:
        return f"pipeline_parallel_size = {placement.pp_size} exceeds the model's {num_layers} layers"
    return None


class ParallelGroup:
    """This worker's process groups and the collectives the model and the runner call."""

    def __init__(self, placement: Placement = Placement(), tp_group: dist.ProcessGroup | None = None):
        self.placement = placement
        self.tp_group = tp_group
        # seconds in collectives and transfers, and waiting for the previous stage, since ``take_times``
        self.comm_time = 0.0
        self.wait_time = 0.0

    @classmethod
    def init(cls, placement: Placement, init_method: str, device: torch.device, timeout: float = 600.0) -> ParallelGroup:
        """Join the engine's torch.distributed world (every worker calls this at start-up)."""
        from datetime import timedelta

        if placement.world_size == 1:
            return cls(placement)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=placement.rank,
                                world_size=placement.world_size, timeout=timedelta(seconds=timeout))
        tp_group = None
        # every rank creates every group, in the same order (torch.distributed's rule)
        for stage in range(placement.pp_size):
            ranks = list(range(stage * placement.tp_size, (stage + 1) * placement.tp_size))
            group = dist.new_group(ranks)
            if stage == placement.pp_rank:
                tp_group = group
        return cls(placement, tp_group)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def take_times(self) -> tuple[float, float]:
        """``(comm_time, wait_time)`` since the last call."""
        times = (self.comm_time, self.wait_time)
        self.comm_time = self.wait_time = 0.0
        return times

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the tensor-parallel group, in place."""
        if self.placement.tp_size == 1:
            return x
        start = time.perf_counter()
        dist.all_reduce(x, group=self.tp_group)
        self.comm_time += time.perf_counter() - start
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Each worker's logits over its vocabulary rows -> the whole vocabulary on TP rank 0 (None elsewhere)."""
        if self.placement.tp_size == 1:
            return logits[:, :vocab_size]
        start = time.perf_counter()
        first = self.placement.rank - self.placement.tp_rank
        parts = [torch.empty_like(logits) for _ in range(self.placement.tp_size)] if self.placement.tp_rank == 0 else None
        dist.gather(logits.contiguous(), parts, dst=first, group=self.tp_group)
        self.comm_time += time.perf_counter() - start
        return torch.cat(parts, dim=-1)[:, :vocab_size] if parts is not None else None

    def send_next(self, x: torch.Tensor) -> None:
        """Hand activations to the same TP rank of the next stage."""
        start = time.perf_counter()
        dist.send(x.contiguous(), self.placement.rank + self.placement.tp_size)
        self.comm_time += time.perf_counter() - start

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Activations from the same TP rank of the previous stage (the wait for them counts as bubble)."""
        x = torch.empty(shape, dtype=dtype, device=device)
        start = time.perf_counter()
        dist.recv(x, self.placement.rank - self.placement.tp_size)
        self.wait_time += time.perf_counter() - start
        return x
