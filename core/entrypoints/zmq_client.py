"""Python clients for the Conveyor ZMQ protocol (docs/zmq-protocol.md).

    from conveyor.entrypoints.zmq_client import Client

    with Client("tcp://127.0.0.1:5556") as client:
        print(client.generate("The capital of France is", max_tokens=8, temperature=0).text)
        for chunk in client.stream(messages=[{"role": "user", "content": "Hi!"}], max_tokens=32):
            print(chunk.text, end="", flush=True)

``AsyncClient`` does the same with ``await``/``async for`` and can run many
requests at once over one socket. Sampling fields are ``SamplingParams``
keyword arguments (max_tokens, temperature, top_p, top_k, seed, stop, ...);
``model`` picks a LoRA adapter the server serves.
"""

from __future__ import annotations

import itertools
import math
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec
import zmq
import zmq.asyncio
from anyio.streams.memory import MemoryObjectSendStream

from conveyor.sampling import SamplingParams
from conveyor.serving.protocol import (
    AbortRequest,
    ErrorReply,
    GenerateRequest,
    HealthReply,
    HealthRequest,
    Logprob,
    StreamChunk,
    ToolCall,
    Usage,
    decode_reply,
    encode,
)

__all__ = ["AsyncClient", "Client", "Completion", "ServerError"]


class ServerError(RuntimeError):
    """The server refused or failed a request; ``status`` is its HTTP-style code (400, 429, 503, ...), and
    ``retry_after`` the seconds after which it may succeed (0: not said)."""

    def __init__(self, status: int, message: str, retry_after: float = 0.0):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.retry_after = retry_after


class Completion(msgspec.Struct):
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage | None
    logprobs: list[Logprob] | None = None
    # a chat turn's thinking (a server with [model] reasoning_parser), kept out of text
    reasoning: str = ""
    # a chat turn with tools: the calls read from the reply, each whole
    tool_calls: list[ToolCall] | None = None


class _Base:
    def __init__(
        self,
        address: str,
        *,
        timeout: float = 120.0,
        server_public_key_file: str | Path | None = None,
        secret_key_file: str | Path | None = None,
    ):
        """
        Args:
            address: the server's ZMQ address, e.g. "tcp://127.0.0.1:5556".
            timeout: seconds to wait for each reply before giving up.
            server_public_key_file: with CURVE, the server's public key file (NAME.key) ...
            secret_key_file: ... and this client's secret key file (NAME.key_secret).
        """
        self.address = address
        self.timeout = timeout
        self._curve: tuple[bytes, bytes, bytes] | None = None
        if (server_public_key_file is None) != (secret_key_file is None):
            raise ValueError("CURVE needs both server_public_key_file and secret_key_file")
        if server_public_key_file is not None:
            server_public, _ = zmq.auth.load_certificate(server_public_key_file)
            public, secret = zmq.auth.load_certificate(secret_key_file)
            if secret is None:
                raise ValueError(f"{secret_key_file}: holds no secret key (use the .key_secret file)")
            self._curve = (server_public, public, secret)
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]

    def _configure(self, socket: zmq.Socket) -> None:
        socket.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:
            socket.curve_serverkey, socket.curve_publickey, socket.curve_secretkey = self._curve
        socket.connect(self.address)

    def _request(self, prompt: str | list[int] | None, messages: list[dict[str, Any]] | None, stream: bool,
                 request_id: str | None, priority: int, model: str | None,
                 params: dict[str, Any]) -> GenerateRequest:
        """The generate message: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (with ``messages``) go with
        the request, the other keywords are ``SamplingParams`` fields."""
        chat = {name: params.pop(name) for name in ("tools", "tool_choice", "parallel_tool_calls") if name in params}
        return GenerateRequest(
            request_id or f"{self._prefix}-{next(self._ids)}",
            prompt,
            messages,
            SamplingParams(**params),
            stream,
            priority,
            model,
            **chat,
        )


def _completion(request_id: str, chunks: list[StreamChunk]) -> Completion:
    last = chunks[-1]
    logprobs = [lp for c in chunks for lp in (c.logprobs or [])]
    calls: dict[int, ToolCall] = {}
    for piece in (p for c in chunks for p in c.tool_calls or []):
        call = calls.setdefault(piece.index, ToolCall(piece.index))
        call.id, call.name = call.id or piece.id, call.name or piece.name
        call.arguments += piece.arguments
    return Completion(
        request_id,
        "".join(c.text for c in chunks),
        [t for c in chunks for t in c.token_ids],
        last.finish_reason or "",
        last.usage,
        logprobs or None,
        "".join(c.reasoning for c in chunks),
        [calls[i] for i in sorted(calls)] or None,
    )


