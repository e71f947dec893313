"""The engine core's structured-output requests: grammars compiling, and one matcher per running request.

A request with ``params.structured`` waits here while its grammar compiles
(off the step loop, in one thread), then joins the scheduler with a matcher.
Before a step samples for it, its matcher fills its row of the step's token
bitmask; after the step, the sampled token advances the matcher.

The grammar engine is set up in that thread when the first structured
request comes (as vLLM does): reading the tokenizer's vocabulary and importing
xgrammar take about 4.5 s for SmolLM2's GGUF on a 2-core CPU, which that
request waits for and the others running do not; an engine that never sees
one never pays it.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from conveyor.config import Config
from conveyor.request import Request, RequestRejected

if TYPE_CHECKING:
    from conveyor.structured import Grammars


class GrammarRequests:
    def __init__(self, config: Config, vocab_size: int):
        self.config = config
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="conveyor-grammar")
        self._grammars: Future[Grammars] | None = None
        # request id -> (the request, its grammar compiling)
        self.compiling: dict[str, tuple[Request, Future]] = {}
        # request id -> the matcher of a request the scheduler holds
        self.matchers: dict[str, object] = {}

    def _build(self) -> Grammars:
        from conveyor.model.tokenizer import load_tokenizer
        from conveyor.structured import Grammars

        return Grammars(load_tokenizer(self.config.model, self.config.source), self.vocab_size)

    @property
    def grammars(self) -> Grammars:
        """The grammar engine (in the pool's thread: set up on first use; elsewhere: once a grammar compiled).

        Raises:
            Exception: what setting it up raised (structured requests then fail; the others run).
        """
        if self._grammars is None:
            self._grammars = Future()
            try:
                self._grammars.set_result(self._build())
            except Exception as e:  # noqa: BLE001 - kept: every structured request reports it
                self._grammars.set_exception(e)
        return self._grammars.result()

    def add(self, request: Request) -> None:
        """Start compiling the request's grammar.

        Raises:
            RequestRejected: the id is already waiting here.
        """
        if request.request_id in self.compiling:
            raise RequestRejected(f"request id {request.request_id!r} is already in use")
        spec = request.params.structured
        self.compiling[request.request_id] = (request, self._pool.submit(lambda: self.grammars.compile(spec)))

    def take_compiled(self) -> list[tuple[Request, str | None]]:
        """Requests whose grammar is ready (their matcher kept), or failed (with the reason)."""
        done = []
        for request_id, (request, future) in list(self.compiling.items()):
            if not future.done():
                continue
            del self.compiling[request_id]
            try:
                self.matchers[request_id] = self.grammars.matcher(future.result())
                done.append((request, None))
            except Exception as e:  # noqa: BLE001 - a grammar that does not compile fails its request (400)
                done.append((request, f"structured output: the grammar cannot be compiled: {e}"))
        return done

    def abort(self, request_ids: list[str]) -> list[Request]:
        """Drop requests still compiling; returns them."""
        dropped = []
        for request_id in request_ids:
            entry = self.compiling.pop(request_id, None)
            if entry is not None:
                entry[1].cancel()
                dropped.append(entry[0])
        return dropped

    def forget(self, request_ids: list[str]) -> None:
        """Drop the matchers of requests that ended."""
        for request_id in request_ids:
            self.matchers.pop(request_id, None)

    def bitmask(self, request_ids: list[str | None]) -> tuple[list[int], bytes]:
        """For the entries of a step that sample (their ids; None for the others): the entries under a grammar,
        and their rows of the token bitmask (int32, little-endian)."""
        rows = [i for i, request_id in enumerate(request_ids) if request_id in self.matchers]
        if not rows:
            return [], b""
        mask = self.grammars.bitmask([self.matchers[request_ids[i]] for i in rows])
        return rows, mask.numpy().tobytes()

    def advance(self, requests: list[Request], sampled: list[int | None]) -> list[Request]:
        """Feed each request its sampled token; returns the requests whose grammar is complete (ended by its
        stop token) or that took a token the grammar refuses, which end here."""
        ended = []
        for request, token in zip(requests, sampled):
            matcher = self.matchers.get(request.request_id)
            if matcher is None or token is None or request.is_finished:
                continue
            if not matcher.accept_token(token) or matcher.is_terminated():
                ended.append(request)
        return ended

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
