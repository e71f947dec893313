"""One ``generate`` of the ZMQ protocol: its prompt (a chat turn through ``conveyor.api.chat``, with its tools, or
a text or token ids) and its reply as protocol chunks, streamed or whole; a chat reply split into thinking, text and
tool calls as HTTP's is."""

from __future__ import annotations

from typing import Any

import msgspec

from conveyor.api.chat import chat_prompt, constrain, finish_reason, reply_reader
from conveyor.api.tokenizing import Tokenizing
from conveyor.api.tool_calls import ToolDef, Tools
from conveyor.api.tool_stream import Arguments, CallStart, Part, Reasoning, ReplyReader, Text
from conveyor.serving import protocol
from conveyor.transport import Chunk, Frontend, RequestError


async def prompt(frontend: Frontend, tokenizing: Tokenizing, request: protocol.GenerateRequest
                 ) -> tuple[list[int], ReplyReader | None]:
    """The request's prompt tokens (its params constrained where its tool_choice forces a call), and, for a chat
    turn, the reader of its reply.

    Raises:
        RequestError: 400 naming the field.
    """
    if (request.prompt is None) == (request.messages is None):
        raise RequestError("give exactly one of prompt and messages", 400, "prompt")
    if request.messages is None:
        if request.tools or request.tool_choice is not None:
            raise RequestError("tools and tool_choice need messages (a chat)", 400, "tools")
        return await tokenizing.run(frontend.encode, request.prompt), None
    try:
        defs = msgspec.convert(request.tools, list[ToolDef] | None)
    except msgspec.ValidationError as e:
        raise RequestError(f"tools: {e}", 400, "tools") from None
    tools = Tools(defs, request.tool_choice, request.parallel_tool_calls)
    prompt_ids = await tokenizing.run(chat_prompt, frontend, request.messages, tools)
    constrain(request.params, tools)
    return prompt_ids, reply_reader(frontend, prompt_ids, tools, request.params)


class Reply:
    """A request's reply as protocol chunks: each chunk's (``stream``), or one with everything at the end."""

    def __init__(self, request_id: str, reader: ReplyReader | None, stream: bool):
        self.request_id = request_id
        self.reader = reader
        self.stream = stream
        self.last: Chunk | None = None
        self._text: list[str] = []
        self._token_ids: list[int] = []
        self._logprobs: list[protocol.Logprob] = []

    def add(self, chunk: Chunk) -> protocol.StreamChunk | None:
        """The message to send for ``chunk`` now (None: nothing yet, or not streaming before the end)."""
        self.last = chunk
        message = _chunk(self.request_id, chunk)
        if self.reader is not None:
            parts = self.reader.feed(chunk.text, final=chunk.finish_reason is not None)
            _split(message, parts)
            if chunk.finish_reason is not None:
                message.finish_reason = finish_reason(self.reader, chunk.finish_reason)
        if self.stream:
            shown = message.text or message.token_ids or message.logprobs or message.reasoning or message.tool_calls
            return message if shown or message.finish_reason else None
        self._text.append(message.text)
        self._token_ids += message.token_ids
        self._logprobs += message.logprobs or []
        if chunk.finish_reason is None:
            return None
        message.text, message.token_ids, message.logprobs = "".join(self._text), self._token_ids, self._logprobs or None
        if self.reader is not None:
            self._whole(message)
        return message

    def aborted(self) -> protocol.StreamChunk:
        """The last message of a request the client aborted (without streaming: what it made so far comes too, a
        chat turn's thinking and calls as far as they came)."""
        last = self.last
        usage = protocol.Usage(last.num_prompt_tokens, last.num_output_tokens) if last else None
        message = protocol.StreamChunk(self.request_id, "".join(self._text), self._token_ids,
                                       self._logprobs or None, finish_reason="abort", usage=usage)
        if self.reader is not None and not self.stream:
            self.reader.feed("", final=True)
            self._whole(message)
        return message

    def _whole(self, message: protocol.StreamChunk) -> None:
        """A chat turn's reply whole, as the reader read it: the answer, the thinking, each call."""
        message.text = self.reader.content
        thinking = self.reader.thinking
        message.reasoning = thinking.reasoning if thinking is not None else ""
        message.tool_calls = [protocol.ToolCall(i, c["id"], c["function"]["name"], c["function"]["arguments"])
                              for i, c in enumerate(self.reader.calls)] or None


def _split(message: protocol.StreamChunk, parts: list[Part]) -> None:
    """A chat chunk's text replaced by what its parts say: the answer's text, the thinking, the calls' pieces."""
    text, reasoning, calls = [], [], []
    for part in parts:
        if isinstance(part, Text):
            text.append(part.text)
        elif isinstance(part, Reasoning):
            reasoning.append(part.text)
        elif isinstance(part, CallStart):
            calls.append(protocol.ToolCall(part.index, part.id, part.name))
        else:
            assert isinstance(part, Arguments)
            if calls and calls[-1].index == part.index:
                calls[-1].arguments += part.delta
            else:
                calls.append(protocol.ToolCall(part.index, arguments=part.delta))
    message.text, message.reasoning, message.tool_calls = "".join(text), "".join(reasoning), calls or None


def _chunk(request_id: str, chunk: Any) -> protocol.StreamChunk:
    logprobs = None
    if chunk.logprobs is not None:
        logprobs = [protocol.Logprob(t, lp.logprob, lp.top_ids, lp.top_logprobs)
                    for t, lp in zip(chunk.token_ids, chunk.logprobs)]
    usage = None
    if chunk.finish_reason is not None:
        usage = protocol.Usage(chunk.num_prompt_tokens, chunk.num_output_tokens, chunk.num_cached_tokens)
    return protocol.StreamChunk(request_id, chunk.text, chunk.token_ids, logprobs, chunk.finish_reason, usage,
                                chunk.embedding)
