"""The transport interface (plugin kind ``transport``) and the frontend it serves clients through.

A transport lets clients reach the model: it accepts their requests in its
own protocol (HTTP, ZeroMQ, ...), hands them to the ``Frontend`` it is
given, and streams the results back. Several transports can serve at once,
all through one frontend; the frontend tokenizes, checks limits, submits to
the engine, detokenizes and keeps the metrics. What an API means beyond
tokens (tool calls, reasoning split from answers, the Responses API's stored
responses, OpenAI's and Anthropic's request and reply shapes) is in
``conveyor.api``, which any transport answers through: the built-in ``http``
one for every API, ``zmq`` for its chat turns.
"""

from __future__ import annotations

import math
import sys
from abc import ABC, abstractmethod
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, ClassVar, Protocol

import anyio
import msgspec

from conveyor.messages import LoraAdapter, TokenLogprob
from conveyor.model.tokenizer import Tokenizer
from conveyor.sampling import SamplingParams


class RequestError(Exception):
    """A request the server refuses or could not finish, with the HTTP status that says why.

    Args:
        message: what is wrong, naming the offending field and value.
        status: 400 bad input, 413 too large, 429 queue full, 503 engine unavailable, ...
        param: the request field at fault, when there is one.
        retry_after: seconds after which the request may succeed (a 429's or 503's Retry-After); 0: not said.
    """

    def __init__(self, message: str, status: int = 400, param: str | None = None, retry_after: float = 0.0):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.retry_after = retry_after


class Chunk(msgspec.Struct):
    """What one engine output added to one sequence (possibly nothing: the first chunk of a request a gate held,
    e.g. while its grammar compiled, says the engine took it)."""

    # text that is now final (may be empty while a character or a stop string is pending)
    text: str
    token_ids: list[int]
    # one per token in token_ids when the request asked for logprobs
    logprobs: list[TokenLogprob] | None
    # "stop", "length" or "abort" on the last chunk
    finish_reason: str | None
    num_prompt_tokens: int
    # generated so far, this chunk included
    num_output_tokens: int
    num_cached_tokens: int = 0
    # with params.prompt_logprobs: entries for prompt positions prompt_logprobs_start, prompt_logprobs_start + 1, ...
    prompt_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs_start: int = 0
    # on the last chunk of a sequence a stop string ended: that string
    stop_string: str | None = None
    # with params.pooling, on the last chunk: the embedding (float32 little-endian [hidden_size])
    embedding: bytes = b""
    # structured output, on the last chunk: the answer was closed to fit max_tokens (RequestOutput.grammar_closed)
    grammar_closed: bool = False


def embedding_floats(vector: bytes, normalize: bool) -> list[float]:
    """``Chunk.embedding`` as floats, scaled to length 1 where ``normalize``."""
    values = array("f")
    values.frombytes(vector)
    if sys.byteorder == "big":
        values.byteswap()
    return unit_length(values.tolist()) if normalize else values.tolist()


def unit_length(values: list[float]) -> list[float]:
    """``values`` scaled to length 1 (a zero vector stays as it is)."""
    norm = math.sqrt(math.fsum(v * v for v in values))
    return [v / norm for v in values] if norm > 0 else values


