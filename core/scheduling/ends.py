"""The scheduler's record of each step, and every end of a request.

One owner decides how a request ends: the base ``Scheduler`` inherits ``RequestEnds``, whose ``update`` takes
the workers' whole output for a step and ends a request by end of sequence or a stop id (``stop``), its length
(``length``), its grammar completing or refusing a token (``stop``; ``length`` where the gate was closing the
answer as max_tokens neared), or its embedding coming back (``stop``). The rest end through ``abort``: a client
that left (``abort``), a step that failed (``error``, ``step_failed``), and a stop string, which only the frontend
sees (it detokenizes): it tells the engine, which ends the request here as ``stop``. A request an admission gate
refuses ends in ``Gated.release`` (``error``, counted as rejected). The request's ``finish_reason`` is what its
last output says, but for one case: a stop string the frontend finds in the last token of a request this
ended by length is reported as ``stop`` (the text cut there, as vLLM reports it); the record keeps ``length``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from itertools import repeat

from conveyor.scheduling.batch import ScheduledBatch, WaitingQueue
from conveyor.scheduling.gates import AdmissionGate
from conveyor.kvcache import KVCacheManager
from conveyor.messages import RequestOutput, RunnerOutput, SchedulerStats
from conveyor.request import FinishReason, Request, RequestStatus


class RequestEnds:
    """The base ``Scheduler``'s side of a step's results: tokens recorded, requests ended."""

    requests: dict[str, Request]
    running: list[Request]
    waiting: WaitingQueue
    held: dict[RequestStatus, list[Request]]
    gates: list[AdmissionGate]
    # the gates that may end a request by its tokens (their class overrides ``ends``)
    ending_gates: list[AdmissionGate]
    kvcache: KVCacheManager
    counters: SchedulerStats
    # requests ended since the engine last took them (``take_finished``): the workers forget them
    _finished_ids: list[str]

    def submitted(self, batch: ScheduledBatch) -> None:
        """The engine handed ``batch`` to the workers: its requests' steps and tokens in flight."""
        now = time.time()
        for request, n in zip(batch.requests, batch.num_tokens):
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            request.in_flight += 1
            request.num_in_flight_tokens += n

    def _returned(self, batch: ScheduledBatch) -> None:
        for request, n in zip(batch.requests, batch.num_tokens):
            request.in_flight -= 1
            request.num_in_flight_tokens -= n

    def step_failed(self, batch: ScheduledBatch, error: str) -> list[RequestOutput]:
        """A step the workers could not run: its requests end with ``error``; their final outputs."""
        self._returned(batch)
        return self.abort([r.request_id for r in batch.requests], error)

    def update(self, batch: ScheduledBatch, output: RunnerOutput) -> list[RequestOutput]:
        """Record a step the workers ran, and end the requests it finished.

        Args:
            batch: what ``schedule`` returned (and ``submitted`` was told of).
            output: the workers' results, an entry per request of the batch: the sampled token (None for a
                prefill chunk that stops short of the prompt's end) and its logprobs; under speculative decoding
                the drafts accepted (they come before the sampled token; the rest are dropped, their KV rewritten
                later); the embedding of a pooling request that is done.

        Returns:
            One output per request that got tokens or ended (the last one says why it finished).
        """
        outputs: list[RequestOutput] = []
        for request, n, token, logprob, taken, taken_logprobs, embedding in zip(
                batch.requests, batch.num_tokens, output.sampled, output.logprobs, output.accepted or repeat(()),
                output.accepted_logprobs or repeat(None), output.embeddings or repeat(None)):
            request.in_flight -= 1  # (back from the workers: ``submitted`` counted it)
            request.num_in_flight_tokens -= n
            drafted = request.draft_token_ids[: n - 1] if n > 1 and request.num_uncomputed_tokens == 1 else []
            request.num_computed_tokens += n - (len(drafted) - len(taken))
            request.draft_token_ids = []
            if drafted:
                self.counters.num_draft_tokens += len(drafted)
                self.counters.num_accepted_tokens += len(taken)
            if request.is_finished:
                continue  # (ended while its step ran: an abort, or a stop string)
            if embedding is not None:
                self.finish(request, FinishReason.STOP)
                outputs.append(RequestOutput(request.request_id, finish_reason=FinishReason.STOP.value,
                                             num_prompt_tokens=request.num_prompt_tokens,
                                             num_cached_tokens=request.num_cached_tokens,
                                             queue_time=request.queue_time, embedding=embedding))
            elif token is not None:
                tokens = [*taken, token] if taken else [token]
                outputs.append(self._record(request, tokens, [*(taken_logprobs or ()), logprob]))
        return outputs

    def _record(self, request: Request, tokens: list[int], logprobs: list) -> RequestOutput:
        """Append a request's new tokens up to the first that ends it (those after it are not the request's)."""
        reason = None
        count = 0
        for count, token in enumerate(tokens, 1):
            reason = request.append_token(token)
            if reason is None and self.ending_gates and any(gate.ends(request, token) for gate in self.ending_gates):
                reason = FinishReason.STOP
            if reason is not None:
                break
        closed = reason is FinishReason.STOP and request.closing
        if closed:  # (its closing was forced as the budget ran out: the budget ended it)
            reason = FinishReason.LENGTH
        output = RequestOutput(
            request.request_id, tokens[:count], logprobs[:count] if logprobs[-1] is not None else None,
            reason.value if reason else None, num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            queue_time=request.queue_time if request.num_output_tokens == count else 0.0, grammar_closed=closed)
        if reason is not None:
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
            self.finish(request, reason)
        return output

    def finish(self, request: Request, reason: FinishReason) -> None:
        """End a request wherever it is: free its memory and forget it."""
        self._remove(request, reason)
        if reason in (FinishReason.ABORT, FinishReason.ERROR):
            self.counters.num_aborted += 1
        else:
            self.counters.num_finished += 1

    def _remove(self, request: Request, reason: FinishReason) -> None:
        """``finish``, uncounted (a request a gate refused counts as rejected)."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status in self.held:
            self.held[request.status].remove(request)
        elif request.status != RequestStatus.FINISHED:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.kvcache.free(request)
        self.requests.pop(request.request_id, None)
        self._finished_ids.append(request.request_id)
        for gate in self.gates:
            gate.forget(request)

    def abort(self, request_ids: Iterable[str], error: str | None = None,
              reason: FinishReason = FinishReason.ABORT) -> list[RequestOutput]:
        """Drop requests wherever they are and free their memory; a final output for each one still unfinished.

        Args:
            request_ids: unknown or finished ids are skipped.
            error: end them with finish reason "error" and this text instead of ``reason``.
            reason: "abort", or "stop" for requests the frontend ended at a stop string (counted as finished).
        """
        reason = reason if error is None else FinishReason.ERROR
        outputs = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            self.finish(request, reason)
            outputs.append(RequestOutput(request_id, finish_reason=reason.value, error=error,
                                         num_prompt_tokens=request.num_prompt_tokens))
        return outputs

    def take_finished(self) -> list[str]:
        """The ids of the requests that ended (finished, aborted, failed) since the last call."""
        finished, self._finished_ids = self._finished_ids, []
        return finished
