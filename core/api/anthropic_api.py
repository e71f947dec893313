"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) over the chat path.

A Messages request becomes a chat completions request (system text, content
blocks as messages, ``tool_use`` blocks as the assistant's tool calls,
``tool_result`` blocks as tool messages, Anthropic's tools and
``tool_choice`` as OpenAI's, ``disable_parallel_tool_use`` as
``parallel_tool_calls`` false), runs as one, and its reply is written back as
a Message: a ``thinking`` block (with ``[model] reasoning_parser``), text
and ``tool_use`` blocks, ``stop_reason`` ("end_turn",
"max_tokens", "stop_sequence" with the ``stop_sequence`` that matched,
"tool_use"), usage; streamed, as Anthropic's named events. Errors take
Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``.
Image and document blocks are refused (400, naming the block). Fields
Conveyor does not use (``metadata``, ``cache_control``, ...) are
accepted and ignored; ``thinking`` blocks of earlier turns are left out of
the prompt, as Anthropic's own models see them.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec

from conveyor.api import openai_api as api
from conveyor.api.openai_call import Call, Emit
from conveyor.api.tool_calls import FunctionDef, ToolDef
from conveyor.api.tool_stream import CallStart, Part, Reasoning, Text
from conveyor.sampling import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from conveyor.transport import Chunk, RequestError

Int = api.Int
# (the engine's limits, checked here so that a refusal names this API's field, not the chat path's "stop")
StopSequence = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STOP_STRING_CHARS)]


class TextBlock(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class ToolUseBlock(msgspec.Struct, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


class ImageBlock(msgspec.Struct, tag="image", tag_field="type"):
    # (taken only to be refused by name: the model reads text)
    source: dict[str, Any] | None = None


class DocumentBlock(msgspec.Struct, tag="document", tag_field="type"):
    source: dict[str, Any] | None = None


class ToolResultBlock(msgspec.Struct, tag="tool_result", tag_field="type"):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock | DocumentBlock] = ""
    is_error: bool = False


class ThinkingBlock(msgspec.Struct, tag="thinking", tag_field="type"):
    thinking: str
    signature: str = ""


Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | ImageBlock | DocumentBlock


class Message(msgspec.Struct):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(msgspec.Struct):
    name: str
    # JSON Schema of the tool's input
    input_schema: dict[str, Any]
    description: str | None = None
    # client tools only ("custom", or none given)
    type: Literal["custom"] | None = None


class ToolChoice(msgspec.Struct):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class _Conversation(msgspec.Struct, kw_only=True):
    model: str | None = None
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None


class CountTokensRequest(_Conversation, kw_only=True):
    pass


class MessagesRequest(_Conversation, kw_only=True):
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
    stop_sequences: Annotated[list[StopSequence], msgspec.Meta(max_length=MAX_STOP_STRINGS)] | None = None
    # Anthropic's ranges, which its API holds a request to (vLLM's temperature above 1 and top_k -1 are refused)
    temperature: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    top_p: float | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] | None = None
    stream: bool = False
    # vLLM's extras
    seed: Int | None = None
    ignore_eos: bool = False


def _refuse_media(block: Any, where: str) -> None:
    """Raises RequestError (400) for an image or a document block, which the model cannot read."""
    if isinstance(block, (ImageBlock, DocumentBlock)):
        kind = "image" if isinstance(block, ImageBlock) else "document"
        raise RequestError(f"{where}: {kind} blocks are not supported: this server's model reads text only", 400,
                           where)


def _text(content: str | list[Any], where: str) -> str:
    if isinstance(content, str):
        return content
    for j, block in enumerate(content):
        _refuse_media(block, f"{where}[{j}]")
    return "".join(block.text for block in content)


