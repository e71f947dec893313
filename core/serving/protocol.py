"""The ZMQ client protocol: what external clients send to the ``zmq`` transport and what they get back.

docs/zmq-protocol.md is the reference for client authors in any language.
Each message is two frames after the ROUTER's identity frame: the message
type as ASCII (``generate``, ``abort``, ``health``; replies ``chunk``,
``error``, ``health``) and a msgpack map. Unknown keys are ignored, so
clients and servers can grow fields independently.
"""

from __future__ import annotations

from typing import Any

import msgspec

from conveyor.sampling import SamplingParams


class GenerateRequest(msgspec.Struct, omit_defaults=True):
    # chosen by the client; unique among its own requests in flight
    request_id: str
    # a text or token ids; or give messages (a chat conversation) instead
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    # true: a chunk per new piece of text; false: one chunk with everything at the end
    stream: bool = True
    # lower runs first under the priority policy
    priority: int = 0
    # a LoRA adapter's name (or BASE:NAME); None or the served model's name: the base model
    model: str | None = None
    # with messages: the functions the model may call, in OpenAI's chat shape ({"type": "function", "function":
    # {"name", "description", "parameters"}}), and which it must: "none", "auto" (the default with tools),
    # "required", or {"type": "function", "function": {"name": ...}}
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    # false: at most one call is read from the reply
    parallel_tool_calls: bool | None = None


class AbortRequest(msgspec.Struct):
    request_id: str


class HealthRequest(msgspec.Struct):
    pass


class Logprob(msgspec.Struct):
    token_id: int
    logprob: float
    # the most likely alternatives, best first
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    # prompt tokens served from the prefix cache
    cached_tokens: int = 0


class ToolCall(msgspec.Struct, omit_defaults=True):
    """A tool call, or a piece of one: the call's first piece has its id and name; each piece adds to its
    arguments (their concatenation is the call's arguments, JSON text)."""

    # the call's place among the reply's calls
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class StreamChunk(msgspec.Struct):
    request_id: str
    # new text (whole characters; a pending stop string is held back); with messages, the answer only: thinking
    # and tool calls are taken out of it
    text: str = ""
    token_ids: list[int] = []
    # one per token in token_ids, when params.logprobs was set
    logprobs: list[Logprob] | None = None
    # "stop", "length", "tool_calls" (the reply is whole tool calls) or "abort" on the last chunk of a request
    finish_reason: str | None = None
    # on the last chunk
    usage: Usage | None = None
    # with params.pooling, on the last chunk: the embedding, float32 little-endian (else empty)
    embedding: bytes = b""
    # with messages and a server that splits thinking ([model] reasoning_parser): new thinking text
    reasoning: str = ""
    # with messages and tools: the calls read from the reply, piece by piece as they are generated (streamed) or
    # whole (not streamed)
    tool_calls: list[ToolCall] | None = None


class ErrorReply(msgspec.Struct):
    # None when the message could not be read far enough to know
    request_id: str | None
    # the HTTP status that describes it: 400 bad request, 429 queue full, 503 engine unavailable, ...
    status: int
    message: str
    # seconds after which the request may succeed (a 429's or 503's, as HTTP's Retry-After); 0: not said
    retry_after: float = 0.0


class HealthReply(msgspec.Struct):
    alive: bool
    model: str
    max_model_len: int
    num_in_flight: int


# message type frame -> body type, each way
CLIENT_MESSAGES: dict[bytes, type] = {b"generate": GenerateRequest, b"abort": AbortRequest, b"health": HealthRequest}
SERVER_MESSAGES: dict[bytes, type] = {b"chunk": StreamChunk, b"error": ErrorReply, b"health": HealthReply}
CLIENT_DECODERS = {kind: msgspec.msgpack.Decoder(body) for kind, body in CLIENT_MESSAGES.items()}
SERVER_DECODERS = {kind: msgspec.msgpack.Decoder(body) for kind, body in SERVER_MESSAGES.items()}
_encoder = msgspec.msgpack.Encoder()


def encode(kind: bytes, body: msgspec.Struct) -> list[bytes]:
    return [kind, _encoder.encode(body)]


def decode_reply(frames: list[bytes]) -> StreamChunk | ErrorReply | HealthReply:
    """A server message, as a client receives it (no identity frame)."""
    if len(frames) != 2 or bytes(frames[0]) not in SERVER_DECODERS:
        raise ValueError(f"unexpected message from the server: {[bytes(f[:20]) for f in frames]}")
    return SERVER_DECODERS[bytes(frames[0])].decode(frames[1])
