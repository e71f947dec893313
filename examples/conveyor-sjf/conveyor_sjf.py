"""Shortest-prompt-first scheduling for Conveyor.

Continuous batching as in the built-in ``continuous`` scheduler, with the
same options, but the waiting queue is ordered by prompt length: short
requests overtake long ones. That lowers mean latency when prompt lengths
vary a lot, at the risk of delaying long prompts under sustained load.
"""

from __future__ import annotations

from conveyor.hookspecs import hookimpl
from conveyor.plugins.schedulers.continuous import ContinuousOptions, ContinuousScheduler


class ShortestPromptFirst(ContinuousScheduler):
    """Continuous batching that admits the shortest waiting prompt first."""

    name = "sjf"
    Options = ContinuousOptions

    def waiting_key(self, request):
        # Preempted requests keep their place by the same rule: the key is
        # computed each time a request enters the queue.
        return (request.num_prompt_tokens, request.arrival_order)


@hookimpl
def conveyor_register_schedulers(register):
    register(ShortestPromptFirst)
