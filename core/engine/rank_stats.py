"""What the workers of a multi-worker step report, in its stats: each rank's busy, communication and waiting
time, the pipeline's bubble, and the collectives."""

from __future__ import annotations

from conveyor.messages import RankTimes, StepStats


def add_rank_stats(stats: StepStats, ranks: list[RankTimes]) -> None:
    """Fill ``stats``' per-rank fields from every worker's times (``RunnerOutput.ranks``; none with one worker)."""
    if not ranks:
        return
    stats.rank_times = [r.busy for r in ranks]
    stats.comm_time = sum(r.comm for r in ranks) / len(ranks)
    busy = sum(r.busy for r in ranks)
    stats.bubble_fraction = sum(r.wait for r in ranks) / busy if busy else 0.0
    stats.rank_comm = [r.comm for r in ranks]
    stats.rank_wait = [r.wait for r in ranks]
    stats.num_collectives = sum(r.num_collectives for r in ranks) / len(ranks)
    stats.collective_bytes = sum(r.collective_bytes for r in ranks) / len(ranks)
