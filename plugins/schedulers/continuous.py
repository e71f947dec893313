"""``continuous``: continuous batching under a token budget, with chunked prefill
and preemption by recomputation."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from conveyor.hookspecs import hookimpl
from conveyor.request import Request
from conveyor.scheduler import Scheduler, SchedulerOptions


class ContinuousOptions(SchedulerOptions, forbid_unknown_fields=True):
    # most requests running at once
    max_num_seqs: Annotated[int, msgspec.Meta(ge=1)] = 64
    # largest prefill chunk one request gets per step; 0: the whole budget
    long_prefill_token_threshold: Annotated[int, msgspec.Meta(ge=0)] = 0
    # fcfs: by arrival; priority: lower `priority` first, then by arrival
    policy: Literal["fcfs", "priority"] = "fcfs"


class ContinuousScheduler(Scheduler):
    """Continuous batching: requests join and leave the batch at every step.

    Each step takes running requests first (oldest first), then waiting ones,
    until the token budget or max_num_seqs is reached; long prompts are split
    into chunks. When KV memory runs out, the newest (or lowest-priority)
    running request is preempted: its memory is freed and it is recomputed
    later.
    """

    name = "continuous"
    Options = ContinuousOptions

    @classmethod
    def max_running(cls, options: ContinuousOptions) -> int:
        return options.max_num_seqs

    def waiting_key(self, request: Request) -> tuple:
        if self.options.policy == "priority":
            return (request.priority, request.arrival_order)
        return (request.arrival_order,)

    def pick_victim(self) -> Request | None:
        candidates = [r for r in self.running if not r.in_flight]
        if not candidates:
            return None
        if self.options.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_order))
        return candidates[-1]

    def can_admit(self, request: Request) -> bool:
        return len(self.running) < self.options.max_num_seqs

    def chunk_limit(self, budget: int) -> int:
        return min(budget, self.options.long_prefill_token_threshold or budget)


@hookimpl
def conveyor_register_schedulers(register):
    register(ContinuousScheduler)
