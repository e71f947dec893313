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

from collections import OrderedDict
from typing import Any, Literal

import msgspec

from conveyor.api import openai_api as api
from conveyor.api.tool_calls import FunctionDef, ToolDef
from conveyor.transport import RequestError


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
        if fmt.type == "json_schema" and fmt.schema is None:
            raise RequestError("text.format: type 'json_schema' needs a schema", 400, "text.format")
        schema = None
        if fmt.type == "json_schema":
            schema = api.JSONSchemaFormat(fmt.name, fmt.schema, fmt.strict, fmt.description)
        response_format = api.ResponseFormat(fmt.type, schema)
    chat = api.ChatCompletionRequest(
        messages=messages, model=request.model, tools=tools or None, tool_choice=choice,
        max_tokens=request.max_output_tokens, temperature=request.temperature, top_p=request.top_p,
        response_format=response_format, parallel_tool_calls=request.parallel_tool_calls, seed=request.seed,
        top_k=request.top_k, ignore_eos=request.ignore_eos)
    return chat, conversation


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
        message = error.message
        for after in (":", " (", "="):  # ("max_tokens: ...", "max_tokens (...)", "max_tokens=0 must be >= 1")
            message = message.replace(f"{error.param}{after}", f"{name}{after}", 1)
        return RequestError(message, error.status, name)
    return error


def error_event(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """An error after the stream's 200 outside a ``Reply`` (``responses_reply``: it numbers its own ``error`` event
    and fails the response after it)."""
    return {"type": "error", **error_fields(message, status, param)}


def error_fields(message: str, status: int, param: str | None) -> dict[str, Any]:
    """An ``error`` event's fields (its code from the HTTP status)."""
    return {"code": api.ERROR_TYPES.get(status, "server_error"), "message": message, "param": param}

