"""One row per running request on a worker: everything the worker keeps of a request between steps.

A request gets a row on the first step that carries its parameters and keeps it until a step lists it among
``finished_request_ids``; ``remove`` then forgets all of it at once, and the row goes to the next new request.
A step's entry is a diff (``conveyor.engine.deltas``), and it is applied as one: the block table is written from
``block_offset`` on, the penalty tokens are appended, nothing of a row is written again whole. A row holds:

- its block table: a row of one int32 array, which a step gathers by row index into its input buffers
  (``conveyor.worker.inputs``) in one numpy operation instead of writing each request's table again;
- its sampling parameters, and their temperature, top-k, top-p and min-p in arrays by row, which the sampler
  gathers the same way;
- its prompt and outputs (under a penalty, which reads them), and the token this worker last sampled for it
  (async scheduling: the input of an entry that ``follows`` a step in flight);
- its own generator (a seed of its own), its logit bias as tensors, and (pooling = "mean") the sum of its
  hidden states so far, each made on first use.

After ``apply`` an entry refers to its row's parameters and penalty tokens, and its input token where it follows;
its ``block_ids`` stay the step's diff. ``written_blocks`` and ``written_tokens`` count the table cells and tokens
written into rows, so that a test can hold a decode step to its new blocks and new tokens.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
import torch

from conveyor.messages import ScheduledRequest, StepInput
from conveyor.sampling import SamplingParams
from conveyor.worker.inputs import grown


@dataclass(eq=False)
class Row:
    """A request's row: its index in the arrays, and what is kept per request outside them."""

    index: int
    params: SamplingParams
    prompt: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    # the token this worker last sampled for it (-1: none)
    last_sampled: int = -1
    generator: torch.Generator | None = None
    # logit_bias: token ids and biases, on the logits' device
    bias: tuple[torch.Tensor, torch.Tensor] | None = None
    # pooling = "mean": the sum of its hidden states so far, and their count
    sums: tuple[torch.Tensor, int] | None = None


