"""The scheduler interface (plugin kind ``scheduler``).

Each engine step asks the scheduler which requests run and how many tokens each computes (``schedule``), runs the model,
then hands the sampled tokens back (``update``). The scheduler owns the request queues and talks to the KV cache manager
for memory; it never touches tensors.

The base class does the mechanics every scheduler shares: admission control (``add``), the admission gates a request
passes before it may run (``AdmissionGate``: its LoRA adapter loading, its grammar compiling, its KV blocks a
connector fetches), the waiting queue and the running list, moving a request in (``admit``) and out (``preempt``),
and, in ``RequestEnds`` (``conveyor.scheduling.ends``), recording each step (``update``) and every end of a request
(``finish``, ``abort``): the one place a request ends. Its ``schedule`` is continuous batching; a scheduler decides
order and budget by overriding ``waiting_key``, ``pick_victim``, ``can_admit``, ``chunk_limit`` and
``token_budget``, whom it takes by ``check_admission``, and learns how long its steps take from ``observe_step``; or
another discipline by overriding ``schedule`` itself (the built-in static and dynamic schedulers do). Options named
in ``runtime_options`` may change while the engine runs (``reconfigure``).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar

import msgspec

from conveyor.scheduling.batch import ScheduledBatch, WaitingQueue
from conveyor.scheduling.gates import AdmissionGate, Gated
from conveyor.kvcache import KVCacheManager, PrefixMatch
from conveyor.messages import SchedulerStats
from conveyor.request import Request, RequestRejected, RequestStatus, length_error
from conveyor.scheduling.ends import RequestEnds


class SchedulerOptions(msgspec.Struct, forbid_unknown_fields=True):
    """Options every scheduler has; a scheduler's own Options may subclass it."""

    # token budget of one step (prefill chunks + decodes)
    max_num_batched_tokens: Annotated[int, msgspec.Meta(ge=1)] = 256
    # most requests waiting; more are rejected (HTTP 429)
    max_waiting: Annotated[int, msgspec.Meta(ge=1)] = 1024


