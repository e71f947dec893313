"""A transport for Conveyor that speaks JSON lines over TCP, written from ``conveyor.transport.Transport`` alone.

A client connects, writes one JSON object per line, ``{"prompt": "...", "max_tokens": 16, "temperature": 0}``
(any ``SamplingParams`` field beside ``prompt``), and reads one JSON object per line back: ``{"text": ...}``
as the text comes, then ``{"text": "", "finish_reason": ..., "usage": {...}}``, or ``{"error": ...,
"status": ...}`` for a refusal. Requests on one connection run one after another; connections run at once.
The frontend does the rest: tokenizing, limits, the engine, detokenizing, the metrics.
"""

from __future__ import annotations

import json
from contextlib import aclosing
from typing import Annotated

import anyio
import msgspec

from conveyor.hookspecs import hookimpl
from conveyor.sampling import SamplingParams
from conveyor.transport import RequestError, Transport


class JSONLinesOptions(msgspec.Struct, forbid_unknown_fields=True):
    # interface to listen on (127.0.0.1: this machine only)
    host: str = "127.0.0.1"
    # 0 picks a free port
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 5557
    # longest request line, in bytes
    max_line_bytes: Annotated[int, msgspec.Meta(ge=64)] = 1 << 20


class JSONLines(Transport):
    """JSON lines over TCP: one request per line, one reply object per line."""

    name = "jsonl"
    Options = JSONLinesOptions

    async def serve(self, frontend, *, task_status=anyio.TASK_STATUS_IGNORED):
        listener = await anyio.create_tcp_listener(local_host=self.options.host, local_port=self.options.port)
        host, port = listener.extra(anyio.abc.SocketAttribute.local_address)[:2]
        task_status.started(f"jsonl://{host}:{port}")  # (printed as "Listening on ...")
        await listener.serve(lambda stream: self._connection(frontend, stream))

    async def _connection(self, frontend, stream):
        async with stream:
            pending = b""
            try:
                while True:
                    pending += await stream.receive()
                    *lines, pending = pending.split(b"\n")
                    if len(pending) > self.options.max_line_bytes:
                        await _send(stream, {"error": "the line is too long", "status": 413})
                        return
                    for line in lines:
                        if line.strip():
                            await self._request(frontend, stream, line)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                return

    async def _request(self, frontend, stream, line):
        try:
            body = json.loads(line)
            if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
                raise RequestError("each line is a JSON object with a string prompt", 400, "prompt")
            params = msgspec.convert({k: v for k, v in body.items() if k != "prompt"}, SamplingParams)
            prompt_ids = frontend.encode(body["prompt"])
            frontend.check(prompt_ids, params)
            chunks = frontend.generate(prompt_ids, params, request_id=frontend.new_request_id("jsonl"))
            async with aclosing(chunks):
                async for chunk in chunks:
                    if chunk.finish_reason is not None:
                        await _send(stream, {"text": chunk.text, "finish_reason": chunk.finish_reason, "usage": {
                            "prompt_tokens": chunk.num_prompt_tokens, "completion_tokens": chunk.num_output_tokens}})
                    elif chunk.text:
                        await _send(stream, {"text": chunk.text})
        except RequestError as e:
            await _send(stream, {"error": e.message, "status": e.status})
        except (ValueError, msgspec.ValidationError) as e:
            await _send(stream, {"error": str(e), "status": 400})


async def _send(stream, message):
    await stream.send((json.dumps(message) + "\n").encode())


@hookimpl
def conveyor_register_transports(register):
    register(JSONLines)
