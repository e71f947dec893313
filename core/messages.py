"""Messages that cross process boundaries (msgspec, no pickle).

Every message is an array-like msgspec Struct; a decoder is built per type.
Between the frontend and the engine process each message is two ZMQ frames:
one byte naming its type (``MessageType``), then the msgpack body.
"""

from __future__ import annotations

import enum

import msgspec

from conveyor.sampling import SamplingParams


class EngineRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # lower runs first under the priority policy
    priority: int = 0
    # time.time() when the request reached the server
    arrival_time: float = 0.0


class TokenLogprob(msgspec.Struct, array_like=True, gc=False):
    # log-probability of the chosen token under the model (before sampling filters)
    logprob: float
    # most likely alternatives, best first
    top_ids: list[int]
    top_logprobs: list[float]


class RequestOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int] = []
    # one entry per new token when the request asked for logprobs
    new_logprobs: list[TokenLogprob] | None = None
    # "stop" | "length" | "abort" | "error" once the request is done
    finish_reason: str | None = None
    # error text when finish_reason is "error" or the request was rejected
    error: str | None = None
    # for a rejected request, the HTTP status that describes why (400 too long, 429 queue full, ...)
    error_status: int = 0
    num_prompt_tokens: int = 0
    # prompt tokens whose KV came from the prefix cache
    num_cached_tokens: int = 0
    # on the first token: seconds from arrival to the first step that ran the request
    queue_time: float = 0.0


class StepStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one engine step did and how long its parts took."""

    step: int
    # time.time() at the end of the step
    timestamp: float
    num_running: int
    num_waiting: int
    num_prefill_tokens: int
    num_decode_tokens: int
    # fraction of the KV cache in use after the step, and its blocks
    kv_usage: float
    num_kv_blocks: int = 0
    num_free_kv_blocks: int = 0
    # cumulative
    num_preemptions: int = 0
    # prompt tokens served from the prefix cache, cumulative
    num_prefix_hit_tokens: int = 0
    num_wasted_slots: int = 0
    # seconds: choosing the batch; building inputs + the forward pass; sampling; recording the results
    schedule_time: float = 0.0
    forward_time: float = 0.0
    sample_time: float = 0.0
    update_time: float = 0.0


class EngineOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What the engine process publishes after a step (or after taking requests it rejected)."""

    outputs: list[RequestOutput]
    stats: StepStats | None = None


class EngineReady(msgspec.Struct, array_like=True, gc=False):
    """The engine process's first message: the model is loaded and the KV cache sized."""

    pid: int
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    # requests of max_model_len tokens that fit in the KV cache at once
    max_concurrency: float
    # seconds from process start to ready
    load_time: float


class MessageType(bytes, enum.Enum):
    """The first frame of every frontend <-> engine message."""

    # frontend -> engine
    ADD = b"a"  # EngineRequest
    ABORT = b"x"  # list[str]: request ids
    SHUTDOWN = b"q"  # empty body: finish the current step and exit
    # engine -> frontend
    READY = b"r"  # EngineReady
    OUTPUTS = b"o"  # EngineOutputs


MESSAGE_BODIES: dict[MessageType, type] = {
    MessageType.ADD: EngineRequest,
    MessageType.ABORT: list[str],
    MessageType.SHUTDOWN: type(None),
    MessageType.READY: EngineReady,
    MessageType.OUTPUTS: EngineOutputs,
}
_encoder = msgspec.msgpack.Encoder()
_decoders = {kind: msgspec.msgpack.Decoder(body) for kind, body in MESSAGE_BODIES.items()}


def encode(kind: MessageType, body: object = None) -> list[bytes]:
    """The two frames of one message."""
    return [kind.value, _encoder.encode(body)]


def decode(frames: list[bytes]) -> tuple[MessageType, object]:
    """The type and typed body of a message; raises ValueError for an unknown type or a bad body."""
    if len(frames) != 2:
        raise ValueError(f"expected 2 frames, got {len(frames)}")
    kind = MessageType(bytes(frames[0]))
    try:
        return kind, _decoders[kind].decode(frames[1])
    except msgspec.DecodeError as e:  # ValidationError is a DecodeError
        raise ValueError(f"bad {kind.name} message: {e}") from None