class Scheduler(RequestEnds, Gated):
    """Decides, step by step, which requests run and with how many tokens."""

    name: ClassVar[str]
    Options: ClassVar[type[msgspec.Struct]] = SchedulerOptions
    # Whether ``schedule`` may be called while earlier batches are still in flight (pipeline parallelism,
    # async scheduling): it must then leave out requests with ``in_flight`` set unless ``follows`` says they
    # go on, start those after their ``num_in_flight_tokens``, and never preempt them. The base class's
    # ``schedule`` does; a scheduler that overrides it says False unless it does too.
    pipelined: ClassVar[bool] = True
    # options that may change while the engine runs (``reconfigure``)
    runtime_options: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, options: msgspec.Struct, kvcache: KVCacheManager, max_model_len: int):
        """
        Args:
            options: an instance of ``Options`` (a ``SchedulerOptions``).
            kvcache: where requests' KV lives; the scheduler allocates and frees in it.
            max_model_len: prompt + output never exceeds this.
        """
        self.options = options
        self.kvcache = kvcache
        self.max_model_len = max_model_len
        # every unfinished request, by id (held by a gate, waiting or running)
        self.requests: dict[str, Request] = {}
        # admission gates, in the order a request passes them, and the requests each holds (by its status)
        self.gates: list[AdmissionGate] = []
        self.ending_gates: list[AdmissionGate] = []
        self.held: dict[RequestStatus, list[Request]] = {}
        self.waiting = WaitingQueue()
        # requests holding KV memory, in admission order
        self.running: list[Request] = []
        # cumulative counts; stats() adds the queue lengths
        self.counters = SchedulerStats()
        # requests ended since the engine last took them (``take_finished``): the workers forget them
        self._finished_ids: list[str] = []
        # seconds, for time-based policies (tests replace it)
        self.clock = time.monotonic
        # batches the engine keeps in flight (pipeline parallelism): each takes about this share of the requests
        self.pipeline_depth = 1
        # async scheduling: a request whose step is in flight may be in the next one too
        self.async_steps = False

    def overlap(self, pipeline_depth: int, async_steps: bool) -> None:
        """How the engine runs steps: ``pipeline_depth`` batches in flight at once (pipeline stages), or (async
        scheduling) the next step scheduled while the last one runs."""
        self.pipeline_depth = pipeline_depth
        self.async_steps = async_steps

    @classmethod
    def max_running(cls, options: msgspec.Struct) -> int | None:
        """The most requests one batch holds under ``options`` (default None: as many as the KV cache does); the
        workers size their compiled decode graphs and draft buffers by it."""
        return None

    # What a scheduler decides: override these.

    def waiting_key(self, request: Request) -> tuple:
        """Order of the waiting queue, smallest first (default: arrival order)."""
        return (request.arrival_order,)

    def pick_victim(self) -> Request | None:
        """The running request to preempt when memory runs out (default: the newest not in flight); None
        when every one is in a batch the workers have not finished."""
        return next((r for r in reversed(self.running) if not r.in_flight), None)

    def follows(self, request: Request) -> bool:
        """Async scheduling: whether a running request whose last step is still on the workers goes in this
        step too, after it: the rest of its prompt, or the token that step samples. Not under a penalty, a
        grammar or prompt logprobs (the next step needs that token on the engine's side first), after a step
        that checks drafts, or where that step may end it by length or by its embedding."""
        if not self.async_steps or request.in_flight > 1:
            return False
        params = request.params
        if params.has_penalties or params.structured is not None or params.prompt_logprobs is not None:
            return False
        if request.num_in_flight_tokens < request.num_uncomputed_tokens:
            return True
        return not params.pooling and not request.draft_token_ids and request.num_tokens + 1 < request.max_total_tokens

    def can_admit(self, request: Request) -> bool:
        """Whether ``request``, first in the waiting queue, may start this step, budget and memory
        permitting (default: yes)."""
        return True

    def chunk_limit(self, budget: int) -> int:
        """The most tokens one request computes in a step when ``budget`` tokens are left (default: all)."""
        return budget

    def token_budget(self) -> int:
        """The tokens this step may compute, decodes and prompt chunks together (default: the option's)."""
        return self.options.max_num_batched_tokens

    def check_admission(self, request: Request) -> None:
        """Called by ``add`` for a request that can run here, before it is queued: raise ``RequestRejected`` (429
        with a ``retry_after`` where later may do) to refuse it. Default: take it."""

    def observe_step(self, spans: list[tuple[int, int]], seconds: float) -> None:
        """The engine reports each step it ran: per entry (its first position, the tokens it computed), and the
        step's seconds (schedule, forward, sample, update). Default: nothing."""

    def schedule(self) -> ScheduledBatch:
        """Pick this step's batch and allocate its KV memory: continuous batching.

        Running requests first, in admission order, each with its next chunk
        (a decode with its proposed draft tokens, as many as the budget holds);
        when memory runs out, ``pick_victim()`` is preempted (and recomputed
        later). Then waiting requests in ``waiting_key`` order while the token
        budget, ``can_admit`` and memory allow, none in a step that preempted.
        With ``pipeline_depth`` batches in flight, requests in flight are left
        out and a batch takes at most 1/``pipeline_depth`` of the requests.

        Returns:
            The batch (empty when there is nothing to run).
        """
        budget = self.token_budget()
        # with several batches in flight, each takes its share of the requests, so that every stage has work
        max_requests = -(-len(self.requests) // self.pipeline_depth)
        scheduled: dict[Request, int] = {}
        preempted = False
        for request in list(self.running):
            if budget == 0 or len(scheduled) >= max_requests:
                break
            if request.status != RequestStatus.RUNNING or (request.in_flight and not self.follows(request)):
                continue  # preempted earlier in this step, or its last step is not back yet
            ahead = request.num_in_flight_tokens
            # (no known token left: the one its step in flight samples, which the worker feeds in)
            n = min(max(request.num_uncomputed_tokens - ahead, 1), self.chunk_limit(budget))
            if not ahead and n == request.num_uncomputed_tokens == 1 and request.draft_token_ids:
                del request.draft_token_ids[budget - 1 :]  # (the drafts the budget holds are checked)
                n += len(request.draft_token_ids)
            while not self.kvcache.allocate(request, ahead + n):
                victim = self.pick_victim()
                if victim is None or victim.in_flight:
                    break  # nothing can give memory now: the request waits for a later step
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
        while (not preempted and self.waiting and budget > 0 and len(scheduled) < max_requests
               and self.can_admit(self.waiting.peek())):
            request = self.waiting.peek()
            n = self.admit(request, self.chunk_limit(budget))
            if not n:
                if request.status == RequestStatus.WAITING_FOR_KV:
                    continue  # (back at the KV connector's gate while it fetches the request's blocks)
                break
            scheduled[request] = n
            budget -= n
        return ScheduledBatch.of(scheduled)

    # The mechanics every scheduler shares.

    def add(self, request: Request) -> None:
        """Admission control: the request goes to its first gate or the waiting queue, or is rejected with why.

        Raises:
            RequestRejected: can never run here (empty, too long for
                max_model_len or for the whole cache), or the queue (waiting
                and held) is full (429). (Its id is not in use: the engine
                client, which hands out the streams, refuses one that is.)
        """
        request.added_at = self.clock()
        reason = self._never_runs(request)
        try:
            if reason is not None:
                raise RequestRejected(reason)
            if self.num_waiting >= self.options.max_waiting:
                raise RequestRejected(f"the waiting queue is full (max_waiting={self.options.max_waiting})", 429)
            self.check_admission(request)
        except RequestRejected:
            self.counters.num_rejected += 1
            raise
        self.requests[request.request_id] = request
        self._pass_gates(request, 0)

    @property
    def num_waiting(self) -> int:
        """Requests waiting to run: queued, or held by a gate."""
        return len(self.waiting) + sum(len(held) for held in self.held.values())

    def _never_runs(self, request: Request) -> str | None:
        problem = length_error(request.num_prompt_tokens, None, self.max_model_len, bool(request.params.pooling))
        if problem is not None:
            return problem[0]
        if not self.kvcache.can_fit([request.max_total_tokens]):
            return (
                f"the request needs {request.max_total_tokens} tokens of KV cache but the whole cache holds "
                f"{self.kvcache.capacity_tokens}"
            )
        return None

    def _enqueue(self, request: Request) -> None:
        request.queued_at = self.clock()
        self.waiting.push(request, self.waiting_key(request))

    def admit(self, request: Request, max_tokens: int) -> int:
        """Start a waiting request: claim what the prefix cache holds of it and KV memory for its first chunk.

        Args:
            request: a request in the waiting queue (new or preempted).
            max_tokens: the most tokens it may compute this step.

        Returns:
            The tokens it computes this step; 0 when memory is short (nothing changed), or when a KV connector
            fetches blocks of its prefix (it waits at the connector's gate until they are in).
        """
        # A request that wants every prompt logprob, or every token's hidden state, computes every prompt token.
        params = request.params
        whole = params.prompt_logprobs is not None or params.pooling == "mean"
        prefix = PrefixMatch() if whole else self.kvcache.match_prefix(request)
        if prefix.fetching:
            self.waiting.remove(request)
            self._hold(request, self.kvcache.connector)
            return 0
        n = min(request.num_tokens - prefix.num_tokens, max_tokens)
        if n < 1 or not self.kvcache.allocate(request, n, prefix):
            return 0
        self.waiting.remove(request)
        if request.status == RequestStatus.WAITING:
            request.num_cached_tokens = prefix.num_tokens
        request.num_computed_tokens = prefix.num_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return n

    def preempt(self, request: Request) -> None:
        """Free a running request's memory and queue it again; it recomputes prompt + output later."""
        self.running.remove(request)
        self.kvcache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.draft_token_ids = []
        self.counters.num_preemptions += 1
        self._enqueue(request)

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.requests)

    def reconfigure(self, changes: dict[str, Any]) -> None:
        """Change options while the engine runs (``changed_options``; raises its ValueError); the waiting queue
        is ordered again (its keys may depend on the options)."""
        self.options = self.changed_options(self.options, changes)
        self.waiting.rekey(self.waiting_key)

    @classmethod
    def changed_options(cls, options: msgspec.Struct, changes: dict[str, Any]) -> msgspec.Struct:
        """``options`` with ``changes`` (keys of ``runtime_options``) made, checked as the config is; a ValueError
        names a key that may not change at run time, or a value its option does not allow."""
        unknown = sorted(set(changes) - cls.runtime_options)
        if unknown:
            allowed = ", ".join(sorted(cls.runtime_options)) or "none"
            raise ValueError(f"scheduler {cls.name!r} cannot change {', '.join(unknown)} at run time "
                             f"(allowed: {allowed})")
        try:
            return msgspec.convert(msgspec.to_builtins(options) | changes, type(options))
        except msgspec.ValidationError as e:
            raise ValueError(str(e)) from None

    def stats(self) -> SchedulerStats:
        """Queue lengths now, and the cumulative counters."""
        return msgspec.structs.replace(self.counters, num_running=len(self.running), num_waiting=self.num_waiting)
