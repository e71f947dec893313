"""The step's message to the workers, built from a scheduled batch."""

from __future__ import annotations

from conveyor.connector import KVConnector
from conveyor.engine.deltas import SentRequests
from conveyor.engine.grammars import GrammarRequests
from conveyor.engine.loras import LoraSlots
from conveyor.kvcache import KVCacheManager
from conveyor.messages import ScheduledRequest, StepInput
from conveyor.scheduler import ScheduledBatch, Scheduler


class StepBuilder:
    """Builds each step's ``StepInput``: what the workers hold of each request already is left out."""

    def __init__(self, scheduler: Scheduler, kvcache: KVCacheManager, loras: LoraSlots | None,
                 grammars: GrammarRequests, connector: KVConnector | None):
        self.scheduler = scheduler
        self.kvcache = kvcache
        self.loras = loras
        self.grammars = grammars
        self.connector = connector
        # what the workers hold of each request (a step sends the rest)
        self.sent = SentRequests()

    def build(self, batch: ScheduledBatch) -> StepInput:
        """The step's message to the workers: each request's new tokens, what the workers lack of it, and the
        KV connector's moves."""
        finished = self.scheduler.take_finished()
        self.sent.forget(finished)
        requests = []
        for request, n in zip(batch.requests, batch.num_tokens):
            start = request.num_computed_tokens + request.num_in_flight_tokens  # (after its steps in flight)
            params = request.params
            if start == request.num_tokens:  # async: its input is the token its step in flight samples
                entry = ScheduledRequest(request.request_id, start, [-1], sample=True, follows=True,
                                         lora_slot=-1 if self.loras is None else self.loras.slot(request))
                self.sent.fill(entry, request, self.kvcache.block_ids(request), False)
                requests.append(entry)
                continue
            known = min(n, request.num_tokens - start)  # (the rest are draft tokens, to be checked)
            drafts = request.draft_token_ids[: n - known]
            entry = ScheduledRequest(
                request.request_id, start, request.token_ids(start, start + known) + drafts,
                sample=start + known == request.num_tokens, draft_token_ids=drafts,
                lora_slot=-1 if self.loras is None else self.loras.slot(request),
            )
            self.sent.fill(entry, request, self.kvcache.block_ids(request), entry.sample and params.has_penalties)
            if params.prompt_logprobs is not None and request.num_prompt_logprobs < request.num_prompt_tokens - 1:
                entry.prompt_logprob_token_ids = request.prompt_token_ids[start + 1 : start + n + 1]
            requests.append(entry)
        step = StepInput(requests, batch.num_decodes, finished)
        if self.grammars.matchers:
            step.grammar_rows, step.bitmask = self.grammars.bitmask(
                [r if e.sample else None for r, e in zip(batch.requests, requests)])
        if self.connector is not None:
            step.kv_connector = self.connector.take_payload()
        return step

