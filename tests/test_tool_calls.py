"""OpenAI tool calling through the real server with the openai client: a forced call that matches the
function's schema, the tool's result sent back, a final answer; streamed and not. Tool-call reading and the
rendering of tools for a template that does not know them, on their own."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from conveyor.plugins.transport.tool_calls import ToolDef, Tools
from conveyor.transport import RequestError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                        "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": False},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}}, "required": ["zone"]}}}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_the_tool_calling_flow_end_to_end(openai_client, tool_choice):
    client = openai_client
    model = client.models.list().data[0].id
    tools = [WEATHER, TIME] if tool_choice == "required" else [TIME, WEATHER]
    first = client.chat.completions.create(model=model, messages=QUESTION, tools=tools, tool_choice=tool_choice,
                                           temperature=0, max_tokens=100)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in tools}[call.function.name]
    if tool_choice != "required":
        assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), schema)

    # the same call, streamed: deltas that the client's accumulation turns into the same call
    stream = client.chat.completions.create(model=model, messages=QUESTION, tools=tools, tool_choice=tool_choice,
                                            temperature=0, max_tokens=100, stream=True)
    name, arguments, finish = "", "", None
    for chunk in stream:
        for c in chunk.choices:
            for delta in c.delta.tool_calls or []:
                name += delta.function.name or ""
                arguments += delta.function.arguments or ""
            finish = c.finish_reason or finish
    assert (name, json.loads(arguments), finish) == (call.function.name, json.loads(call.function.arguments),
                                                     "tool_calls")

    # the tool's result goes back; the model answers in text
    conversation = [*QUESTION, choice.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})}]
    for stream in (False, True):
        final = client.chat.completions.create(model=model, messages=conversation, tools=tools, temperature=0,
                                               max_tokens=40, stream=stream)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in final if c.choices)
        else:
            assert final.choices[0].finish_reason in ("stop", "length") and not final.choices[0].message.tool_calls
            text = final.choices[0].message.content
        assert text and "<tool_call>" not in text


def test_bad_tool_choices_are_400s(openai_client):
    client = openai_client
    model = client.models.list().data[0].id
    for tools, choice, message in [
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "no function 'nope'"),
        (None, "required", "'required' needs tools"),
        ([WEATHER], "sometimes", "allowed: 'none', 'auto', 'required'"),
    ]:
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model=model, messages=QUESTION, max_tokens=5,
                                           **({"tools": tools} if tools else {}), tool_choice=choice)
        assert message in bad.value.body["message"] and bad.value.body["param"] == "tool_choice"


def tools_of(*defs) -> list[ToolDef]:
    import msgspec

    return [msgspec.convert(d, ToolDef) for d in defs]


def test_calls_are_read_from_hermes_blocks_when_the_model_chooses():
    tools = Tools(tools_of(WEATHER, TIME), "auto")
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
            '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>')
    content, calls = tools.parse(text)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"}), ("get_time", {"zone": "CET"})]
    assert tools.parse("No call <tool_call>not json</tool_call>") == ("No call <tool_call>not json</tool_call>", [])
    assert Tools(tools_of(WEATHER), "none").parse(text) == (text, [])


def test_a_template_without_tools_gets_them_in_a_system_message(tokenizer):
    tools = Tools(tools_of(WEATHER), "auto")
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Rome", "unit": "celsius"}'}}
    messages, context = tools.messages([*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
                                        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}],
                                       tokenizer.chat_template)
    assert context == {}
    prompt = tokenizer.apply_chat_template(messages)
    assert prompt.startswith("<|im_start|>system\nYou are a function calling AI model") and '"get_weather"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n</tool_call>' in prompt
    # a template that knows tools gets them as a variable, and the messages as they are
    knowing = "{% for t in tools %}{{ t.function.name }};{% endfor %}{% for m in messages %}{{ m.role }}{% endfor %}"
    messages, context = tools.messages(QUESTION, knowing)
    assert messages == QUESTION and context["tools"][0]["function"]["name"] == "get_weather"


def test_a_choice_without_tools_is_refused():
    with pytest.raises(RequestError, match="needs tools"):
        Tools(None, "auto")
    assert not Tools(None, None).active
