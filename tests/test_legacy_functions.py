"""OpenAI's legacy function calling (``functions``, ``function_call``) through the real server with the openai
client: run as the same request in tools would run (greedy: the same call, the same answer to its result), and
answered in the legacy shape (``message.function_call``, finish_reason "function_call"; streamed,
``delta.function_call``)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False},
}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]
GREEDY = {"temperature": 0, "max_tokens": 60}


@pytest.fixture(scope="module")
def model(openai_client) -> str:
    return openai_client.models.list().data[0].id


def tools(*functions: dict) -> list[dict]:
    return [{"type": "function", "function": f} for f in functions]


def test_a_forced_function_call_is_the_forced_tool_call_in_the_legacy_shape(openai_client, model):
    """function_call {"name": ...} over functions makes the call tool_choice over tools makes (name and
    arguments, matching the function's schema), as message.function_call with finish_reason "function_call" and
    no tool_calls; streamed, delta.function_call pieces that join into it."""
    client = openai_client
    legacy = client.chat.completions.create(model=model, messages=QUESTION, functions=[TIME, WEATHER],
                                            function_call={"name": "get_weather"}, **GREEDY).choices[0]
    reference = client.chat.completions.create(
        model=model, messages=QUESTION, tools=tools(TIME, WEATHER),
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, **GREEDY).choices[0]
    [call] = reference.message.tool_calls
    assert legacy.finish_reason == "function_call" and legacy.message.tool_calls is None
    assert (legacy.message.function_call.name, legacy.message.function_call.arguments) == (
        call.function.name, call.function.arguments) and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["parameters"])

    name, arguments, finish, pieces = "", "", None, 0
    for chunk in client.chat.completions.create(model=model, messages=QUESTION, functions=[TIME, WEATHER],
                                                function_call={"name": "get_weather"}, stream=True, **GREEDY):
        for choice in chunk.choices:
            assert choice.delta.tool_calls is None
            if choice.delta.function_call is not None:
                name += choice.delta.function_call.name or ""
                arguments += choice.delta.function_call.arguments or ""
                pieces += 1
            finish = choice.finish_reason or finish
    assert (name, arguments, finish) == ("get_weather", call.function.arguments, "function_call") and pieces >= 2


def test_a_function_result_goes_back_as_a_tool_result(openai_client, model):
    """The legacy conversation (the assistant's function_call, then a message of role "function" with the
    result) gets the answer that the same conversation in tool calls and a tool message gets."""
    client = openai_client
    call = client.chat.completions.create(model=model, messages=QUESTION, functions=[WEATHER],
                                          function_call={"name": "get_weather"}, **GREEDY).choices[0].message
    result = json.dumps({"temperature": 21, "sky": "sunny"})
    legacy = [*QUESTION, call.model_dump(exclude_none=True), {"role": "function", "name": "get_weather",
                                                              "content": result}]
    as_tools = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": call.function_call.model_dump()}]},
        {"role": "tool", "tool_call_id": "call_1", "content": result}]
    answer = client.chat.completions.create(model=model, messages=legacy, functions=[WEATHER], **GREEDY).choices[0]
    reference = client.chat.completions.create(model=model, messages=as_tools, tools=tools(WEATHER),
                                               **GREEDY).choices[0]
    assert answer.message.content and answer.message.function_call is None
    assert (answer.message.content, answer.finish_reason) == (reference.message.content, reference.finish_reason)


def test_function_call_none_answers_in_text_as_tool_choice_none(openai_client, model):
    client = openai_client
    legacy = client.chat.completions.create(model=model, messages=QUESTION, functions=[WEATHER],
                                            function_call="none", **GREEDY).choices[0]
    reference = client.chat.completions.create(model=model, messages=QUESTION, tools=tools(WEATHER),
                                               tool_choice="none", **GREEDY).choices[0]
    assert legacy.message.function_call is None and legacy.finish_reason != "function_call"
    assert legacy.message.content == reference.message.content


@pytest.mark.parametrize("fields, param, words", [
    ({"functions": [WEATHER], "tools": tools(WEATHER)}, "functions", ["functions and tools"]),
    ({"functions": [WEATHER], "function_call": "auto", "tool_choice": "auto"}, "function_call", ["tool_choice"]),
    ({"tools": tools(WEATHER), "function_call": "auto"}, "function_call", ["with tools"]),
    ({"functions": [WEATHER], "function_call": {"name": "nope"}}, "function_call", ["no function 'nope'"]),
    ({"function_call": "auto"}, "function_call", ["'auto' needs functions"]),
    ({"functions": [WEATHER], "function_call": "sometimes"}, "function_call", ["allowed: 'none', 'auto'"]),
    ({"functions": [WEATHER], "function_call": {"name": "get_weather"}, "response_format": {"type": "json_object"}},
     "function_call", ["function_call forces a call"]),
    ({"functions": [WEATHER], "tool_choice": "required"}, "tool_choice", ["with functions, give function_call"]),
    ({"messages": [*QUESTION, {"role": "function", "name": ["get_weather"], "content": "sunny"}]}, "messages",
     ["messages[1].name"]),
    ({"messages": [*QUESTION, {"role": "assistant", "content": None, "function_call": {"name": ["f"]}}]},
     "messages", ["messages[1].function_call must be an object"]),
], ids=["functions and tools", "function_call and tool_choice", "function_call with tools", "unknown function",
        "auto without functions", "no such choice", "forced with response_format", "functions and tool_choice",
        "a result's name not a string", "a call's name not a string"])
def test_legacy_fields_that_conflict_are_400s_naming_them(openai_client, model, fields, param, words):
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.chat.completions.create(**{"model": model, "messages": QUESTION, "max_tokens": 5, **fields})
    assert refused.value.param == param
    for word in words:
        assert word in refused.value.message, refused.value.message
