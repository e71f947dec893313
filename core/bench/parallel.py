"""What a multi-worker server's own metrics say about a run: communication vs compute, each rank's step time, and
the pipeline's bubbles, from the growth of Conveyor's histograms between a scrape before and one after the run."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client.samples import Sample

COMM = "conveyor_step_comm_seconds"
COMPUTE = "conveyor_step_compute_seconds"
WORKER = "conveyor_worker_step_seconds"
BUBBLE = "conveyor_step_bubble_fraction"


def _sums(samples: Iterable[Sample]) -> dict[tuple[str, str | None], float]:
    """(sample name, rank label or None) -> value, summed over every other label (replicas, model names)."""
    names = {f"{histogram}{suffix}" for histogram in (COMM, COMPUTE, WORKER, BUBBLE) for suffix in ("_sum", "_count")}
    sums: dict[tuple[str, str | None], float] = {}
    for sample in samples:
        if sample.name in names:
            key = (sample.name, sample.labels.get("rank"))
            sums[key] = sums.get(key, 0.0) + sample.value
    return sums


def parallel_view(before: Iterable[Sample], after: Iterable[Sample]) -> dict[str, Any] | None:
    """Means over the multi-worker steps of the run; None when there were none (one worker, or another server).

    Args:
        before, after: the server's /metrics samples at the start and at the end of the run.

    Returns:
        ``steps``; ``comm_ms`` and ``compute_ms`` (per step, mean over workers) and ``comm_share`` (comm over
        their sum); ``rank_step_ms`` (rank -> mean step time, over replicas too); ``bubble_fraction`` (mean over
        steps).
    """
    start, end = _sums(before), _sums(after)

    def growth(name: str, rank: str | None = None) -> float:
        return end.get((name, rank), 0.0) - start.get((name, rank), 0.0)

    steps = growth(f"{COMM}_count")
    if steps <= 0:
        return None
    comm = growth(f"{COMM}_sum") / steps
    compute = growth(f"{COMPUTE}_sum") / steps
    ranks = sorted({rank for name, rank in end if name == f"{WORKER}_count" and rank is not None}, key=int)
    rank_step_ms = {
        rank: 1000 * growth(f"{WORKER}_sum", rank) / count
        for rank in ranks
        if (count := growth(f"{WORKER}_count", rank)) > 0
    }
    return {
        "steps": steps,
        "comm_ms": 1000 * comm,
        "compute_ms": 1000 * compute,
        "comm_share": comm / (comm + compute) if comm + compute > 0 else 0.0,
        "rank_step_ms": rank_step_ms,
        "bubble_fraction": growth(f"{BUBBLE}_sum") / steps,
    }


def parallel_table(view: dict[str, Any]) -> str:
    """The "Parallel" section of a run's report."""
    ranks = "  ".join(f"{rank}: {ms:.1f}" for rank, ms in view["rank_step_ms"].items())
    rows = [
        ("Step comm / compute, mean (ms)",
         f"{view['comm_ms']:.2f} / {view['compute_ms']:.2f}  (comm {view['comm_share']:.1%})"),
        ("Step time by rank, mean (ms)", ranks),
        ("Pipeline bubble fraction, mean", f"{view['bubble_fraction']:.1%}"),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"Parallel (from the server, {view['steps']:.0f} steps)"]
    lines += [f"  {name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines)
