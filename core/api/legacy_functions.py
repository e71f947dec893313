"""OpenAI's legacy function calling in chat completions: ``functions`` and ``function_call``, the fields that
``tools`` and ``tool_choice`` replaced, run as tools.

Each of ``functions`` is a function tool; ``function_call`` "none", "auto"
or ``{"name": N}`` is ``tool_choice`` "none", "auto" or that function
forced; a reply makes at most one call, as the legacy API's do. A
conversation's earlier calls (an assistant message's ``function_call``) and
their results (messages of role "function") go on as tool calls and tool
messages. The reply takes the legacy shape: the call as
``message.function_call`` (``name``, ``arguments``) and finish_reason
"function_call"; streamed, as ``delta.function_call``, the name first,
then the arguments as they are generated. A field given beside the one that
replaced it (``functions`` and ``tools``, ``function_call`` and
``tool_choice`` or ``tools``) is a 400.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from conveyor.api.openai_api import ChatCompletionRequest
from conveyor.api.tool_calls import ToolDef
from conveyor.transport import RequestError

# (emit, begin): a call's stream of chunk objects, as EventStream runs it
Produce = Callable[[Callable[[dict[str, Any]], Awaitable[None]], Callable[[], Awaitable[None]]], Awaitable[None]]
# the tool fields -> the legacy fields a refusal names instead
LEGACY_FIELDS = {"tools": "functions", "tool_choice": "function_call"}


class LegacyFunctions:
    """One chat request's legacy function calling: the request as tools, and its reply, streamed or not, and its
    refusals in the legacy terms (all unchanged for a request without ``functions`` or ``function_call``)."""

    def __init__(self, body: ChatCompletionRequest | None = None):
        """
        Args:
            body: a chat completions request (None: a completions one, which has no functions).

        Raises:
            RequestError: 400 naming functions or function_call (beside the field that replaced it; a
                function_call that is no choice, or names no function of ``functions``), or messages (an
                earlier function_call that is no object).
        """
        self.active = body is not None and (body.functions is not None or body.function_call is not None)
        self.request = body if body is None else _as_tools(body)

    def rename(self, error: RequestError) -> RequestError:
        """A refusal of the request run as tools, naming the legacy field that gave the tool field."""
        if not self.active or error.param not in LEGACY_FIELDS:
            return error
        message = re.sub(r"\b(tools|tool_choice)\b", lambda m: LEGACY_FIELDS[m.group(1)], error.message)
        return RequestError(message, error.status, LEGACY_FIELDS[error.param], error.retry_after)

    def reply(self, response: dict[str, Any]) -> dict[str, Any]:
        """A chat completion with each choice's call as its message's ``function_call``."""
        if self.active:
            for choice in response["choices"]:
                _to_function_call(choice["message"])
                choice["finish_reason"] = _finish_reason(choice["finish_reason"])
        return response

    def stream(self, produce: Produce) -> Produce:
        """A chat completion's stream with each call's deltas as ``delta.function_call``."""
        if not self.active:
            return produce

        async def legacy(emit: Callable[[dict[str, Any]], Awaitable[None]], begin: Callable[[], Awaitable[None]]):
            async def emit_legacy(chunk: dict[str, Any]) -> None:
                for choice in chunk["choices"]:
                    _to_function_call(choice["delta"])
                    choice["finish_reason"] = _finish_reason(choice["finish_reason"])
                await emit(chunk)

            try:
                await produce(emit_legacy, begin)
            except RequestError as e:
                raise self.rename(e) from None

        return legacy


def _as_tools(body: ChatCompletionRequest) -> ChatCompletionRequest:
    if body.functions is not None and body.tools is not None:
        raise RequestError("functions and tools cannot both be given: functions is the deprecated form of tools", 400,
                           "functions")
    if body.function_call is not None and (body.tool_choice is not None or body.tools is not None):
        raise RequestError("function_call goes with functions; with tools, give tool_choice", 400, "function_call")
    if body.functions is not None and body.tool_choice is not None:
        raise RequestError("tool_choice goes with tools; with functions, give function_call", 400, "tool_choice")
    messages = _messages(body.messages)
    if body.functions is None and body.function_call is None:
        return body if messages is body.messages else msgspec.structs.replace(body, messages=messages)
    names = [f.name for f in body.functions or []]
    choice = body.function_call
    if isinstance(choice, dict):
        if choice.get("name") not in names:
            raise RequestError(f"function_call: no function {choice.get('name')!r} among the functions "
                               f"({', '.join(names)})", 400, "function_call")
        tool_choice: Any = {"type": "function", "function": {"name": choice["name"]}}
    elif choice in (None, "none", "auto"):
        if choice == "auto" and not names:
            raise RequestError("function_call: 'auto' needs functions", 400, "function_call")
        tool_choice = choice
    else:
        raise RequestError("function_call: allowed: 'none', 'auto' or {'name': ...}", 400, "function_call")
    tools = [ToolDef("function", f) for f in body.functions] if body.functions else None
    return msgspec.structs.replace(body, messages=messages, tools=tools, tool_choice=tool_choice,
                                   parallel_tool_calls=False, functions=None, function_call=None)


def _messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Earlier legacy calls and their results as tool calls and tool messages (the same list where there are
    none); a result answers the latest call of its function."""
    if not any(m.get("role") == "function" or m.get("function_call") is not None for m in messages):
        return messages
    converted, call_ids = [], {}
    for i, message in enumerate(messages):
        call = message.get("function_call")
        if call is not None and message.get("role") == "assistant":
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise RequestError(f"messages[{i}].function_call must be an object with name and arguments", 400,
                                   "messages")
            call_ids[call.get("name")] = call_id = f"call_{i}"
            message = {k: v for k, v in message.items() if k != "function_call"} | {
                "tool_calls": [{"id": call_id, "type": "function", "function": call}]}
        elif message.get("role") == "function":
            if not isinstance(message.get("name"), str):
                raise RequestError(f"messages[{i}].name: a function's result names its function", 400, "messages")
            message = message | {"role": "tool", "tool_call_id": call_ids.get(message["name"], "")}
        converted.append(message)
    return converted


def _to_function_call(message: dict[str, Any]) -> None:
    """A message's (or a delta's) first tool call, or its piece, as its ``function_call``."""
    calls = message.pop("tool_calls", None)
    if calls:
        message["function_call"] = dict(calls[0]["function"])


def _finish_reason(reason: str | None) -> str | None:
    return "function_call" if reason == "tool_calls" else reason
