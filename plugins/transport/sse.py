"""Server-sent events and errors in each HTTP API's own words: OpenAI's (completions, chat completions,
Responses) and Anthropic's (Messages)."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from conveyor.api import anthropic_api, responses_api
from conveyor.api import openai_api as api
from conveyor.api.openai_call import Emit
from conveyor.transport import RequestError


def json_response(body: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status, media_type="application/json")


ErrorBody = Callable[[str, int, "str | None"], dict[str, Any]]
# the line breaks of str.splitlines that JSON may carry raw, and their escapes
LINE_BREAKS = [(chr(c).encode(), f"\\u{c:04x}".encode()) for c in (0x85, 0x2028, 0x2029)]


@dataclass(frozen=True)
class Dialect:
    """How one API words its errors and frames its server-sent events."""

    # a refusal's JSON body (message, status, the field to blame)
    error_body: ErrorBody
    # an error after the stream's 200 went out, as an event
    error_event: ErrorBody
    # each event has an ``event:`` line naming its ``type`` (Anthropic's and the Responses API's streams)
    named_events: bool = False
    # the stream ends with ``data: [DONE]`` (completions and chat completions)
    done: bool = True


OPENAI = Dialect(api.error_body, api.error_body)
RESPONSES = Dialect(api.error_body, responses_api.error_event, named_events=True, done=False)
ANTHROPIC = Dialect(anthropic_api.error_body, anthropic_api.error_body, named_events=True, done=False)


def error_response(error: RequestError, dialect: Dialect = OPENAI) -> Response:
    """The refusal as JSON in the dialect's words, with a Retry-After header (whole seconds) where it says one."""
    response = json_response(dialect.error_body(error.message, error.status, error.param), error.status)
    if error.retry_after > 0:
        response.headers["retry-after"] = str(math.ceil(error.retry_after))
    return response


class EventStream:
    """An SSE response fed by ``produce(emit, begin)``: ``begin()`` sends the status (200) and the headers, as the
    first ``emit`` does, and an error raised before that is a JSON error response with its own status. The client
    leaving cancels the producer."""

    def __init__(self, produce: Callable[[Emit, Callable[[], Awaitable[None]]], Awaitable[Any]],
                 dialect: Dialect = OPENAI):
        self.produce = produce
        self.dialect = dialect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")]
        started = False

        async def begin() -> None:
            nonlocal started
            if not started:
                started = True
                await send({"type": "http.response.start", "status": 200, "headers": headers})

        dialect = self.dialect

        async def emit(event: dict[str, Any]) -> None:
            await begin()
            name = b"event: " + event["type"].encode() + b"\n" if dialect.named_events else b""
            # (U+0085, U+2028 and U+2029 escaped: valid raw in JSON, but line readers that split as str.splitlines
            # does, httpx's iter_lines among them, would cut the event in two; msgspec escapes the others)
            data = msgspec.json.encode(event)
            for raw, escaped in LINE_BREAKS:
                data = data.replace(raw, escaped)
            body = name + b"data: " + data + b"\n\n"
            await send({"type": "http.response.body", "body": body, "more_body": True})

        try:
            finished = await until_disconnect(receive, self.produce(emit, begin))
        except RequestError as e:
            if not started:
                await error_response(e, dialect)(scope, receive, send)
                return
            await emit(dialect.error_event(e.message, e.status, e.param))  # after the 200 went out: an event
            finished = True
        except OSError:  # the connection broke while sending
            return
        if not finished:
            return
        await begin()
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n" if dialect.done else b"",
                    "more_body": False})


async def until_disconnect(receive: Receive, work: Awaitable[Any]) -> bool:
    """Run ``work``; cancel it if the client disconnects first. Returns True when it finished."""
    finished = False
    error: RequestError | OSError | None = None
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            await work
            finished = True
        except (RequestError, OSError) as e:  # past the task group it would arrive in an ExceptionGroup
            error = e
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return finished
