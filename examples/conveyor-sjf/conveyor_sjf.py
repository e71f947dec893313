"""Shortest-prompt-first scheduling for Conveyor, written from ``conveyor.scheduler.Scheduler`` alone.

The base class does the mechanics: admission control, the waiting queue,
continuous batching under the token budget with chunked prefill, preemption
when KV memory runs out, aborts, and recording tokens. This scheduler only
decides order and limits: the waiting queue is ordered by prompt length, so
short requests overtake long ones (lower mean latency when prompt lengths
vary a lot, at the risk of delaying long prompts under sustained load), and
when memory runs out the running request holding the most tokens gives way.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from conveyor.hookspecs import hookimpl
from conveyor.scheduler import Scheduler, SchedulerOptions


class SJFOptions(SchedulerOptions, forbid_unknown_fields=True):
    # most requests running at once
    max_num_seqs: Annotated[int, msgspec.Meta(ge=1)] = 64


class ShortestPromptFirst(Scheduler):
    """Continuous batching that admits the shortest waiting prompt first."""

    name = "sjf"
    Options = SJFOptions

    def waiting_key(self, request):
        # Preempted requests keep their place by the same rule: the key is taken
        # each time a request enters the queue.
        return (request.num_prompt_tokens, request.arrival_order)

    def pick_victim(self):
        # requests in a step still running on the workers (pipeline parallelism) cannot give memory back
        candidates = [r for r in self.running if not r.in_flight]
        return max(candidates, key=lambda r: (r.num_tokens, r.arrival_order), default=None)

    def can_admit(self, request):
        return len(self.running) < self.options.max_num_seqs


@hookimpl
def conveyor_register_schedulers(register):
    register(ShortestPromptFirst)
