"""Speculative decoding with a draft model: a smaller model sharing the vocabulary proposes the next tokens.

The draft keeps a KV cache of its own in the same blocks as the target's
(the engine's block tables serve both; its KV takes the extra bytes per
token the KV cache was sized with). Each step, after the target's forward
pass and sampling:

1. the draft runs over the step's tokens (the same flat batch), so its cache
   holds every token the target's does (prompt chunks, checked proposals;
   the positions of rejected ones are written over before they are read);
2. for each request that sampled, it takes the new token at its position
   and proposes ``k`` tokens greedily, one single-token pass each. Positions
   past the request's blocks go to scratch blocks of the draft's own (the
   target's next step computes those tokens again and the draft with it).

Greedy proposals are a one-hot draft distribution, so the target's check
(argmax, or rejection sampling) keeps its own distribution exactly, as with
n-gram drafts.
"""

from __future__ import annotations

from conveyor.attention.backend import AttentionBackend
from conveyor.messages import RunnerOutput, ScheduledRequest, StepInput
from conveyor.model.decoder_model import DecoderModel
from conveyor.worker.inputs import InputBuffers
from conveyor.worker.rows import BatchRows


def scratch_blocks_per_row(k: int, block_size: int) -> int:
    """Blocks a request's proposals may need past its own: ``k`` positions, starting anywhere in a block."""
    return k // block_size + 2


class Drafter:
    """The draft model, its attention over its own KV storage, and its proposals."""

    def __init__(self, model: DecoderModel, attention: AttentionBackend, k: int, first_scratch_block: int,
                 max_rows: int):
        """
        Args:
            first_scratch_block: the draft storage's blocks from here on are scratch (``max_rows`` rows of
                ``scratch_blocks_per_row`` each); those below mirror the target's.
        """
        self.model = model
        self.attention = attention
        self.k = k
        self.block_size = attention.storage.block_size
        self.per_row = scratch_blocks_per_row(k, self.block_size)
        self.first_scratch_block = first_scratch_block
        self.max_rows = max_rows
        self.inputs = InputBuffers(self.block_size, model.device, pad_block=attention.storage.pad_block)

    def propose(self, step: StepInput, output: RunnerOutput, rows: BatchRows) -> list[list[int]]:
        """Fill the draft's cache with the step's tokens and propose ``k`` tokens after each sampled one.

        Args:
            output: the target's tokens (``sampled``, and ``accepted`` drafts where there were any).
            rows: the worker's rows, which hold the requests' block tables.

        Returns:
            Per entry of the step, the proposals ([] where nothing was sampled).
        """
        model = self.model
        inputs = self.inputs.prepare(step, self.attention, rows)
        model.forward(inputs.input_ids, inputs.positions, inputs.attention)
        # (entry, request, next position, token, its table)
        proposing: list[tuple[int, ScheduledRequest, int, int, list[int]]] = []
        for i, (request, token) in enumerate(zip(step.requests, output.sampled)):
            if token is None:
                continue
            accepted = len(output.accepted[i]) if output.accepted else 0
            known = len(request.token_ids) - len(request.draft_token_ids)
            proposing.append((i, request, request.start + known + accepted, token, rows.table(request)))
        proposals: list[list[int]] = [[] for _ in step.requests]
        for first in range(0, len(proposing), self.max_rows):
            self._propose_rows(proposing[first : first + self.max_rows], proposals)
        return proposals

    def _propose_rows(self, rows: list[tuple[int, ScheduledRequest, int, int, list[int]]],
                      proposals: list[list[int]]) -> None:
        size = self.block_size
        tables = []
        for row, (_, _, position, _, table) in enumerate(rows):
            own = table[: -(-position // size)]  # (the blocks before the new token's)
            scratch = self.first_scratch_block + row * self.per_row
            needed = -(-(position + self.k) // size) - len(own)
            tables.append(own + list(range(scratch, scratch + needed)))
        tokens = [token for _, _, _, token, _ in rows]
        for j in range(self.k):
            batch = StepInput([ScheduledRequest(request.request_id, position + j, [token], table, request.params)
                               for (_, request, position, _, _), token, table in zip(rows, tokens, tables)],
                              len(rows))
            inputs = self.inputs.prepare(batch, self.attention)
            logits = self.model.compute_logits(self.model.forward(inputs.input_ids, inputs.positions,
                                                                  inputs.attention))
            tokens = logits.argmax(dim=-1).tolist()
            for (entry, *_), token in zip(rows, tokens):
                proposals[entry].append(token)
