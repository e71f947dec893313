"""The executor <-> worker wire format: typed msgspec messages, no pickle; and what a worker reports once its
share of the model is loaded (``ModelInfo``).

A call names a ``Worker`` method and carries its arguments, each encoded
with the type that method takes; a reply carries the result, or the error
that the worker raised, as text. ``METHODS`` lists what may be called.
"""

from __future__ import annotations

from typing import Any

import msgspec

from conveyor.kvcache import KVCacheLayout, KVCacheSpec
from conveyor.messages import RunnerOutput, StepInput
from conveyor.model.spec import ModelSpec


class ModelInfo(msgspec.Struct, array_like=True, frozen=True):
    """What a worker tells the engine core once its share of the model is loaded."""

    max_model_len: int
    # what one token takes in this worker's KV cache (cache_dtype "auto"; the KV cache manager decides)
    kv_spec: KVCacheSpec
    # e.g. "cpu", "cuda:0"
    device: str
    # the attention backend chosen for it
    attention: str
    # bytes of the weights as stored (quantized layers at their packed size); the executor reports all workers'
    weight_bytes: int
    # the width of the logits (the tokenizer's vocabulary, padded by some models)
    vocab_size: int = 0
    # the model's shape (what a step's FLOPs and bytes are counted from)
    spec: ModelSpec | None = None
    # bytes of the linear layers, embedding and head by the format each is kept in (DecoderModel.weight_formats)
    weight_formats: dict[str, int] = msgspec.field(default_factory=dict)
    # what the quant method does to a checkpoint quantized already (conveyor.model.loader.requantize_note)
    quant_note: str = ""

# method -> (argument types, result type)
METHODS: dict[str, tuple[tuple[type, ...], Any]] = {
    "load_model": ((), ModelInfo),
    "free_memory": ((), int | None),
    "init_kv_cache": ((KVCacheLayout,), None),
    "execute": ((StepInput,), RunnerOutput),
    "add_lora": ((int, str), str),
    "init_kv_connector": ((bytes,), None),
    "kv_connector_call": ((bytes,), bytes),
    "shutdown": ((), None),
}
# the sequence number of a worker's first message, which says it started (or why it could not)
HELLO = -1


class Call(msgspec.Struct, array_like=True, gc=False):
    seq: int
    method: str
    args: list[msgspec.Raw]


class Reply(msgspec.Struct, array_like=True, gc=False):
    seq: int
    rank: int
    result: msgspec.Raw = msgspec.Raw(b"\xc0")  # msgpack nil
    # "": the call returned; "config": a configuration problem (the text names the key); "error": it raised
    error_kind: str = ""
    error: str = ""


_encoder = msgspec.msgpack.Encoder()
_call_decoder = msgspec.msgpack.Decoder(Call)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode_call(seq: int, method: str, args: tuple[Any, ...]) -> bytes:
    if method not in METHODS:
        raise ValueError(f"workers have no method {method!r}; allowed: {', '.join(METHODS)}")
    return _encoder.encode(Call(seq, method, [msgspec.Raw(_encoder.encode(a)) for a in args]))


def decode_call(data: bytes) -> tuple[int, str, list[Any]]:
    call = _call_decoder.decode(data)
    arg_types, _ = METHODS[call.method]
    args = [msgspec.msgpack.decode(raw, type=t) for raw, t in zip(call.args, arg_types, strict=True)]
    return call.seq, call.method, args


def encode_reply(seq: int, rank: int, result: Any = None, error_kind: str = "", error: str = "") -> bytes:
    return _encoder.encode(Reply(seq, rank, msgspec.Raw(_encoder.encode(result)), error_kind, error))


def decode_reply(data: bytes) -> Reply:
    return _reply_decoder.decode(data)
