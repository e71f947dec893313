"""``static``: fixed batches run to completion; nobody joins mid-way.

The baseline continuous batching is measured against: a batch of
``batch_size`` requests starts together (or a smaller one after
``max_wait_ms``), and the next batch waits until the slowest request of the
current one has finished. Slots held by requests that already finished, or
never arrived, are counted as wasted.
"""

from __future__ import annotations

from conveyor.plugins.schedulers.declarations import BatchOptions, StaticOptions
from conveyor.request import Request, RequestStatus
from conveyor.scheduler import ScheduledBatch, Scheduler


class RunToCompletionScheduler(Scheduler):
    """Forms a batch from the waiting queue and runs it until every request in it is done."""

    # one batch at a time, also under pipeline parallelism
    pipelined = False

    # most requests in a batch, and how long the oldest waiting request may wait for a full one
    max_batch_size: int
    max_wait_s: float

    def __init__(self, options: BatchOptions, kvcache, max_model_len: int):
        super().__init__(options, kvcache, max_model_len)
        # members of the current batch not started yet (still in the waiting queue)
        self.pending: list[Request] = []
        # slots the current batch occupies (wasted ones included)
        self.num_slots = 0

    def slots_for(self, batch_size: int) -> int:
        """Slots a batch of this many requests occupies."""
        return batch_size

    def batch_ready(self, now: float) -> int:
        """How many waiting requests to start a batch with now (0: keep waiting)."""
        if len(self.waiting) >= self.max_batch_size:
            return self.max_batch_size
        if self.waiting and now - self.waiting.peek().queued_at >= self.max_wait_s:
            return len(self.waiting)
        return 0

    def _start_batch(self) -> None:
        take = self.batch_ready(self.clock())
        sizes: list[int] = []
        for request in self.waiting:
            # Only what fits together: a batch never runs out of memory half-way.
            if len(self.pending) == take or (self.pending and not self.kvcache.can_fit(sizes + [request.max_total_tokens])):
                break
            sizes.append(request.max_total_tokens)
            self.pending.append(request)
        self.num_slots = self.slots_for(len(self.pending)) if self.pending else 0

    def schedule(self) -> ScheduledBatch:
        self.pending = [r for r in self.pending if not r.is_finished]  # aborted before they started
        if not self.running and not self.pending:
            self._start_batch()
        budget = self.options.max_num_batched_tokens
        scheduled: dict[Request, int] = {}
        for request in self.running:
            if budget == 0:
                break
            n = min(request.num_uncomputed_tokens, budget)
            if not self.kvcache.allocate(request, n):
                raise RuntimeError(f"{self.name}: KV cache full inside a batch admitted as fitting")
            scheduled[request] = n
            budget -= n
        for request in list(self.pending):
            if budget == 0:
                break
            # (one held at a gate, a KV connector fetching its prefix, is admitted once it is released; one the
            # engine preempted, whose loaded blocks failed, like a new one)
            queued = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            n = self.admit(request, budget) if request.status in queued else 0
            if not n:
                if request.status not in queued:
                    continue
                raise RuntimeError(f"{self.name}: KV cache full inside a batch admitted as fitting")
            self.pending.remove(request)
            scheduled[request] = n
            budget -= n
        if scheduled:
            self.counters.num_wasted_slots += self.num_slots - len(scheduled)
        return ScheduledBatch.of(scheduled)


class StaticScheduler(RunToCompletionScheduler):
    """Static batching: fixed batches of ``batch_size``, each run to completion."""

    name = "static"
    Options = StaticOptions

    @classmethod
    def max_running(cls, options: StaticOptions) -> int:
        return options.batch_size

    def __init__(self, options: StaticOptions, kvcache, max_model_len: int):
        super().__init__(options, kvcache, max_model_len)
        self.max_batch_size = options.batch_size
        self.max_wait_s = options.max_wait_ms / 1000

    def slots_for(self, batch_size: int) -> int:
        # the batch has batch_size slots whether or not they were filled
        return self.options.batch_size
