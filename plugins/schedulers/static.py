"""``static``: fixed batches run to completion; nobody joins mid-way.

The baseline continuous batching is measured against: a batch of
``batch_size`` requests starts together (or a smaller one after
``max_wait_ms``), and the next batch waits until the slowest request of the
current one has finished. Slots held by requests that already finished, or
never arrived, are counted as wasted.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections import deque
from collections.abc import Iterable
from typing import Annotated

import msgspec

from conveyor.hookspecs import hookimpl
from conveyor.kvcache import KVCache
from conveyor.messages import RequestOutput, TokenLogprob
from conveyor.request import Request, RequestStatus
from conveyor.scheduler import ScheduledBatch, Scheduler, SchedulerStats, abort_output


class StaticOptions(msgspec.Struct, forbid_unknown_fields=True):
    # requests per batch
    batch_size: Annotated[int, msgspec.Meta(ge=1)] = 16
    # start a smaller batch once the oldest waiting request has waited this long
    max_wait_ms: Annotated[float, msgspec.Meta(ge=0)] = 1000.0
    # token budget of one step; a batch's prompts are split into steps under it
    max_num_batched_tokens: Annotated[int, msgspec.Meta(ge=1)] = 8192
    # most requests waiting; more are rejected (HTTP 429)
    max_waiting: Annotated[int, msgspec.Meta(ge=1)] = 1024


class RunToCompletionScheduler(Scheduler):
    """Forms a batch from the waiting queue and runs it until every request in it is done."""

    def __init__(self, options, kvcache: KVCache, max_model_len: int):
        super().__init__(options, kvcache, max_model_len)
        self.waiting: deque[Request] = deque()
        # when each waiting request was queued, on self.clock
        self.queued_at: dict[str, float] = {}
        self.batch: list[Request] = []
        # slots the current batch occupies (wasted ones included)
        self.num_slots = 0
        self.clock = time.monotonic

    # most requests in a batch, and how long the oldest waiting request may wait for a full one
    max_batch_size: int
    max_wait_s: float

    @abstractmethod
    def slots_for(self, batch_size: int) -> int:
        """Slots a batch of this many requests occupies."""

    def batch_ready(self, now: float) -> int:
        """How many waiting requests to start a batch with now (0: keep waiting)."""
        if len(self.waiting) >= self.max_batch_size:
            return self.max_batch_size
        if self.waiting and now - self.queued_at[self.waiting[0].request_id] >= self.max_wait_s:
            return len(self.waiting)
        return 0

    def add(self, request: Request) -> None:
        self.accept(request, len(self.waiting), self.options.max_waiting)
        self.queued_at[request.request_id] = self.clock()
        self.waiting.append(request)

    def abort(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        outputs = []
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            if request.status == RequestStatus.WAITING:
                self.waiting.remove(request)
                del self.queued_at[request_id]
            self.kvcache.free(request)
            request.status = RequestStatus.FINISHED
            outputs.append(abort_output(request))
        self._close_batch_if_done()
        return outputs

    def _start_batch(self) -> None:
        take = self.batch_ready(self.clock())
        sizes: list[int] = []
        while self.waiting and len(self.batch) < take:
            # Only what fits together: a batch never runs out of memory half-way.
            if self.batch and not self.kvcache.can_fit(sizes + [self.waiting[0].max_total_tokens]):
                break
            request = self.waiting.popleft()
            del self.queued_at[request.request_id]
            request.status = RequestStatus.RUNNING
            sizes.append(request.max_total_tokens)
            self.batch.append(request)
        self.num_slots = self.slots_for(len(self.batch)) if self.batch else 0

    def schedule(self) -> ScheduledBatch:
        if not self.batch:
            self._start_batch()
        budget = self.options.max_num_batched_tokens
        scheduled: dict[Request, int] = {}
        for request in self.batch:
            if request.is_finished or budget == 0:
                continue
            prefix = self.kvcache.match_prefix(request) if request.num_computed_tokens == 0 else None
            cached = prefix.num_tokens if prefix else request.num_computed_tokens
            n = min(request.num_tokens - cached, budget)
            if not self.kvcache.allocate(request, n, prefix):
                raise RuntimeError(f"{self.name}: KV cache full inside a batch admitted as fitting")
            if prefix is not None:
                request.num_computed_tokens = request.num_cached_tokens = prefix.num_tokens
            scheduled[request] = n
            budget -= n
        if scheduled:
            self.counters.num_wasted_slots += self.num_slots - len(scheduled)
        return ScheduledBatch.of(scheduled)

    def update(
        self, batch: ScheduledBatch, sampled: list[int | None], logprobs: list[TokenLogprob | None]
    ) -> list[RequestOutput]:
        outputs, finished = self.record(batch, sampled, logprobs)
        for request in finished:
            del self.requests[request.request_id]
        self._close_batch_if_done()
        return outputs

    def _close_batch_if_done(self) -> None:
        if all(r.is_finished for r in self.batch):
            self.batch = []
            self.num_slots = 0

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> SchedulerStats:
        self.counters.num_running = sum(1 for r in self.batch if not r.is_finished)
        self.counters.num_waiting = len(self.waiting)
        return self.counters


class StaticScheduler(RunToCompletionScheduler):
    """Static batching: fixed batches of ``batch_size``, each run to completion."""

    name = "static"
    Options = StaticOptions

    def __init__(self, options: StaticOptions, kvcache: KVCache, max_model_len: int):
        super().__init__(options, kvcache, max_model_len)
        self.max_batch_size = options.batch_size
        self.max_wait_s = options.max_wait_ms / 1000

    def slots_for(self, batch_size: int) -> int:
        # the batch has batch_size slots whether or not they were filled
        return self.options.batch_size


@hookimpl
def conveyor_register_schedulers(register):
    register(StaticScheduler)
