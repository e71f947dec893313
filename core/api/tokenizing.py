"""Prompts tokenized, and chat templates rendered, in worker threads: a prompt of a few megabytes takes seconds
to tokenize, which on the event loop would stall every other stream and ``/health`` with it."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread

T = TypeVar("T")

# requests a transport tokenizes at once; the others wait for a thread. Tokenizing is CPU work: more threads than
# cores gain nothing, and a flood of long prompts starts no more threads than this
MAX_THREADS = 4


class Tokenizing:
    """A transport's worker threads for tokenizing."""

    def __init__(self, max_threads: int = MAX_THREADS):
        self._limiter = anyio.CapacityLimiter(max_threads)

    async def run(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``function(*args, **kwargs)`` in a worker thread (when one is free); what it raises is raised here."""
        return await anyio.to_thread.run_sync(functools.partial(function, *args, **kwargs), limiter=self._limiter)
