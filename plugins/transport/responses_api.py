"""OpenAI's Responses API (``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``) over the chat path.

A Responses request becomes a chat completions request: ``instructions`` as
the system message, ``input`` (a text, or items: messages, ``function_call``
and ``function_call_output``) as the conversation, after the stored
conversation of ``previous_response_id``; function tools, ``tool_choice``,
``text.format`` (text, a JSON object, a JSON schema) and
``max_output_tokens`` as their chat counterparts. The reply is written back
as a Response: a reasoning item with the thinking (with ``[model]
reasoning_parser``), a message item with ``output_text``, ``function_call`` items,
``status`` ("incomplete" with ``incomplete_details`` when it ran out of
tokens) and usage; streamed, as the typed events (``response.created`` ...
``response.completed``), each with its ``sequence_number``; a failure
after the stream began (the engine died) is an ``error`` event, then
``response.failed``. With ``store`` (the default) the response and its
conversation are kept in memory, the oldest dropped past ``[[transport]]
max_stored_responses``.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from typing import Any, Literal

import msgspec

from conveyor.plugins.transport import openai_api as api
from conveyor.plugins.transport.openai_call import Call, Emit, arguments_complete
from conveyor.plugins.transport.tool_calls import FunctionDef, ToolDef
from conveyor.plugins.transport.tool_stream import CallStart, Part, Reasoning, Text
from conveyor.transport import Chunk, RequestError


class TextPart(msgspec.Struct, tag_field="type", tag="input_text"):
    text: str


class OutputTextPart(msgspec.Struct, tag_field="type", tag="output_text"):
    text: str


class RefusalPart(msgspec.Struct, tag_field="type", tag="refusal"):
    refusal: str


ContentPart = TextPart | OutputTextPart | RefusalPart


class MessageItem(msgspec.Struct, tag_field="type", tag="message"):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]


class FunctionCallItem(msgspec.Struct, tag_field="type", tag="function_call"):
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(msgspec.Struct, tag_field="type", tag="function_call_output"):
    call_id: str
    output: str | list[ContentPart]


class ReasoningItem(msgspec.Struct, tag_field="type", tag="reasoning"):
    pass


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(msgspec.Struct):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(msgspec.Struct):
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(msgspec.Struct):
    format: TextFormat | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    # a text (one user message) or items; an item without "type" is a message
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    # "none" | "auto" | "required" | {"type": "function", "name": ...}
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: api.Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # vLLM's extras
    seed: api.Int | None = None
    top_k: api.Int | None = None
    ignore_eos: bool = False


def _parts_text(content: str | list[ContentPart]) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.refusal if isinstance(part, RefusalPart) else part.text for part in content)


def input_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's ``input`` as chat completions messages.

    Raises:
        RequestError: 400 naming the item and its bad field.
    """
    if isinstance(request.input, str):
        return [{"role": "user", "content": request.input}]
    messages: list[dict[str, Any]] = []
    for i, raw in enumerate(request.input):
        try:
            item = msgspec.convert(raw if "type" in raw else {"type": "message", **raw}, type=Item)
        except msgspec.ValidationError as e:
            message, _, path = str(e).partition(" - at ")
            where = f"input[{i}]" + path.strip("`").removeprefix("$")
            raise RequestError(f"{where}: {message}", 400, where) from None
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _parts_text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # (calls made in one turn: one assistant message)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _parts_text(item.output)})
    return messages


