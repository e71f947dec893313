"""OpenAI tool calling over a chat template: tools shown to the model, calls constrained and read back.

A template that knows tools (it mentions ``tools``) renders them and the
assistant's earlier ``tool_calls`` itself. For one that does not (SmolLM2's),
the tools are described in a system message in the Hermes format many
instruction-tuned models learned (``<tools>`` ... ``</tools>``, calls as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``), and earlier
calls are written into the assistant's text in that format.

``tool_choice`` "required" or a named function is enforced by structured
output: the reply must be one call, as JSON matching the tools' parameter
schemas. With "auto" the model chooses, and ``<tool_call>`` blocks in its
text are read as calls (all of them, or the first with
``parallel_tool_calls`` false). "none" shows the tools and reads no call.
Replies are read as they are generated (``tool_stream``), so a call's
arguments stream as they come.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from conveyor.api.reasoning import ThinkSplitter
from conveyor.api.tool_stream import ReplyReader
from conveyor.transport import RequestError


class FunctionDef(msgspec.Struct):
    name: str
    description: str | None = None
    # JSON Schema of the arguments
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(msgspec.Struct):
    type: str
    function: FunctionDef


class Tools:
    """One chat request's tools and its tool_choice."""

    def __init__(self, tools: list[ToolDef] | None, tool_choice: Any, parallel: bool | None = None):
        """
        Args:
            parallel: ``parallel_tool_calls`` (None: true, as OpenAI's default).

        Raises:
            RequestError: 400 naming the field (a choice without tools, an unknown function, ...).
        """
        self.tools = tools or []
        if any(t.type != "function" for t in self.tools):
            raise RequestError("tools: only type 'function' is supported", 400, "tools")
        names = [t.function.name for t in self.tools]
        if tool_choice is None:
            tool_choice = "auto" if self.tools else "none"
        if isinstance(tool_choice, dict):
            name = (tool_choice.get("function") or {}).get("name")
            if tool_choice.get("type") != "function" or name not in names:
                raise RequestError(f"tool_choice: no function {name!r} among the tools ({', '.join(names)})", 400,
                                   "tool_choice")
            self.forced: list[ToolDef] = [t for t in self.tools if t.function.name == name]
        elif tool_choice in ("auto", "none", "required"):
            if tool_choice != "none" and not self.tools:
                raise RequestError(f"tool_choice: {tool_choice!r} needs tools", 400, "tool_choice")
            self.forced = self.tools if tool_choice == "required" else []
        else:
            raise RequestError("tool_choice: allowed: 'none', 'auto', 'required' or {'type': 'function', "
                               "'function': {'name': ...}}", 400, "tool_choice")
        # whether the reply is read for calls
        self.active = bool(self.tools) and tool_choice != "none"
        self.parallel = parallel is not False

    def messages(self, messages: list[dict[str, Any]], template: str | None) -> tuple[list[dict[str, Any]], dict]:
        """The conversation and the template variables that show the tools to the model."""
        if template is not None and "tools" in template:
            return messages, ({"tools": [msgspec.to_builtins(t) for t in self.tools]} if self.tools else {})
        rendered = [_with_calls_in_text(m) for m in messages]
        if not self.tools:
            return rendered, {}
        if rendered and rendered[0].get("role") == "system":
            rendered[0] = {**rendered[0], "content": f"{rendered[0].get('content') or ''}\n\n{self._prompt()}"}
        else:
            rendered.insert(0, {"role": "system", "content": self._prompt()})
        return rendered, {}

    def _prompt(self) -> str:
        described = "\n".join(json.dumps(msgspec.to_builtins(t)) for t in self.tools)
        return ("You are a function calling AI model. You may call one or more functions to assist with the user "
                f"query. Here are the available tools: <tools>\n{described}\n</tools>\nFor each function call, return "
                'a JSON object with the function name and arguments within <tool_call></tool_call> tags:\n'
                '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def forced_schema(self) -> str | None:
        """The JSON schema a reply must match when tool_choice forces a call (None: not forced)."""
        if not self.forced:
            return None
        calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                  "arguments": t.function.parameters or {"type": "object"}},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in self.forced]
        return json.dumps(calls[0] if len(calls) == 1 else {"anyOf": calls})

    def reader(self, thinking: ThinkSplitter | None = None) -> ReplyReader:
        """A reader for one reply, which finds its calls as it is generated (after ``thinking``, a
        ``reasoning.ThinkSplitter``, took its thinking out)."""
        return ReplyReader(self.active, forced=bool(self.forced), parallel=self.parallel, thinking=thinking)

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A whole reply -> its text content (None when it is only calls) and its tool calls, OpenAI-shaped."""
        reader = self.reader()
        reader.feed(text, final=True)
        if not reader.calls:
            return reader.content, []
        return reader.content or None, reader.calls


def _with_calls_in_text(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's earlier tool_calls written into its text (for templates that do not know them)."""
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not calls:
        return message
    written = []
    for call in calls:
        function = call.get("function") or {}
        arguments = function.get("arguments") or "{}"
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            pass
        written.append(f"<tool_call>\n{json.dumps({'name': function.get('name'), 'arguments': arguments})}\n</tool_call>")
    text = "\n".join(filter(None, [message.get("content") or "", *written]))
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": text}