def _messages(request: _Conversation) -> list[dict[str, Any]]:
    """The conversation as chat completions messages.

    Raises:
        RequestError: 400 for a block in a role that cannot send it.
    """
    messages: list[dict[str, Any]] = []
    if request.system:
        messages.append({"role": "system", "content": _text(request.system, "system")})
    for i, message in enumerate(request.messages):
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
            continue
        texts, calls = [], []
        for j, block in enumerate(message.content):
            where = f"messages[{i}].content[{j}]"
            _refuse_media(block, where)
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ToolUseBlock):
                if message.role != "assistant":
                    raise RequestError(f"{where}: a tool_use block belongs to an assistant message", 400, where)
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": json.dumps(block.input)}})
            elif isinstance(block, ToolResultBlock):
                if message.role != "user":
                    raise RequestError(f"{where}: a tool_result block belongs to a user message", 400, where)
                content = _text(block.content, f"{where}.content")
                messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                 "content": f"Error: {content}" if block.is_error else content})
        if calls:
            messages.append({"role": "assistant", "content": "".join(texts) or None, "tool_calls": calls})
        elif texts or not message.content:
            messages.append({"role": message.role, "content": "".join(texts)})
    return messages


def _tool_choice(choice: ToolChoice | None) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise RequestError("tool_choice: type 'tool' needs the tool's name", 400, "tool_choice")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def to_chat(request: _Conversation) -> api.ChatCompletionRequest:
    """The chat completions request that runs a Messages (or count_tokens) request.

    Raises:
        RequestError: 400 naming the field.
    """
    tools = [ToolDef("function", FunctionDef(t.name, t.description, t.input_schema)) for t in request.tools or []]
    names = [tool.function.name for tool in tools]
    if twice := next((name for name in names if names.count(name) > 1), None):
        raise RequestError(f"tools: {twice!r} names more than one tool; tool names must be unique", 400, "tools")
    choice = request.tool_choice
    if choice is not None and choice.type in ("any", "tool") and not tools:
        # (in the request's words: the chat path would say its own "required")
        raise RequestError(f"tool_choice: type {choice.type!r} needs tools", 400, "tool_choice")
    fields: dict[str, Any] = {}
    if isinstance(request, MessagesRequest):
        fields = {"max_tokens": request.max_tokens, "temperature": request.temperature, "top_p": request.top_p,
                  "top_k": request.top_k, "stop": request.stop_sequences, "seed": request.seed,
                  "ignore_eos": request.ignore_eos}
    messages = _messages(request)
    # a final assistant message is the start of the reply, which the model continues (Anthropic's prefill)
    last = messages[-1] if messages else {}
    prefill = last.get("role") == "assistant" and bool(last.get("content")) and "tool_calls" not in last
    if prefill and last["content"] != last["content"].rstrip():
        # (Anthropic's API refuses it too: a prompt cut after a space is one the model hardly saw in training)
        where = f"messages[{len(request.messages) - 1}]"
        raise RequestError(f"{where}: a final assistant message, which the reply continues, cannot end with "
                           "whitespace", 400, where)
    parallel = choice is None or not choice.disable_parallel_tool_use
    return api.ChatCompletionRequest(messages=messages, model=request.model, tools=tools or None,
                                     tool_choice=_tool_choice(choice), parallel_tool_calls=parallel,
                                     add_generation_prompt=not prefill, continue_final_message=prefill, **fields)


def _stop_reason(finish_reason: str | None, stop_string: str | None) -> str:
    if finish_reason == "tool_calls":
        return "tool_use"
    if finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop_string is not None else "end_turn"


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _blocks(call: Call) -> tuple[list[dict[str, Any]], str]:
    """The reply's content blocks and its stop reason."""
    message, finish_reason = call.message(0)
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message["content"]:
        blocks.append({"type": "text", "text": message["content"]})
    for tool_call in message.get("tool_calls", []):
        arguments = tool_call["function"]["arguments"]
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:  # (cut short by max_tokens: the text as it came)
            arguments = {"_partial_arguments": arguments}
        blocks.append({"type": "tool_use", "id": _tool_use_id(tool_call["id"]), "name": tool_call["function"]["name"],
                       "input": arguments})
    return blocks, _stop_reason(finish_reason, call.stop_strings[0])


