"""Where one worker stands among an engine's workers, and the collectives between them.

Workers are numbered ``rank = pp_rank * tp_size + tp_rank``: the tensor-parallel
group of a pipeline stage is a run of consecutive ranks. Collectives run on
torch.distributed (gloo on CPU, NCCL on CUDA); with one worker every method
returns its input and the process group is never created.

Each collective and each point-to-point transfer adds its time to
``comm_time``, and waiting for the previous stage's activations adds to
``wait_time``; collectives are counted with their bytes: the runner reports
all of it per step (time in communication vs compute, the pipeline's
bubbles). On CUDA the times come from CUDA events around each call (NCCL
returns once the work is queued), read once the step is done.
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
    """Why this model cannot be split ``tp_size`` x ``pp_size`` ways, with the tensor-parallel sizes that can
    (None when it can); ``expert_widths``: the MLP widths of a mixture's experts (and shared expert), split like
    the dense MLP's."""
    problem = _split_problem(placement.tp_size, placement.pp_size, num_heads, num_kv_heads, intermediate_size,
                             num_layers, expert_widths)
    if problem is None or not problem.startswith("tensor"):
        return problem
    sizes = [tp for tp in range(1, num_heads + 1) if _split_problem(
        tp, 1, num_heads, num_kv_heads, intermediate_size, num_layers, expert_widths) is None]
    return f"{problem}; allowed: tensor_parallel_size = {' | '.join(map(str, sizes))}"


def _split_problem(tp: int, pp: int, num_heads: int, num_kv_heads: int, intermediate_size: int,
                   num_layers: int, expert_widths: tuple[int, ...]) -> str | None:
    if num_heads % tp:
        return f"tensor_parallel_size = {tp} does not divide the model's {num_heads} attention heads"
    if num_kv_heads % tp and tp % num_kv_heads:
        return (f"tensor_parallel_size = {tp} and the model's {num_kv_heads} KV heads: one must divide the other "
                "(KV heads are split, or copied when there are fewer than workers)")
    for width in (intermediate_size, *expert_widths):
        if width % tp:
            return f"tensor_parallel_size = {tp} does not divide the model's MLP width {width}"
    if num_layers < pp:
        return f"pipeline_parallel_size = {pp} exceeds the model's {num_layers} layers"
    return None


@dataclass
class CommCounts:
    """One worker's communication since the last ``ParallelGroup.take_counts``."""

    # seconds in collectives and transfers; waiting for the previous stage's activations
    comm_time: float = 0.0
    wait_time: float = 0.0
    # all-reduces and gathers within the tensor-parallel group, and the bytes this worker sent in them
    num_collectives: int = 0
    collective_bytes: int = 0


class ParallelGroup:
    """This worker's process groups and the collectives the model and the runner call."""

    def __init__(self, placement: Placement = Placement(), tp_group: dist.ProcessGroup | None = None,
                 cuda: bool = False):
        self.placement = placement
        self.tp_group = tp_group
        self.counts = CommCounts()
        # on CUDA a collective returns once queued: its time is read from CUDA events around it, once the
        # step is done (("comm" | "wait", start event, end event))
        self.cuda = cuda
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

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
        return cls(placement, tp_group, cuda=device.type == "cuda")

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def take_counts(self) -> CommCounts:
        """This worker's communication since the last call (on CUDA: once the events it timed are done)."""
        counts = self.counts
        for kind, start, end in self._events:
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
            if kind == "wait":
                counts.wait_time += seconds
            else:
                counts.comm_time += seconds
        self._events.clear()
        self.counts = CommCounts()
        return counts

    def _time(self, kind: str, call) -> None:
        """Run ``call`` (a collective or a transfer) and add its time to ``kind`` ("comm" or "wait")."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            self._events.append((kind, start, end))
            return
        began = time.perf_counter()
        call()
        seconds = time.perf_counter() - began
        if kind == "wait":
            self.counts.wait_time += seconds
        else:
            self.counts.comm_time += seconds

    def _collective(self, x: torch.Tensor, call) -> None:
        self.counts.num_collectives += 1
        self.counts.collective_bytes += x.numel() * x.element_size()
        self._time("comm", call)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the tensor-parallel group, in place."""
        if self.placement.tp_size == 1:
            return x
        self._collective(x, lambda: dist.all_reduce(x, group=self.tp_group))
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Each worker's logits over its vocabulary rows -> the whole vocabulary on TP rank 0 (None elsewhere)."""
        if self.placement.tp_size == 1:
            return logits[:, :vocab_size]
        first = self.placement.rank - self.placement.tp_rank
        parts = [torch.empty_like(logits) for _ in range(self.placement.tp_size)] if self.placement.tp_rank == 0 else None
        logits = logits.contiguous()
        self._collective(logits, lambda: dist.gather(logits, parts, dst=first, group=self.tp_group))
        return torch.cat(parts, dim=-1)[:, :vocab_size] if parts is not None else None

    def broadcast_tokens(self, tokens: list[int]) -> list[int]:
        """The TP group's rank 0's ``tokens`` on every rank of the group (each passes a list of the same length;
        only rank 0's values count): async scheduling feeds a step the tokens its driver sampled."""
        if self.placement.tp_size == 1 or not tokens:
            return tokens
        x = torch.tensor(tokens, dtype=torch.long, device="cuda" if self.cuda else "cpu")  # (NCCL: the current GPU)
        first = self.placement.rank - self.placement.tp_rank
        self._collective(x, lambda: dist.broadcast(x, src=first, group=self.tp_group))
        return x.tolist()

    def send_next(self, x: torch.Tensor) -> None:
        """Hand activations to the same TP rank of the next stage."""
        x = x.contiguous()
        self._time("comm", lambda: dist.send(x, self.placement.rank + self.placement.tp_size))

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Activations from the same TP rank of the previous stage (the wait for them counts as bubble)."""
        x = torch.empty(shape, dtype=dtype, device=device)
        self._time("wait", lambda: dist.recv(x, self.placement.rank - self.placement.tp_size))
        return x
