"""``continuous``: continuous batching under a token budget, with chunked prefill
and preemption by recomputation."""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import Annotated, Literal

import msgspec

from conveyor.hookspecs import hookimpl
from conveyor.kvcache import KVCache
from conveyor.messages import RequestOutput, TokenLogprob
from conveyor.request import Request, RequestStatus
from conveyor.scheduler import ScheduledBatch, Scheduler, SchedulerStats, abort_output


class ContinuousOptions(msgspec.Struct, forbid_unknown_fields=True):
    # most requests running at once
    max_num_seqs: Annotated[int, msgspec.Meta(ge=1)] = 64
    # token budget of one step (prefill chunks + decodes)
    max_num_batched_tokens: Annotated[int, msgspec.Meta(ge=1)] = 512
    # largest prefill chunk one request gets per step; 0: the whole budget
    long_prefill_token_threshold: Annotated[int, msgspec.Meta(ge=0)] = 0
    # most requests waiting; more are rejected (HTTP 429)
    max_waiting: Annotated[int, msgspec.Meta(ge=1)] = 1024
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

    def __init__(self, options: ContinuousOptions, kvcache: KVCache, max_model_len: int):
        super().__init__(options, kvcache, max_model_len)
        # heap of (waiting_key(request), request)
        self.waiting: list[tuple[tuple, Request]] = []
        # in admission order
        self.running: list[Request] = []

    def waiting_key(self, request: Request) -> tuple:
        """Order of the waiting queue; smaller runs first. Subclasses may change it."""
        if self.options.policy == "priority":
            return (request.priority, request.arrival_order)
        return (request.arrival_order,)

    def add(self, request: Request) -> None:
        self.accept(request, len(self.waiting), self.options.max_waiting)
        heapq.heappush(self.waiting, (self.waiting_key(request), request))

    def abort(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        outputs = []
        removed_waiting = False
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                removed_waiting = True
            self.kvcache.free(request)
            request.status = RequestStatus.FINISHED
            outputs.append(abort_output(request))
        if removed_waiting:
            self.waiting = [entry for entry in self.waiting if not entry[1].is_finished]
            heapq.heapify(self.waiting)
        return outputs

    def schedule(self) -> ScheduledBatch:
        budget = self.options.max_num_batched_tokens
        chunk_cap = self.options.long_prefill_token_threshold or budget
        scheduled: dict[Request, int] = {}
        preempted = False
        for request in list(self.running):
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            n = min(request.num_tokens - request.num_computed_tokens, budget, chunk_cap)
            while not self.kvcache.allocate(request, n):
                victim = self.pick_victim()
                self.preempt(victim)
                preempted = True
                if victim in scheduled:
                    budget += scheduled.pop(victim)
                if victim is request:
                    break
            else:
                scheduled[request] = n
                budget -= n
        # Admitting new work while memory is short would only cause more preemption.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.options.max_num_seqs:
            request = self.waiting[0][1]
            prefix = self.kvcache.match_prefix(request)
            n = min(request.num_tokens - prefix.num_tokens, budget, chunk_cap)
            if not self.kvcache.allocate(request, n, prefix):
                break
            heapq.heappop(self.waiting)
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = prefix.num_tokens
            request.num_computed_tokens = prefix.num_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled[request] = n
            budget -= n
        return ScheduledBatch.of(scheduled)

    def pick_victim(self) -> Request:
        if self.options.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_order))
        return self.running[-1]

    def preempt(self, request: Request) -> None:
        """Free the request's memory; it recomputes prompt + output later."""
        self.running.remove(request)
        self.kvcache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.counters.num_preemptions += 1
        heapq.heappush(self.waiting, (self.waiting_key(request), request))

    def update(
        self, batch: ScheduledBatch, sampled: list[int | None], logprobs: list[TokenLogprob | None]
    ) -> list[RequestOutput]:
        outputs, finished = self.record(batch, sampled, logprobs)
        if finished:
            self.running = [r for r in self.running if not r.is_finished]
            for request in finished:
                del self.requests[request.request_id]
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> SchedulerStats:
        self.counters.num_running = len(self.running)
        self.counters.num_waiting = len(self.waiting)
        return self.counters


@hookimpl
def conveyor_register_schedulers(register):
    register(ContinuousScheduler)
