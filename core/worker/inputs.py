"""A step's input tensors, in buffers allocated once and written in place: the one place they are built.

Per step the runner writes every token's id and position, every token's KV
cache slot, the requests' block tables, context lengths and (prompt chunks)
first rows, lengths and starts, into buffers that live as long as the
worker, and hands out views of their first rows: the token ids and positions
the model embeds, and the plans the attention backend reads (``DecodeTables``,
``PrefillTables``). The compiled decode graphs take the same buffers, padded
to their batch size. Positions and slots are computed in numpy over whole
arrays, not per token in Python.

The buffers grow (doubling) when a step needs more than they hold, so they
settle after the first large steps. On the CPU a view is the buffer itself;
on CUDA each buffer has a pinned host copy that is written and then copied
to the device without blocking (a host copy is written again only after
the step that read it returned its tokens, which waits for the device).

The block tables of the worker's requests live in their rows
(``conveyor.worker.rows``), appended to as steps grow them: a step gathers
its requests' rows by index in one numpy operation. A step whose entries
carry whole tables of their own (the draft model's proposals) writes them
request by request. A table row keeps what an earlier, longer request left
past its own blocks: a kernel reads only the blocks its context length
covers, and every entry is a block of the pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np
import torch

from conveyor.attention.backend import AttentionBackend, DecodeTables, PrefillTables, StepAttention
from conveyor.messages import StepInput

if TYPE_CHECKING:
    from conveyor.worker.rows import BatchRows


class Buffer:
    """One buffer: a numpy view to write into and the tensor the device reads (the same memory on the CPU)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, fill: int = 0):
        cuda = device.type == "cuda"
        self.host = torch.full(shape, fill, dtype=dtype, pin_memory=cuda)
        self.array = self.host.numpy()
        self.device = torch.full(shape, fill, dtype=dtype, device=device) if cuda else self.host

    def view(self, rows: int) -> torch.Tensor:
        """The first ``rows`` rows as the device reads them (copied there first on CUDA)."""
        if self.device is not self.host:
            self.device[:rows].copy_(self.host[:rows], non_blocking=True)
        return self.device[:rows]


@dataclass
class StepTensors:
    """Views of one step's inputs in the buffers."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: StepAttention


class InputBuffers:
    """The runner's input buffers (one per model: the draft model has its own)."""

    def __init__(self, block_size: int, device: torch.device, tokens: int = 256, rows: int = 64, width: int = 16,
                 pad_block: int = 0):
        """
        Args:
            tokens, rows, width: what the buffers hold at first (tokens a step; requests a step, or tokens in
                batch-invariant mode; blocks a table).
            pad_block: what table entries hold before any request wrote them.
        """
        self.block_size = block_size
        self.device = device
        self.pad_block = pad_block
        self._allocate(tokens, rows, width)

    def _allocate(self, tokens: int, rows: int, width: int) -> None:
        device = self.device
        self.tokens, self.rows, self.width = tokens, rows, width
        self.input_ids = Buffer((tokens,), torch.long, device)
        self.positions = Buffer((tokens,), torch.long, device)
        self.slot_mapping = Buffer((tokens,), torch.long, device)
        self.block_tables = Buffer((rows, width), torch.int32, device, self.pad_block)
        self.context_lens = Buffer((rows,), torch.int32, device, 1)
        self.chunk_rows = Buffer((rows,), torch.int32, device)
        self.chunk_lens = Buffer((rows,), torch.int32, device)
        self.chunk_starts = Buffer((rows,), torch.int32, device)

    def reserve(self, tokens: int, rows: int, width: int) -> None:
        """Room for at least this much (buffers grown are new: what they held is gone)."""
        if tokens > self.tokens or rows > self.rows or width > self.width:
            self._allocate(grown(self.tokens, tokens), grown(self.rows, rows), grown(self.width, width))

    def write(self, step: StepInput, rows: BatchRows | None = None,
              every_token: bool = False) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """Write the step's token ids, positions, slots, block tables and context lengths (a table per request,
        or per token with ``every_token``, each token then a decode over what is cached up to it: the backend's
        ``prefills_as_decodes``).

        Args:
            rows: the rows holding the requests' tables; None: each entry's ``block_ids`` is its whole table.

        Returns:
            The step's tokens, and each request's tokens, start and first row.
        """
        requests = step.requests
        n = len(requests)
        lens = np.fromiter((len(r.token_ids) for r in requests), np.int64, n)
        starts = np.fromiter((r.start for r in requests), np.int64, n)
        total = int(lens.sum())
        index = None if rows is None else rows.index(requests)
        width = max(len(r.block_ids) for r in requests) if index is None else int(rows.num_blocks[index].max())
        self.reserve(total, total if every_token else n, width)
        self.input_ids.array[:total] = np.fromiter(chain.from_iterable(r.token_ids for r in requests), np.int64, total)
        owner = np.repeat(np.arange(n), lens)
        first_rows = np.cumsum(lens) - lens
        positions = np.arange(total) - first_rows[owner] + starts[owner]
        self.positions.array[:total] = positions
        tables = self.block_tables.array
        if index is None:
            for i, request in enumerate(requests):
                tables[i, : len(request.block_ids)] = request.block_ids
        else:
            tables[:n, :width] = rows.tables[index, :width]
        size = self.block_size
        self.slot_mapping.array[:total] = tables[owner, positions // size].astype(np.int64) * size + positions % size
        if every_token:
            tables[:total] = tables[owner]  # (rows past n first: each token's row is its request's, i <= token)
            self.context_lens.array[:total] = positions + 1
        else:
            self.context_lens.array[:n] = starts + lens
        return total, lens, starts, first_rows

    def prepare(self, step: StepInput, backend: AttentionBackend, rows: BatchRows | None = None) -> StepTensors:
        """The step's inputs in the buffers, and its attention function over ``backend`` (``rows``: as in
        ``write``)."""
        every_token = backend.prefills_as_decodes
        total, lens, starts, first_rows = self.write(step, rows, every_token)
        slots = self.slot_mapping.view(total)
        decodes = prefills = None
        n = len(step.requests)
        num_decodes = total if every_token else step.num_decodes
        tables = self.block_tables.view(total if every_token else n)  # (one copy to the device for both parts)
        if num_decodes:
            decodes = DecodeTables(tables[:num_decodes], self.context_lens.view(num_decodes))
        if not every_token and num_decodes < n:
            chunks = slice(num_decodes, n)
            count = n - num_decodes
            self.chunk_rows.array[:count] = first_rows[chunks]
            self.chunk_lens.array[:count] = lens[chunks]
            self.chunk_starts.array[:count] = starts[chunks]
            prefills = PrefillTables(tables[num_decodes:], self.chunk_rows.view(count),
                                     self.chunk_lens.view(count), self.chunk_starts.view(count), int(lens[chunks].max()))
        attention = StepAttention(backend, slots, decodes, prefills)
        return StepTensors(self.input_ids.view(total), self.positions.view(total), attention)


def grown(have: int, need: int) -> int:
    """``have`` doubled until it holds ``need``."""
    while have < need:
        have *= 2
    return have
