"""The engine core's structured-output requests: grammars compiling, and one matcher per running request.

A request with ``params.structured`` waits at this scheduler gate
(``WAITING_FOR_GRAMMAR``) while its grammar compiles (off the step loop, in
one thread), then goes on to the waiting queue with a matcher; one whose
language does not compile ends there with a 400 (the frontend never parses
a language: this compile is the check).
Before a step samples for it, its matcher fills its row of the step's token
bitmask; after the step, the scheduler's ``update`` hands it the sampled token
(``ends``), which advances the matcher and may end the request.

An answer under a grammar must also end within ``max_tokens``: a small model
can stay inside an unbounded integer or string until the budget runs out and
return text that does not parse. So as the budget runs down, the tokens of a
short completion of the grammar from where the answer stands
(``Grammars.closing``) are counted, at checks that come closer together as
the budget nears them; once only those tokens (and the stop token) are left,
they are forced, one a step: the answer completes the grammar whenever the
budget allows it to, and its output says it was closed.

The grammar engine is set up in that thread when the first structured
request comes (as vLLM does): reading the tokenizer's vocabulary and importing
xgrammar take about 4.5 s for SmolLM2's GGUF on a 2-core CPU, which that
request waits for and the others running do not; an engine that never sees
one never pays it.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from conveyor.config import Config
from conveyor.scheduling.gates import AdmissionGate
from conveyor.request import Request, RequestStatus

if TYPE_CHECKING:
    from conveyor.engine.structured import Grammars


# tokens kept in hand when an answer's closing is forced: one token may open several levels of nesting before
# the next check counts them
CLOSING_MARGIN = 3
# from this many tokens of slack on, the completion is counted again at every step
CLOSING_EVERY_STEP = 32


@dataclass
class _Closing:
    """One request's closing: the tokens forced from here on (once they are due), and the budget left at which
    its completion is counted again."""

    forced: deque[int] = field(default_factory=deque)
    check_at: int | None = None  # None: at the next step


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
        # request id -> how its answer is brought to a close within its max_tokens
        self.closings: dict[str, _Closing] = {}

    def _build(self) -> Grammars:
        from conveyor.model.tokenizer import load_tokenizer
        from conveyor.engine.structured import Grammars

        return Grammars(load_tokenizer(self.config.model, self.config.source_of("model")), self.vocab_size)

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
                self.closings[request.request_id] = _Closing()
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
        self.closings.pop(request.request_id, None)

    def bitmask(self, requests: list[Request | None]) -> tuple[list[int], bytes]:
        """For the entries of a step that sample (their requests; None for the others): the entries under a
        grammar, and their rows of the token bitmask (int32, little-endian); a row whose answer is being closed
        allows only its next forced token."""
        rows = [i for i, request in enumerate(requests) if request is not None and request.request_id in self.matchers]
        if not rows:
            return [], b""
        mask = self.grammars.bitmask([self.matchers[requests[i].request_id] for i in rows])
        for row, i in enumerate(rows):
            token = self._forced(requests[i])
            if token is not None:
                mask[row] = 0
                bit = 1 << (token % 32)
                mask[row, token // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit
        return rows, mask.numpy().tobytes()

    def _forced(self, request: Request) -> int | None:
        """The token the request must take now for its answer to complete the grammar within its budget."""
        closing = self.closings[request.request_id]
        if closing.forced:
            return closing.forced[0]
        left = request.max_total_tokens - request.num_tokens  # (this step's token included)
        if closing.check_at is not None and left > closing.check_at:
            return None
        closing.check_at = None
        tokens = self.grammars.closing(self.matchers[request.request_id])
        if not tokens:  # complete already (the stop token may come), or no completion found from here (e.g.
            return None  # inside a character of several bytes): looked for again at the next step
        slack = left - len(tokens) - 1 - CLOSING_MARGIN  # (one token more for the stop token)
        if slack <= 0:
            closing.forced.extend(tokens)
            request.closing = True  # (the scheduler ends it by length, saying so)
            return tokens[0]
        if slack > CLOSING_EVERY_STEP:
            closing.check_at = left - slack // 4  # (a completion grows by a few tokens a token at most)
        return None

    def ends(self, request: Request, token: int) -> bool:
        """Feed the request its sampled token; whether its grammar is complete (ended by its stop token) or refused
        the token: the request ends there."""
        matcher = self.matchers.get(request.request_id)
        if matcher is None:
            return False
        forced = self.closings[request.request_id].forced
        if forced and forced[0] == token:
            forced.popleft()
        return not matcher.accept_token(token) or matcher.is_terminated()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