class BatchRows:
    """A worker's rows, and the arrays that hold their block tables and sampling parameters by row."""

    def __init__(self, pad_block: int = 0, rows: int = 64, width: int = 16):
        """
        Args:
            pad_block: what table cells hold before a request writes them (a block of the pool no request owns).
            rows, width: what the arrays hold at first (they grow, doubling).
        """
        self.pad_block = pad_block
        self._rows: dict[str, Row] = {}
        # indices of removed rows, lowest first (rows stay packed at the front of the arrays)
        self._free: list[int] = []
        self._used = 0
        self.tables = np.full((rows, width), pad_block, np.int32)
        self.num_blocks = np.zeros(rows, np.int64)
        self.temperature = np.ones(rows, np.float32)
        self.top_k = np.zeros(rows, np.int64)
        self.top_p = np.ones(rows, np.float64)
        self.min_p = np.zeros(rows, np.float32)
        self.written_blocks = 0
        self.written_tokens = 0

    def __len__(self) -> int:
        return len(self._rows)

    def row(self, request: ScheduledRequest) -> Row:
        """The request's row; a request not held yet, or back with other parameters than its row's (an id used
        again), gets a fresh one under the parameters it carries. (``apply`` points a step's entries at their
        rows' parameters, so a worker's entries always find their own.)"""
        row = self._rows.get(request.request_id)
        if row is None or (request.params is not None and request.params is not row.params):
            return self._add(request.request_id, request.params)
        return row

    def index(self, requests: list[ScheduledRequest]) -> np.ndarray:
        """The requests' row indices, in order."""
        return np.fromiter((self.row(r).index for r in requests), np.int64, len(requests))

    def table(self, request: ScheduledRequest) -> list[int]:
        """The request's whole block table."""
        index = self._rows[request.request_id].index
        return self.tables[index, : self.num_blocks[index]].tolist()

    def remove(self, request_ids: list[str]) -> None:
        """Forget the rows of requests that ended: their tables, tokens, generators, biases and sums."""
        for request_id in request_ids:
            row = self._rows.pop(request_id, None)
            if row is not None:
                heapq.heappush(self._free, row.index)

    def apply(self, step: StepInput) -> None:
        """Remove the requests that ended, then apply each entry to its row (a new row where it carries
        parameters) and point the entry at what the row keeps: its parameters, (penalties) its prompt and
        outputs, and the input token of an entry that follows a step in flight.

        Raises:
            KeyError: an entry for a request this worker does not hold that carries no parameters.
        """
        self.remove(step.finished_request_ids)
        for entry in step.requests:
            if entry.params is not None:
                row = self._add(entry.request_id, entry.params)
            else:
                row = self._rows[entry.request_id]
                entry.params = row.params
            self._write_blocks(row.index, entry.block_offset, entry.block_ids)
            if entry.follows:  # (-1: the step it follows failed, and the engine ends the request; any token
                # keeps this step's other requests valid)
                entry.token_ids = [max(row.last_sampled, 0)]
            if entry.prompt_token_ids:
                row.prompt = entry.prompt_token_ids
                self.written_tokens += len(row.prompt)
            if entry.sample and row.params.has_penalties:
                row.outputs.extend(entry.output_token_ids)
                self.written_tokens += len(entry.output_token_ids)
                entry.prompt_token_ids, entry.output_token_ids = row.prompt, row.outputs

    def followed(self, step: StepInput) -> list[int]:
        """The last sampled token of each entry that ``follows`` a step in flight, in order (-1 where this worker
        sampled none: a TP worker other than the driver)."""
        return [self._rows[e.request_id].last_sampled for e in step.requests if e.follows]

    def take_followed(self, step: StepInput, tokens: list[int]) -> None:
        """Keep ``tokens`` (the driver's ``followed``) as those entries' last sampled tokens."""
        entries = (e for e in step.requests if e.follows)
        for entry, token in zip(entries, tokens):
            self._rows[entry.request_id].last_sampled = token

    def sampled(self, step: StepInput, tokens: list[int | None]) -> None:
        """Keep each request's token this step sampled (the driver's; other workers sample none)."""
        for entry, token in zip(step.requests, tokens):
            if token is not None:
                self._rows[entry.request_id].last_sampled = token

    def _add(self, request_id: str, params: SamplingParams) -> Row:
        """A fresh row for the request (one it held before is forgotten), its sampling parameters written."""
        self.remove([request_id])
        if self._free:
            index = heapq.heappop(self._free)
        else:
            index, self._used = self._used, self._used + 1
            self._reserve(self._used, 0)
        row = self._rows[request_id] = Row(index, params)
        self.num_blocks[index] = 0
        self.temperature[index] = params.temperature
        self.top_k[index] = max(0, params.top_k)
        self.top_p[index] = params.top_p
        self.min_p[index] = params.min_p
        return row

    def _write_blocks(self, index: int, offset: int, blocks: list[int]) -> None:
        """The row's table from ``offset`` on is ``blocks`` (the cells before stay; those after are no longer
        its own)."""
        end = offset + len(blocks)
        if blocks:
            self._reserve(0, end)
            self.tables[index, offset:end] = blocks
            self.written_blocks += len(blocks)
        self.num_blocks[index] = end

    def _reserve(self, rows: int, width: int) -> None:
        """Room for ``rows`` rows of ``width`` blocks (arrays grown keep what they held)."""
        have_rows, have_width = self.tables.shape
        if rows <= have_rows and width <= have_width:
            return
        rows, width = grown(have_rows, max(rows, 1)), grown(have_width, max(width, 1))
        tables = np.full((rows, width), self.pad_block, np.int32)
        tables[:have_rows, :have_width] = self.tables
        self.tables = tables
        if rows > have_rows:
            for name, fill in (("num_blocks", 0), ("temperature", 1), ("top_k", 0), ("top_p", 1), ("min_p", 0)):
                old = getattr(self, name)
                new = np.full(rows, fill, old.dtype)
                new[:have_rows] = old
                setattr(self, name, new)