def _usage(call: Call) -> dict[str, int]:
    """Anthropic's usage: input_tokens are the prompt tokens computed, apart from those read from the cache (the
    prompt is their sum, as Anthropic counts it)."""
    usage = call.usage()
    return {"input_tokens": usage["prompt_tokens"] - call.num_cached_tokens,
            "output_tokens": usage["completion_tokens"], "cache_read_input_tokens": call.num_cached_tokens,
            "cache_creation_input_tokens": 0}


def _message(call: Call, content: list[dict[str, Any]], stop_reason: str | None) -> dict[str, Any]:
    # (Anthropic's ids begin "msg_", as its tool_use ids begin "toolu_")
    return {"id": "msg_" + call.id.removeprefix("msg-"), "type": "message", "role": "assistant", "model": call.model,
            "content": content, "stop_reason": stop_reason,
            "stop_sequence": call.stop_strings[0] if stop_reason == "stop_sequence" else None, "usage": _usage(call)}


def message(call: Call) -> dict[str, Any]:
    """The Message object of a finished call."""
    content, stop_reason = _blocks(call)
    return _message(call, content, stop_reason)


async def stream(call: Call, emit: Emit, begin: Any) -> None:
    """The call as Anthropic's events: message_start, each content block's start, deltas and stop, message_delta
    (the stop reason and the output tokens), message_stop. Text and a tool's input (``input_json_delta``) stream
    as they are generated. The stream opens once the engine took the request (one it refuses is an HTTP error).
    message_start and message_delta carry the same input usage, its cached tokens apart."""
    opened = False
    block = -1  # the open content block's index
    block_type = ""

    async def open_stream() -> None:
        nonlocal opened
        if not opened:
            opened = True
            await begin()
            await emit({"type": "message_start", "message": _message(call, [], None)})
            await emit({"type": "ping"})

    async def start(content_block: dict[str, Any]) -> None:
        nonlocal block, block_type
        if block >= 0:
            await emit({"type": "content_block_stop", "index": block})
        block, block_type = block + 1, content_block["type"]
        await emit({"type": "content_block_start", "index": block, "content_block": content_block})

    async def on_chunk(index: int, chunk: Chunk, parts: list[Part]) -> None:
        if not chunk.token_ids and chunk.finish_reason is None:
            # the engine took the request, before it looked the prompt up in the prefix cache: the stream opens,
            # and message_start waits for the first tokens, to split its usage as the final one does
            await begin()
            return
        await open_stream()
        for part in parts:
            if isinstance(part, Reasoning):
                if block_type != "thinking":
                    await start({"type": "thinking", "thinking": "", "signature": ""})
                await emit({"type": "content_block_delta", "index": block,
                            "delta": {"type": "thinking_delta", "thinking": part.text}})
            elif isinstance(part, Text):
                if block_type != "text":
                    await start({"type": "text", "text": ""})
                await emit({"type": "content_block_delta", "index": block,
                            "delta": {"type": "text_delta", "text": part.text}})
            elif isinstance(part, CallStart):
                await start({"type": "tool_use", "id": _tool_use_id(part.id), "name": part.name, "input": {}})
            else:
                await emit({"type": "content_block_delta", "index": block,
                            "delta": {"type": "input_json_delta", "partial_json": part.delta}})

    await call.run(on_chunk)
    await open_stream()
    if block >= 0:
        await emit({"type": "content_block_stop", "index": block})
    final = message(call)
    await emit({"type": "message_delta", "delta": {"stop_reason": final["stop_reason"],
                                                   "stop_sequence": final["stop_sequence"]},
                "usage": final["usage"]})
    await emit({"type": "message_stop"})


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """Anthropic's error object (the field, where one is to blame, named in the message)."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}
