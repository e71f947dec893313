"""A chat turn, as every transport runs it: the prompt with the tools shown to the model, the constraint a forced
call puts on the reply, the reader that splits the reply into thinking, text and tool calls as it is generated,
and the finish reason that says the reply is calls."""

from __future__ import annotations

import json
from typing import Any

from conveyor.api.reasoning import OPEN as THINK
from conveyor.api.reasoning import ThinkSplitter
from conveyor.api.tool_calls import Tools
from conveyor.api.tool_stream import ReplyReader
from conveyor.sampling import SamplingParams, StructuredOutput
from conveyor.transport import Frontend, RequestError


def chat_prompt(frontend: Frontend, messages: list[dict[str, Any]], tools: Tools, *,
                add_generation_prompt: bool = True, continue_final_message: bool = False) -> list[int]:
    """The conversation's prompt tokens with the tools shown to the model (tokenizing: call it off the event loop).

    Raises:
        RequestError: 400 naming the field (a message the template cannot render, ...).
    """
    messages, context = tools.messages(messages, frontend.tokenizer.chat_template)
    # (continuing the last message opens no new turn, whatever add_generation_prompt says; vLLM refuses both
    # at once, which a client that leaves add_generation_prompt at its default true then meets)
    context.update(add_generation_prompt=add_generation_prompt and not continue_final_message,
                   continue_final_message=continue_final_message)
    return frontend.encode_chat(messages, **context)


def constrain(params: SamplingParams, tools: Tools) -> None:
    """Where ``tool_choice`` forces a call, the reply must be one: its JSON schema becomes the structured output.

    Raises:
        RequestError: 400 on ``tool_choice``, when the request constrains its reply otherwise too.
    """
    schema = tools.forced_schema()
    if schema is None:
        return
    if params.structured is not None:
        raise RequestError("tool_choice forces a call, which response_format cannot constrain too", 400,
                           "tool_choice")
    params.structured = StructuredOutput(json=schema)


def thinks(frontend: Frontend, params: SamplingParams) -> bool:
    """Whether a chat reply is split into thinking and answer: with a reasoning parser, and not under structured
    output (the grammar holds from the reply's first token)."""
    return frontend.reasoning_parser == "think" and params.structured is None


def reply_reader(frontend: Frontend, prompt_ids: list[int], tools: Tools | None, params: SamplingParams) -> ReplyReader:
    """A reader for one chat reply: its thinking split off (``thinks``), then its tool calls read where ``tools``
    are active; all text otherwise."""
    thinking = None
    if thinks(frontend, params):
        tail = frontend.tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False)
        thinking = ThinkSplitter(prompt_opens_thinking=tail.rstrip().endswith(THINK))
    if tools is not None and tools.active:
        return tools.reader(thinking)
    return ReplyReader(False, thinking=thinking)


def finish_reason(reader: ReplyReader, reason: str | None) -> str | None:
    """A chat reply's finish reason, given the engine's: "tool_calls" when the reply stopped having made calls,
    each whole; max_tokens ending it is "length" whatever calls came whole before (a next call may have been cut
    before it could be read as one), as OpenAI's is, and an abort stays one. A call a stop string cut off keeps
    "stop"."""
    if reason == "stop" and reader.calls and all(map(arguments_complete, reader.calls)):
        return "tool_calls"
    return reason


def arguments_complete(call: dict[str, Any]) -> bool:
    """Whether an OpenAI-shaped tool call's arguments are whole JSON (not cut off while they were generated)."""
    try:
        json.loads(call["function"]["arguments"])
    except json.JSONDecodeError:
        return False
    return True
