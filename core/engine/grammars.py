"""The engine core's structured-output requests: grammars compiling, and one matcher per running request.

A request with ``params.structured`` waits at this scheduler gate
(``WAITING_FOR_GRAMMAR``) while its grammar compiles (off the step loop, in
one thread), then goes on to the waiting queue with a matcher; one whose
language does not compile ends there with a 400 (the frontend never parses
a language: this compile is the check).
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
from conveyor.gates import AdmissionGate
from conveyor.request import Request, RequestStatus

if TYPE_CHECKING:
    from conveyor.structured import Grammars


class GrammarRequests(AdmissionGate):
    status = RequestStatus.WAITING_FOR_GRAMMAR
    param = "structured"

    def __init__(self, config: Config, vocab_size: int):
        self.config = config
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="conveyor-grammar")
        self._grammars: Future[Grammars] | None = None
        # request id -> its grammar compiling
        self.compiling: dict[str, Future] = {}
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

    def holds(self, request: Request) -> bool:
        """Whether the request waits for a grammar (it starts compiling)."""
        spec = request.params.structured
        if spec is None:
            return False
        self.compiling[request.request_id] = self._pool.submit(lambda: self.grammars.compile(spec))
        return True

    def release(self, held: list[Request], idle: bool) -> tuple[list[Request], list[tuple[Request, str]]]:
        """The requests whose grammar is ready (their matcher kept), and those whose grammar failed, with why."""
        ready, failed = [], []
        for request in held:
            future = self.compiling[request.request_id]
            if not future.done():
                continue
            del self.compiling[request.request_id]
            try:
                self.matchers[request.request_id] = self.grammars.matcher(future.result())
                ready.append(request)
            except ValueError as e:  # the language does not compile: the request ends with a 400 saying why
                failed.append((request, f"structured output: {e}"))
            except Exception as e:  # noqa: BLE001 - the grammar engine could not start: every structured request
                failed.append((request, f"structured output: the grammar engine failed: {type(e).__name__}: {e}"))
        return ready, failed

    def forget(self, request: Request) -> None:
        """Drop the grammar compiling or the matcher of a request that ended."""
        future = self.compiling.pop(request.request_id, None)
        if future is not None:
            future.cancel()
        self.matchers.pop(request.request_id, None)

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
