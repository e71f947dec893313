"""OpenAI tool calling through the real server with the openai client: a forced call that matches the
function's schema, the tool's result sent back, a final answer; streamed and not. Tool-call reading and the
rendering of tools for a template that does not know them, on their own."""

from __future__ import annotations

import itertools
import json
import re

import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.api.tool_calls import ToolDef, Tools
from conveyor.api.tool_stream import Arguments, CallStart, ReplyReader, Text
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


def test_a_streamed_call_arrives_as_argument_deltas_that_make_the_returned_call(openai_client):
    """Arguments stream as they are generated: several deltas, which join into exactly the arguments the same
    request gets unstreamed (greedy)."""
    client = openai_client
    model = client.models.list().data[0].id
    request = {"model": model, "messages": QUESTION, "tools": [WEATHER], "tool_choice": "required",
               "temperature": 0, "max_tokens": 100}
    whole = client.chat.completions.create(**request).choices[0].message.tool_calls[0]
    deltas, starts = [], []
    for chunk in client.chat.completions.create(**request, stream=True):
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if delta.id is not None:
                starts.append((delta.index, delta.id, delta.function.name))
            if delta.function.arguments:
                deltas.append(delta.function.arguments)
    assert [(index, name) for index, _, name in starts] == [(0, "get_weather")]
    assert len(deltas) >= 2 and "".join(deltas) == whole.function.arguments
    jsonschema.validate(json.loads("".join(deltas)), WEATHER["function"]["parameters"])


def test_a_call_cut_off_by_max_tokens_ends_by_length(openai_client):
    """A forced call that max_tokens cuts off halfway is no call to run: the choice ends by "length" (as OpenAI's
    does), its arguments as far as they came, streamed and not (greedy: the same text)."""
    client = openai_client
    model = client.models.list().data[0].id
    request = {"model": model, "messages": QUESTION, "tools": [WEATHER], "tool_choice": "required",
               "temperature": 0, "max_tokens": 16}
    choice = client.chat.completions.create(**request).choices[0]
    [call] = choice.message.tool_calls
    with pytest.raises(json.JSONDecodeError):
        json.loads(call.function.arguments)
    assert choice.finish_reason == "length"
    arguments, finish = "", None
    for chunk in client.chat.completions.create(**request, stream=True):
        for c in chunk.choices:
            arguments += "".join(d.function.arguments or "" for d in c.delta.tool_calls or [])
            finish = c.finish_reason or finish
    assert (arguments, finish) == (call.function.arguments, "length")


def test_max_tokens_after_a_whole_call_ends_by_length(openai_client, tokenizer):
    """Two calls forced by a regex, the budget ending inside the second's block: the first call comes whole, and
    the choice still ends by "length" (as OpenAI's does), not "tool_calls", which would say the turn's calls are
    all there."""
    client = openai_client
    model = client.models.list().data[0].id
    first = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    second = '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}\n</tool_call>'
    request = {"model": model, "messages": QUESTION, "tools": [WEATHER, TIME], "temperature": 0,
               "max_tokens": len(tokenizer.encode(first)) + 4,
               "extra_body": {"structured_outputs": {"regex": re.escape(first + second)}}}
    choice = client.chat.completions.create(**request).choices[0]
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Paris"
    assert choice.finish_reason == "length"
    finish = None
    for chunk in client.chat.completions.create(**request, stream=True):
        finish = next((c.finish_reason for c in chunk.choices if c.finish_reason), finish)
    assert finish == "length"


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
    # parallel_tool_calls=false: the first call only
    content, calls = Tools(tools_of(WEATHER, TIME), "auto", parallel=False).parse(text)
    assert content == "Let me check." and [c["function"]["name"] for c in calls] == ["get_weather"]


def read_in_pieces(reader: ReplyReader, pieces: list[str]) -> list:
    parts = []
    for i, piece in enumerate(pieces):
        parts += reader.feed(piece, final=i == len(pieces) - 1)
    return parts


CALL_TEXTS = [
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n'
     '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "C\\"E}T"}}</tool_call> Done.'),
    'No call <tool_call>not json</tool_call> and <tool_call>{"id": 1}</tool_call> text',
    '<tool_call>{"arguments": {"a": [1, {"b": "}"}]}, "name": "f"}</tool_call>',
    '<tool_call>{"name": "f", "parameters": "{\\"a\\": 1}"}</tool_call>',
    'cut short <tool_call>{"name": "f", "arguments": {"a": 1',
    'a tag cut short <tool_c',
]


@settings(max_examples=200, deadline=None)
@given(text=st.sampled_from(CALL_TEXTS), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_a_reply_read_in_any_pieces_is_read_as_whole(text, cuts):
    """However the reply's text is split into pieces, the reader finds the same text and calls as from the whole
    text, and each call's argument deltas join into its arguments."""
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)] or [""]
    whole, split = ReplyReader(True), ReplyReader(True)
    read_in_pieces(whole, [text])
    parts = read_in_pieces(split, pieces)
    assert split.content == whole.content == "".join(p.text for p in parts if isinstance(p, Text))
    assert [c["function"] for c in split.calls] == [c["function"] for c in whole.calls]
    for index, call in enumerate(split.calls):
        assert "".join(p.delta for p in parts if isinstance(p, Arguments) and p.index == index) == \
            call["function"]["arguments"]
        assert [p.id for p in parts if isinstance(p, CallStart) and p.index == index] == [call["id"]]


def test_what_the_reader_finds_in_each_reply():
    found = []
    for text in CALL_TEXTS:
        reader = ReplyReader(True)
        reader.feed(text, final=True)
        found.append((reader.content, [(c["function"]["name"], c["function"]["arguments"]) for c in reader.calls]))
    assert found == [
        ("Let me check.Done.", [("get_weather", '{"city": "Oslo", "unit": "celsius"}'),
                                ("get_time", '{"zone": "C\\"E}T"}')]),
        ('No call <tool_call>not json</tool_call> and <tool_call>{"id": 1}</tool_call> text', []),
        ("", [("f", '{"a": [1, {"b": "}"}]}')]),
        ("", [("f", '{"a": 1}')]),  # (arguments sent as a JSON string: the JSON in it)
        ("cut short", [("f", '{"a": 1')]),  # (the reply ran out of tokens inside the call)
        ("a tag cut short <tool_c", []),
    ]
    forced = ReplyReader(True, forced=True)
    read_in_pieces(forced, list('{"name": "get_time", "arguments": {"zone": "UTC"}}'))
    assert forced.content == "" and forced.calls[0]["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    plain = ReplyReader(False)
    read_in_pieces(plain, ["<tool_call>", '{"name": "f"}'])
    assert plain.content == '<tool_call>{"name": "f"}' and plain.calls == []


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