class Frontend(Protocol):
    """What a transport gets: everything it needs to serve a client's request."""

    # the name clients use for the model (OpenAI's "model"), and other names they may use for it
    model_name: str
    aliases: tuple[str, ...]
    tokenizer: Tokenizer
    # conveyor.serving.metrics.ServerMetrics: what /metrics shows
    metrics: Any
    # the LoRA adapters served, by name
    adapters: dict[str, LoraAdapter]
    # [model] reasoning_parser: "think", or "" (replies are not split)
    reasoning_parser: str
    # [model] pooling: how /v1/embeddings pools the hidden states ("last" or "mean")
    pooling: str
    # the [scheduler] table now (conveyor.config.PluginSpec: plugin, options), run-time changes included
    scheduler: Any
    # conveyor.batches.files.FileStore: the files of [batch] dir; None where it is not set
    files: Any

    @property
    def max_model_len(self) -> int:
        """Prompt + output tokens a request may have (0 until the engine is ready)."""

    @property
    def healthy(self) -> bool:
        """The engine is up and the server is not shutting down."""

    @property
    def engine_alive(self) -> bool:
        """The engine is up (it may be draining)."""

    @property
    def draining(self) -> bool:
        """The server is shutting down: no new requests."""

    @property
    def num_in_flight(self) -> int:
        """Sequences submitted and not finished."""

    def new_request_id(self, prefix: str = "req") -> str:
        """A request id unique in this server."""

    def encode(self, prompt: str | list[int], field: str = "prompt", *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text (``add_special_tokens``: with the BOS the model asks for), or token ids checked
        against the vocabulary. A long text takes seconds: call it in a worker thread, which it leaves the GIL to.

        Raises:
            RequestError: 400, naming ``field``.
        """

    def encode_chat(self, messages: list[dict[str, Any]], field: str = "messages", **context: Any) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template (``context``: more variables
        the template may read, e.g. ``tools``).

        Raises:
            RequestError: 400, naming what is wrong with the messages.
        """

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Refuse what the model cannot do (400) and new work while starting or draining (503). A transport
        calls it once per request, before ``generate`` and before it answers the client, so that a refusal
        is an error response, not an error after the first bytes of a stream.

        Raises:
            RequestError: naming the limit.
        """

    def adapter(self, model: str | None) -> LoraAdapter | None:
        """The LoRA adapter a client's model name chooses (``NAME`` or ``BASE:NAME``); None: the base model.

        Raises:
            RequestError: 404, no such model.
        """

    def add_adapter(self, name: str, path: str) -> LoraAdapter:
        """Serve the PEFT adapter directory ``path`` as ``name`` (loaded when a request first runs under it).

        Raises:
            RequestError: 400 naming what is wrong (LoRA off, the name, the directory).
        """

    def remove_adapter(self, name: str) -> None:
        """Stop serving an adapter (requests already running under it finish).

        Raises:
            RequestError: 404, no adapter of that name.
        """

    def reconfigure_scheduler(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Change scheduler options while serving (those the plugin allows at run time: the latency targets);
        returns the options now.

        Raises:
            RequestError: 400 naming a key that may not change, or a value its option does not allow.
        """

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, request_id: str, priority: int = 0,
        lora: LoraAdapter | None = None,
    ) -> AsyncIterator[Chunk]:
        """Run one sequence (under ``lora``, from ``adapter()``); yield its chunks until the one with a
        finish_reason. ``check`` it first: this refuses only new work while starting or draining (the engine
        refuses a prompt too long for it in an error chunk's stead).

        Iterate it inside ``contextlib.aclosing``: leaving early aborts the request.

        Raises:
            RequestError: refused (400/429/503), or the engine failed it (5xx).
        """

    async def run_choices(
        self, prompt_ids: list[int], params: SamplingParams, n: int, *, request_id: str, priority: int = 0,
        on_chunk: Callable[[int, Chunk], Awaitable[None]], lora: LoraAdapter | None = None,
    ) -> None:
        """Run ``n`` sequences of one prompt at once, calling ``on_chunk(index, chunk)`` as they come."""


class Transport(ABC):
    """Serves clients in one protocol."""

    name: ClassVar[str]
    Options: ClassVar[type[msgspec.Struct]]

    def __init__(self, options: msgspec.Struct):
        self.options = options

    @abstractmethod
    async def serve(
        self, frontend: Frontend, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve until cancelled.

        Args:
            frontend: tokenizes, checks, submits and detokenizes the clients' requests.
            task_status: ``task_status.started(address)`` once accepting connections (it is printed).
        """
