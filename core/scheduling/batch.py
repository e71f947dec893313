"""What one step runs (``ScheduledBatch``) and the queue waiting requests keep (``WaitingQueue``)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from conveyor.request import Request


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


class WaitingQueue:
    """Requests waiting to run, smallest key first; a request's key is taken as it enters."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple, int, Request]] = []
        self._order = itertools.count()

    def push(self, request: Request, key: tuple) -> None:
        heapq.heappush(self._heap, (key, next(self._order), request))

    def peek(self) -> Request:
        return self._heap[0][2]

    def remove(self, request: Request) -> None:
        if self._heap and self._heap[0][2] is request:
            heapq.heappop(self._heap)
            return
        self._heap = [entry for entry in self._heap if entry[2] is not request]
        heapq.heapify(self._heap)

    def rekey(self, key_of: Callable[[Request], tuple]) -> None:
        """Every request's key taken again (``key_of``), keeping the order of equal keys."""
        self._heap = [(key_of(request), order, request) for _, order, request in self._heap]
        heapq.heapify(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In key order."""
        return (entry[2] for entry in sorted(self._heap))

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)
