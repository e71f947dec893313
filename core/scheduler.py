"""The scheduler interface (plugin kind ``scheduler``).

Each engine step asks the scheduler which requests run and how many tokens
each computes (``schedule``), runs the model, then hands the sampled tokens
back (``update``). The scheduler owns the request queues and talks to the KV
cache for memory; it never touches tensors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import ClassVar

import msgspec

from conveyor.kvcache import KVCache
from conveyor.messages import RequestOutput, TokenLogprob
from conveyor.request import FinishReason, Request, RequestRejected, RequestStatus


@dataclass
class ScheduledBatch:
    """One step's work, in forward order: single-token decodes first, then prefill chunks."""

    requests: list[Request] = field(default_factory=list)
    # tokens each request computes this step
    num_tokens: list[int] = field(default_factory=list)
    # how many leading entries are decodes (one token, after the prompt)
    num_decodes: int = 0

    @classmethod
    def of(cls, scheduled: dict[Request, int]) -> ScheduledBatch:
        """Order a step's work for the forward pass: single-token entries first."""
        decodes = [(r, n) for r, n in scheduled.items() if n == 1]
        entries = decodes + [(r, n) for r, n in scheduled.items() if n != 1]
        return cls([r for r, _ in entries], [n for _, n in entries], len(decodes))

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __len__(self) -> int:
        return len(self.requests)


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    # the rest are cumulative counts since start
    num_preemptions: int = 0
    num_finished: int = 0
    num_rejected: int = 0
    # run-to-completion batching: slot-steps a batch held for requests already finished (or never there)
    num_wasted_slots: int = 0


class Scheduler(ABC):
    """Decides, step by step, which requests run and with how many tokens."""

    name: ClassVar[str]
    Options: ClassVar[type[msgspec.Struct]]

    def __init__(self, options: msgspec.Struct, kvcache: KVCache, max_model_len: int):
        """
        Args:
            options: an instance of ``Options``.
            kvcache: where requests' KV lives; the scheduler allocates and frees in it.
            max_model_len: prompt + output never exceeds this.
        """
        self.options = options
        self.kvcache = kvcache
        self.max_model_len = max_model_len
        # every unfinished request, by id
        self.requests: dict[str, Request] = {}
        # cumulative counts; stats() adds the queue lengths
        self.counters = SchedulerStats()

    @abstractmethod
    def add(self, request: Request) -> None:
        """Queue a new request.

        Raises:
            RequestRejected: it can never run here (too long for the cache or
                max_model_len), or the waiting queue is full.
        """

    @abstractmethod
    def abort(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Drop requests wherever they are and free their memory.

        Returns:
            A final ``abort`` output for each request that was still unfinished.
        """

    @abstractmethod
    def schedule(self) -> ScheduledBatch:
        """Pick this step's batch and allocate its KV memory.

        Returns:
            The batch (empty when there is nothing to run).
        """

    @abstractmethod
    def update(
        self, batch: ScheduledBatch, sampled: list[int | None], logprobs: list[TokenLogprob | None]
    ) -> list[RequestOutput]:
        """Record a finished step.

        Args:
            batch: what ``schedule`` returned.
            sampled: per batch entry, the new token, or None for a prefill
                chunk that did not reach the end of the prompt.
            logprobs: per batch entry, logprobs of the new token (or None).

        Returns:
            One output per request that got a token or finished.
        """

    @abstractmethod
    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""

    @abstractmethod
    def stats(self) -> SchedulerStats:
        """Queue lengths now, and the cumulative counters."""

    # Helpers shared by the built-in schedulers.

    def accept(self, request: Request, num_waiting: int, max_waiting: int) -> None:
        """Admission control: register the request, or reject it with the reason.

        Raises:
            RequestRejected: duplicate id, can never run, or the waiting queue is full (429).
        """
        if request.request_id in self.requests:
            raise RequestRejected(f"request id {request.request_id!r} is already in use")
        self.check_admission(request)
        if num_waiting >= max_waiting:
            self.counters.num_rejected += 1
            raise RequestRejected(f"the waiting queue is full (max_waiting={max_waiting})", 429)
        self.requests[request.request_id] = request

    def check_admission(self, request: Request) -> None:
        """Reject what can never run."""
        if request.num_prompt_tokens == 0:
            self.counters.num_rejected += 1
            raise RequestRejected("the prompt is empty")
        if request.num_prompt_tokens >= self.max_model_len:
            self.counters.num_rejected += 1
            raise RequestRejected(
                f"the prompt has {request.num_prompt_tokens} tokens; max_model_len={self.max_model_len} "
                "leaves no room for output"
            )
        if not self.kvcache.can_fit([request.max_total_tokens]):
            self.counters.num_rejected += 1
            raise RequestRejected(
                f"the request needs {request.max_total_tokens} tokens of KV cache but the whole cache holds "
                f"{self.kvcache.capacity_tokens}"
            )

    def finish(self, request: Request, reason: FinishReason) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.kvcache.free(request)
        self.counters.num_finished += 1

    def record(
        self, batch: ScheduledBatch, sampled: list[int | None], logprobs: list[TokenLogprob | None]
    ) -> tuple[list[RequestOutput], list[Request]]:
        """Advance every request in the batch; return the outputs and the requests that finished."""
        outputs: list[RequestOutput] = []
        finished: list[Request] = []
        for request, n, token, logprob in zip(batch.requests, batch.num_tokens, sampled, logprobs):
            request.num_computed_tokens += n
            if token is None or request.is_finished:
                continue
            reason = request.append_token(token)
            if reason is not None:
                self.finish(request, reason)
                finished.append(request)
            outputs.append(
                RequestOutput(
                    request.request_id,
                    [token],
                    [logprob] if logprob is not None else None,
                    reason.value if reason else None,
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_cached_tokens=request.num_cached_tokens,
                    queue_time=request.queue_time if request.num_output_tokens == 1 else 0.0,
                )
            )
        return outputs, finished


def abort_output(request: Request) -> RequestOutput:
    return RequestOutput(
        request.request_id,
        finish_reason=FinishReason.ABORT.value,
        num_prompt_tokens=request.num_prompt_tokens,
    )