class Client(_Base):
    """A blocking client; one request at a time (use AsyncClient for many at once)."""

    def __init__(self, address: str, **kwargs: Any):
        super().__init__(address, **kwargs)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._configure(self._socket)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()

    def _receive(self) -> StreamChunk | ErrorReply | HealthReply:
        if not self._socket.poll(int(self.timeout * 1000)):
            raise TimeoutError(f"no reply from {self.address} within {self.timeout:.0f} s "
                               "(is the server up? with CURVE, are the keys right?)")
        return decode_reply(self._socket.recv_multipart())

    def health(self) -> HealthReply:
        self._socket.send_multipart(encode(b"health", HealthRequest()))
        while not isinstance(reply := self._receive(), HealthReply):
            pass  # replies to requests abandoned earlier
        return reply

    def stream(self, prompt: str | list[int] | None = None, *, messages: list[dict[str, Any]] | None = None,
               request_id: str | None = None, priority: int = 0, model: str | None = None,
               **params: Any) -> Iterator[StreamChunk]:
        """Yield chunks until the final one (it carries finish_reason and usage).

        Raises:
            ServerError: the server refused or failed the request.
        """
        request = self._request(prompt, messages, True, request_id, priority, model, params)
        yield from self._follow(request)

    def generate(self, prompt: str | list[int] | None = None, *, messages: list[dict[str, Any]] | None = None,
                 request_id: str | None = None, priority: int = 0, model: str | None = None,
                 **params: Any) -> Completion:
        """The whole completion at once."""
        request = self._request(prompt, messages, False, request_id, priority, model, params)
        return _completion(request.request_id, list(self._follow(request)))

    def _follow(self, request: GenerateRequest) -> Iterator[StreamChunk]:
        self._socket.send_multipart(encode(b"generate", request))
        finished = False
        try:
            while not finished:
                reply = self._receive()
                if getattr(reply, "request_id", None) != request.request_id:
                    continue
                if isinstance(reply, ErrorReply):
                    finished = True
                    raise ServerError(reply.status, reply.message, reply.retry_after)
                finished = reply.finish_reason is not None
                yield reply
        finally:
            if not finished:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request; the server answers with a final chunk whose finish_reason is "abort"."""
        self._socket.send_multipart(encode(b"abort", AbortRequest(request_id)))


class AsyncClient(_Base):
    """An asyncio client; many requests at once over one socket.

    Use it as ``async with AsyncClient(address) as client:``; a reader task
    routes replies to their requests.
    """

    def __init__(self, address: str, **kwargs: Any):
        super().__init__(address, **kwargs)
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._streams: dict[str, MemoryObjectSendStream[StreamChunk | ErrorReply]] = {}
        self._health: list[MemoryObjectSendStream[HealthReply]] = []
        self._task_group: anyio.abc.TaskGroup | None = None

    async def __aenter__(self) -> AsyncClient:
        self._configure(self._socket)
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        self._task_group.start_soon(self._read)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task_group is not None
        self._task_group.cancel_scope.cancel()
        await self._task_group.__aexit__(None, None, None)
        self._socket.close(linger=0)
        self._context.term()

    async def _read(self) -> None:
        while True:
            reply = decode_reply(await self._socket.recv_multipart())
            if isinstance(reply, HealthReply):
                waiters, self._health = self._health, []
                for waiter in waiters:
                    try:
                        waiter.send_nowait(reply)
                    except anyio.BrokenResourceError:  # (it gave up waiting)
                        pass
                    waiter.close()
                continue
            stream = self._streams.get(reply.request_id or "")
            if stream is not None:
                stream.send_nowait(reply)

    async def health(self) -> HealthReply:
        send, receive = anyio.create_memory_object_stream[HealthReply](1)
        self._health.append(send)
        try:
            await self._socket.send_multipart(encode(b"health", HealthRequest()))
            with anyio.fail_after(self.timeout):
                async with receive:
                    return await receive.receive()
        finally:
            if send in self._health:  # (timed out: the late reply finds no one)
                self._health.remove(send)

    async def stream(self, prompt: str | list[int] | None = None, *, messages: list[dict[str, Any]] | None = None,
                     request_id: str | None = None, priority: int = 0, model: str | None = None,
                     **params: Any) -> AsyncIterator[StreamChunk]:
        """Yield chunks until the final one; leaving early aborts the request."""
        request = self._request(prompt, messages, True, request_id, priority, model, params)
        async with aclosing(self._follow(request)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def generate(self, prompt: str | list[int] | None = None, *, messages: list[dict[str, Any]] | None = None,
                       request_id: str | None = None, priority: int = 0, model: str | None = None,
                       **params: Any) -> Completion:
        request = self._request(prompt, messages, False, request_id, priority, model, params)
        return _completion(request.request_id, [chunk async for chunk in self._follow(request)])

    async def _follow(self, request: GenerateRequest) -> AsyncIterator[StreamChunk]:
        if self._task_group is None:
            raise RuntimeError("use the client as `async with AsyncClient(address) as client:`")
        rid = request.request_id
        if rid in self._streams:
            raise ValueError(f"request_id {rid!r} is already in flight")
        send, receive = anyio.create_memory_object_stream[StreamChunk | ErrorReply](math.inf)
        self._streams[rid] = send
        finished = False
        try:
            await self._socket.send_multipart(encode(b"generate", request))
            async with receive:
                while not finished:
                    with anyio.fail_after(self.timeout):
                        reply = await receive.receive()
                    if isinstance(reply, ErrorReply):
                        finished = True
                        raise ServerError(reply.status, reply.message, reply.retry_after)
                    finished = reply.finish_reason is not None
                    yield reply
        finally:
            del self._streams[rid]
            if not finished:
                with anyio.CancelScope(shield=True):
                    await self.abort(rid)

    async def abort(self, request_id: str) -> None:
        await self._socket.send_multipart(encode(b"abort", AbortRequest(request_id)))
