"""The ``zmq`` transport: a ROUTER socket speaking the Conveyor ZMQ protocol (docs/zmq-protocol.md).

Any client with ZeroMQ and msgpack can integrate: send ``generate``, receive
``chunk`` messages until one has a ``finish_reason``; ``abort`` stops a
request. With CURVE keys in the config, only clients whose public key is in
the authorized directory can connect.
"""

from __future__ import annotations

import itertools
import logging
import time
from contextlib import aclosing
from pathlib import Path
from typing import ClassVar

import anyio
import anyio.abc
import msgspec
import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from conveyor.api.tokenizing import Tokenizing
from conveyor.plugins.transport import zmq_reply
from conveyor.plugins.transport.declarations import ZMQOptions
from conveyor.plugins.transport.zmq_reply import Reply
from conveyor.serving import protocol
from conveyor.transport import Frontend, RequestError, Transport

logger = logging.getLogger("conveyor")


class ZMQTransport(Transport):
    """External clients over a ZMQ ROUTER socket."""

    name: ClassVar[str] = "zmq"
    Options: ClassVar[type[msgspec.Struct]] = ZMQOptions

    def __init__(self, options: ZMQOptions):
        super().__init__(options)
        self._keys: tuple[bytes, bytes] | None = None
        # prompts are tokenized in these threads, not on the event loop
        self.tokenizing = Tokenizing()
        if options.curve_secret_key_file:
            if not zmq.has("curve"):
                raise ValueError("[transport] CURVE keys are set but this libzmq has no CURVE support")
            for key in ("curve_secret_key_file", "curve_authorized_keys_dir"):
                if not Path(getattr(options, key)).exists():
                    raise ValueError(f"[transport] {key} = {getattr(options, key)!r}: no such file or directory")
            public, secret = zmq.auth.load_certificate(options.curve_secret_key_file)
            if secret is None:
                raise ValueError(f"[transport] curve_secret_key_file = {options.curve_secret_key_file!r} "
                                 "holds no secret key (use the .key_secret file)")
            self._keys = (public, secret)
        # (client identity, client request id) -> the cancel scope of that request
        self._running: dict[tuple[bytes, str], anyio.CancelScope] = {}
        # numbers the requests' engine ids: a client may reuse its id once a request is over, while the engine
        # may still be ending the old one
        self._serial = itertools.count()

    async def serve(self, frontend: Frontend, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        context = zmq.asyncio.Context()
        authenticator = None
        socket = context.socket(zmq.ROUTER)
        try:
            if self._keys is not None:
                authenticator = AsyncioAuthenticator(context)
                authenticator.start()
                authenticator.configure_curve(domain="*", location=self.options.curve_authorized_keys_dir)
                socket.curve_server = True
                socket.curve_publickey, socket.curve_secretkey = self._keys
            # a bounded queue per client, and a send to a full queue or to a client that has left fails (where
            # a ROUTER would drop the message), so that the request can be aborted
            socket.setsockopt(zmq.SNDHWM, self.options.client_queue_messages)
            socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
            if self.options.send_buffer_bytes:
                socket.setsockopt(zmq.SNDBUF, self.options.send_buffer_bytes)
            socket.setsockopt(zmq.MAXMSGSIZE, self.options.max_message_bytes)
            socket.bind(self.options.address)
            task_status.started(socket.getsockopt_string(zmq.LAST_ENDPOINT))
            async with anyio.create_task_group() as tg:
                while True:
                    frames = await socket.recv_multipart()
                    self._dispatch(socket, frontend, tg, frames)
        finally:
            socket.close(linger=0)
            if authenticator is not None:
                authenticator.stop()
            context.term()

    def _dispatch(self, socket: zmq.asyncio.Socket, frontend: Frontend, tg: anyio.abc.TaskGroup,
                  frames: list[bytes]) -> None:
        identity = frames[0]
        reply = _Replier(socket, identity, self.options.slow_client_timeout_s)
        kinds = ", ".join(k.decode() for k in protocol.CLIENT_MESSAGES)
        if len(frames) != 3:
            tg.start_soon(reply.error_or_drop, None, 400,
                          f"expected two frames, a message type ({kinds}) and a msgpack map; got {len(frames) - 1}")
            return
        kind = frames[1]
        if kind not in protocol.CLIENT_DECODERS:
            tg.start_soon(reply.error_or_drop, _request_id(frames[2]), 400,
                          f"unknown message type {kind.decode(errors='replace')!r}; expected one of: {kinds}")
            return
        try:
            body = protocol.CLIENT_DECODERS[kind].decode(frames[2])
        except (msgspec.DecodeError, ValueError) as e:
            tg.start_soon(reply.error_or_drop, _request_id(frames[2]), 400, f"bad {kind.decode()} message: {e}")
            return
        if kind == b"health":
            health = protocol.HealthReply(frontend.healthy, frontend.model_name, frontend.max_model_len,
                                          frontend.num_in_flight)
            tg.start_soon(reply.send_or_drop, b"health", health)
        elif kind == b"abort":
            scope = self._running.get((identity, body.request_id))
            if scope is not None:
                scope.cancel()
        else:
            key = (identity, body.request_id)
            if key in self._running:  # (no request_id: an error would end the request in flight, for the client)
                tg.start_soon(reply.error_or_drop, None, 400, f"request_id {body.request_id!r} is already in flight; "
                              "this generate was not taken (that request goes on)")
                return
            scope = anyio.CancelScope()
            self._running[key] = scope
            tg.start_soon(self._generate, frontend, reply, body, scope)

    async def _generate(self, frontend: Frontend, replier: _Replier, request: protocol.GenerateRequest,
                        scope: anyio.CancelScope) -> None:
        rid = request.request_id
        reply = Reply(rid, None, request.stream)
        try:
            with scope:
                try:
                    prompt_ids, reply.reader = await zmq_reply.prompt(frontend, self.tokenizing, request)
                    frontend.check(prompt_ids, request.params)
                    lora = frontend.adapter(request.model)
                    internal_id = f"zmq-{replier.identity.hex()}-{next(self._serial)}-{rid}"
                    chunks = frontend.generate(prompt_ids, request.params, request_id=internal_id,
                                               priority=request.priority, lora=lora)
                    async with aclosing(chunks):
                        async for chunk in chunks:
                            if (message := reply.add(chunk)) is not None:
                                await replier.send(b"chunk", message)
                except RequestError as e:
                    await replier.error(rid, e.status, e.message, e.retry_after)
            if scope.cancel_called:  # the client aborted it
                await replier.send(b"chunk", reply.aborted())
        except _ClientGone as e:  # (leaving the stream above aborted the request in the engine, if still running)
            logger.warning("zmq client %s: %s; request %r ends without its reply", replier.identity.hex(), e, rid)
        finally:
            self._running.pop((replier.identity, rid), None)


def _request_id(body: bytes) -> str | None:
    """The request_id a message that could not be taken carries, where it is a map with a string one."""
    try:
        message = msgspec.msgpack.decode(body)
    except msgspec.DecodeError:
        return None
    request_id = message.get("request_id") if isinstance(message, dict) else None
    return request_id if isinstance(request_id, str) else None


class _ClientGone(Exception):
    """The client has disconnected, or has not read its messages for the slow-client timeout."""


class _Replier:
    def __init__(self, socket: zmq.asyncio.Socket, identity: bytes, timeout: float):
        self.socket = socket
        self.identity = identity
        self.timeout = timeout

    async def send(self, kind: bytes, body: msgspec.Struct) -> None:
        """Queue a message for the client; while its queue is full, wait for room (a blocking send would hold up
        every client's messages behind this one's). Raises _ClientGone."""
        frames = [self.identity, *protocol.encode(kind, body)]
        deadline = time.monotonic() + self.timeout
        delay = 0.001
        while True:
            try:
                await self.socket.send_multipart(frames, flags=zmq.DONTWAIT)
                return
            except zmq.Again:
                if time.monotonic() > deadline:
                    raise _ClientGone(f"read nothing for {self.timeout:g} s with its queue full") from None
            except zmq.ZMQError as e:
                if e.errno != zmq.EHOSTUNREACH:
                    raise
                raise _ClientGone("disconnected") from None
            await anyio.sleep(delay)
            delay = min(2 * delay, 0.05)

    async def send_or_drop(self, kind: bytes, body: msgspec.Struct) -> None:
        """``send``, for a message with no request behind it: a client that has gone misses it."""
        try:
            await self.send(kind, body)
        except _ClientGone as e:
            logger.info("zmq client %s: %s; a %s message was dropped", self.identity.hex(), e, kind.decode())

    async def error(self, request_id: str | None, status: int, message: str, retry_after: float = 0.0) -> None:
        await self.send(b"error", protocol.ErrorReply(request_id, status, message, retry_after))

    async def error_or_drop(self, request_id: str | None, status: int, message: str) -> None:
        await self.send_or_drop(b"error", protocol.ErrorReply(request_id, status, message))