class ResponseStore:
    """Stored responses and the conversation each ended (without instructions, which a follow-up does not
    inherit), the oldest dropped past ``capacity``."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.entries: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        if self.capacity == 0:
            return
        self.entries[response["id"]] = (response, conversation)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def get(self, response_id: str) -> dict[str, Any]:
        """
        Raises:
            RequestError: 404, no such stored response.
        """
        return self._entry(response_id, None)[0]

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """
        Raises:
            RequestError: 400 naming ``previous_response_id``.
        """
        return self._entry(response_id, "previous_response_id")[1]

    def delete(self, response_id: str) -> None:
        self._entry(response_id, None)
        del self.entries[response_id]

    def _entry(self, response_id: str, field: str | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        entry = self.entries.get(response_id)
        if entry is None:
            status = 404 if field is None else 400
            raise RequestError(f"no stored response with id {response_id!r} (responses are kept in memory, the "
                               f"last {self.capacity}, and only with store=true)", status, field)
        return entry


def to_chat(request: ResponsesRequest, store: ResponseStore) -> tuple[api.ChatCompletionRequest, list[dict[str, Any]]]:
    """The chat completions request that runs a Responses request, and the conversation without instructions
    (what a follow-up continues).

    Raises:
        RequestError: 400 naming the field.
    """
    history = store.conversation(request.previous_response_id) if request.previous_response_id else []
    conversation = [*history, *input_messages(request)]
    messages = ([{"role": "system", "content": request.instructions}] if request.instructions else []) + conversation
    tools = [ToolDef("function", FunctionDef(t.name, t.description, t.parameters, t.strict))
             for t in request.tools or []]
    choice = request.tool_choice
    if isinstance(choice, dict):
        choice = {"type": choice.get("type"), "function": {"name": choice.get("name")}}
    fmt = request.text.format if request.text is not None else None
    response_format = None
    if fmt is not None:
        schema = api.JSONSchemaFormat(fmt.name, fmt.schema, fmt.strict, fmt.description) if fmt.type == "json_schema" else None
        if fmt.type == "json_schema" and fmt.schema is None:
            raise RequestError("text.format: type 'json_schema' needs a schema", 400, "text.format")
        response_format = api.ResponseFormat(fmt.type, schema)
    chat = api.ChatCompletionRequest(
        messages=messages, model=request.model, tools=tools or None, tool_choice=choice,
        max_tokens=request.max_output_tokens, temperature=request.temperature, top_p=request.top_p,
        response_format=response_format, parallel_tool_calls=request.parallel_tool_calls, seed=request.seed,
        top_k=request.top_k, ignore_eos=request.ignore_eos)
    return chat, conversation


class Reply:
    """One Responses call: its output items, and the Response object around them."""

    def __init__(self, call: Call, request: ResponsesRequest):
        self.call = call
        self.request = request
        self.created_at = call.created
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"
        self.sequence = 0

    def items(self) -> list[dict[str, Any]]:
        message, _ = self.call.message(0)
        incomplete = self.call.finish_reasons[0] == "length"
        items = []
        if message.get("reasoning_content"):
            items.append(_reasoning_item(self.reasoning_id, message["reasoning_content"]))
        if message["content"]:
            items.append({"type": "message", "id": self.message_id, "status": "incomplete" if incomplete else "completed",
                          "role": "assistant", "content": [_text_part(message["content"])]})
        for tool_call in message.get("tool_calls", []):
            items.append({"type": "function_call", "id": _function_call_id(tool_call["id"]),
                          "call_id": tool_call["id"], "name": tool_call["function"]["name"],
                          "arguments": tool_call["function"]["arguments"],
                          # (a call cut off by max_output_tokens is no call to run)
                          "status": "completed" if arguments_complete(tool_call) else "incomplete"})
        return items

    def response(self, output: list[dict[str, Any]] | None = None, status: str | None = None,
                 error: dict[str, str] | None = None) -> dict[str, Any]:
        """The Response object: in progress or failed (``output`` given, with its status and ``error``), or
        finished."""
        request, call = self.request, self.call
        if output is None:
            output = self.items()
            status = "incomplete" if call.finish_reasons[0] == "length" else "completed"
        usage = call.usage()
        fmt = request.text.format if request.text is not None and request.text.format is not None else None
        return {
            "id": call.id, "object": "response", "created_at": self.created_at, "status": status, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "model": call.model, "output": output,
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id, "reasoning": None, "store": request.store,
            "temperature": request.temperature, "top_p": request.top_p,
            "text": {"format": msgspec.to_builtins(fmt) if fmt is not None else {"type": "text"}},
            "tool_choice": request.tool_choice or ("auto" if request.tools else "none"),
            "tools": [msgspec.to_builtins(t) for t in request.tools or []], "truncation": "disabled",
            # (the prompt tokens computed are those written to the prefix cache)
            "usage": {"input_tokens": usage["prompt_tokens"],
                      "input_tokens_details": {"cached_tokens": call.num_cached_tokens,
                                               "cache_write_tokens": usage["prompt_tokens"] - call.num_cached_tokens},
                      "output_tokens": usage["completion_tokens"],
                      "output_tokens_details": {"reasoning_tokens": call.reasoning_tokens[0]},
                      "total_tokens": usage["total_tokens"]},
            "user": request.user, "metadata": request.metadata or {},
        }

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    async def stream(self, emit: Emit, begin: Any) -> dict[str, Any]:
        """The call as the Responses API's typed events; returns the final Response, its output in the order the
        items began. Text and a call's arguments stream as they are generated. The stream opens once the engine
        took the request (one it refuses is an HTTP error)."""
        call = self.call
        opened = False
        order: list[str] = []  # the items' ids, as they began
        calls: dict[int, str] = {}  # a call's index -> its item's id

        async def open_stream() -> None:
            nonlocal opened
            if not opened:
                opened = True
                await begin()
                await emit(self.event("response.created", response=self.response([], "in_progress")))
                await emit(self.event("response.in_progress", response=self.response([], "in_progress")))

        def where(item_id: str) -> dict[str, Any]:
            return {"item_id": item_id, "output_index": order.index(item_id)}

        async def on_chunk(index: int, chunk: Chunk, parts: list[Part]) -> None:
            await open_stream()
            for part in parts:
                if isinstance(part, Reasoning):
                    if self.reasoning_id not in order:
                        order.append(self.reasoning_id)
                        await emit(self.event("response.output_item.added", output_index=len(order) - 1,
                                              item={**_reasoning_item(self.reasoning_id, ""), "content": []}))
                    await emit(self.event("response.reasoning_text.delta", **where(self.reasoning_id),
                                          content_index=0, delta=part.text))
                elif isinstance(part, Text):
                    if self.message_id not in order:
                        order.append(self.message_id)
                        await emit(self.event("response.output_item.added", output_index=len(order) - 1, item={
                            "type": "message", "id": self.message_id, "status": "in_progress", "role": "assistant",
                            "content": []}))
                        await emit(self.event("response.content_part.added", **where(self.message_id),
                                              content_index=0, part=_text_part("")))
                    await emit(self.event("response.output_text.delta", **where(self.message_id), content_index=0,
                                          delta=part.text, logprobs=[]))
                elif isinstance(part, CallStart):
                    calls[part.index] = _function_call_id(part.id)
                    order.append(calls[part.index])
                    await emit(self.event("response.output_item.added", output_index=len(order) - 1, item={
                        "type": "function_call", "id": calls[part.index], "call_id": part.id, "name": part.name,
                        "arguments": "", "status": "in_progress"}))
                else:
                    await emit(self.event("response.function_call_arguments.delta", **where(calls[part.index]),
                                          delta=part.delta))

        try:
            await call.run(on_chunk)
        except RequestError as e:
            if not opened:
                raise  # (nothing went out yet: an HTTP error)
            return await self._fail(emit, in_responses_terms(e), order)
        await open_stream()
        final = self.response()
        items = {item["id"]: item for item in final["output"]}
        final["output"] = [items[item_id] for item_id in order]
        for item in final["output"]:
            at = where(item["id"])
            if item["type"] == "reasoning":
                await emit(self.event("response.reasoning_text.done", **at, content_index=0,
                                      text=item["content"][0]["text"]))
            elif item["type"] == "message":
                text = item["content"][0]["text"]
                await emit(self.event("response.output_text.done", **at, content_index=0, text=text, logprobs=[]))
                await emit(self.event("response.content_part.done", **at, content_index=0, part=_text_part(text)))
            else:
                await emit(self.event("response.function_call_arguments.done", **at, name=item["name"],
                                      arguments=item["arguments"]))
            await emit(self.event("response.output_item.done", output_index=at["output_index"], item=item))
        status = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        await emit(self.event(status, response=final))
        return final

    async def _fail(self, emit: Emit, error: RequestError, order: list[str]) -> dict[str, Any]:
        """A failure after the stream's 200: the ``error`` event, then ``response.failed`` with the items as far as
        they came (each "incomplete"); returns that response."""
        await emit(self.event("error", **_error_fields(error.message, error.status, error.param)))
        items = {item["id"]: item for item in self.items()}
        output = [{**items[item_id], "status": "incomplete"} for item_id in order]
        code = "rate_limit_exceeded" if error.status == 429 else "server_error"  # (ResponseError's codes)
        failed = self.response(output, "failed", {"code": code, "message": error.message})
        await emit(self.event("response.failed", response=failed))
        return failed


def _function_call_id(call_id: str) -> str:
    return "fc_" + call_id.removeprefix("call_")


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": "completed",
            "content": [{"type": "reasoning_text", "text": text}]}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def assistant_messages(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A finished response's output as the chat messages a follow-up continues from."""
    text = "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in response["output"] if item["type"] == "function_call"]
    return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]


# the chat completions fields a Responses request's own fields become
CHAT_FIELDS = {"max_tokens": "max_output_tokens", "messages": "input", "prompt": "input",
               "response_format": "text.format"}


def in_responses_terms(error: RequestError) -> RequestError:
    """A refusal of the chat request a Responses request ran as, naming the Responses field."""
    if error.param in CHAT_FIELDS:
        name = CHAT_FIELDS[error.param]
        message = error.message.replace(f"{error.param}:", f"{name}:", 1).replace(f"{error.param} (", f"{name} (", 1)
        return RequestError(message, error.status, name)
    return error


def error_event(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """An error after the stream's 200 outside a ``Reply`` (which numbers its own ``error`` event and fails the
    response after it)."""
    return {"type": "error", **_error_fields(message, status, param)}


def _error_fields(message: str, status: int, param: str | None) -> dict[str, Any]:
    return {"code": api.ERROR_TYPES.get(status, "server_error"), "message": message, "param": param}

