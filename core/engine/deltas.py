"""Each step sends the workers only what changed of each request; the workers keep the rest.

The engine's ``SentRequests`` remembers what every worker holds of each request it scheduled: its
sampling parameters, its block table, and, under a repetition, presence or frequency penalty, its
prompt and the outputs sent so far. (Under min_tokens a step also carries the tokens it may not sample yet,
as long as they apply; nothing is kept of them.) A step's ``ScheduledRequest`` then carries the parameters only
the first time, the table from the first entry that changed (``block_offset``: a table grows at its
end, and a preempted request's new table usually shares little), and only the new outputs. A
worker applies the step to the row it keeps of each request (``conveyor.worker.rows``: the table
written from ``block_offset`` on, the outputs appended). Both forget a request as it ends (the step's
``finished_request_ids``, applied before its entries, so an id may come back at once).

At 64 decodes with 1,000-token contexts this is the difference between a step message that grows
with the context (every table, every parameter set) and one of a few bytes per request
(``benchmarks/step_message.py`` prints both).
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.messages import ScheduledRequest
from conveyor.request import Request


@dataclass
class _Sent:
    # the block table the workers hold
    table: list[int]
    # outputs sent (penalties), and whether the prompt was (-1: neither)
    num_outputs: int = -1


class SentRequests:
    """The engine's record of what the workers hold of each request."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def __len__(self) -> int:
        return len(self._sent)

    def forget(self, request_ids: list[str]) -> None:
        """Requests that ended (the same ids go to the workers in the step)."""
        for request_id in request_ids:
            self._sent.pop(request_id, None)

    def fill(self, entry: ScheduledRequest, request: Request, table: list[int], penalties: bool) -> None:
        """Put into ``entry`` what the workers lack of ``request``: its parameters if they do not hold it, its
        table from the first block that changed, with ``penalties`` its prompt once and its new outputs, and,
        while its output is short of min_tokens, the tokens the step may not sample yet (they change from
        step to step and are not held: the engine knows the outputs, a worker only those it sampled)."""
        if entry.sample and request.params.min_tokens:
            # (a ``follows`` entry samples after the token of the step in flight, which the engine has not seen)
            entry.banned_token_ids, entry.min_tokens_left = request.min_tokens_ban(int(entry.follows))
        sent = self._sent.get(request.request_id)
        if sent is None:
            entry.params = request.params
            entry.block_ids = list(table)
            sent = self._sent[request.request_id] = _Sent(list(table))
        else:
            held = sent.table
            offset = len(held)
            if table[:offset] != held:  # (rare: preempted, or blocks behind a sliding window given back)
                offset = 0
                while offset < min(len(table), len(held)) and table[offset] == held[offset]:
                    offset += 1
                del held[offset:]
            entry.block_offset = offset
            entry.block_ids = table[offset:]
            held.extend(entry.block_ids)
        if penalties:
            if sent.num_outputs < 0:
                entry.prompt_token_ids = request.prompt_token_ids
                sent.num_outputs = 0
            entry.output_token_ids = request.output_token_ids[sent.num_outputs :]
            sent.num_outputs = request.num_output_tokens
