"""Anthropic's Messages API on the real server, through Anthropic's own client: each answer checked against the
same conversation sent as chat completions (greedy, so the two must agree token for token) and the prompt's
length against transformers' rendering of the chat template."""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import jsonschema
import pytest

WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                      "unit": {"enum": ["celsius", "fahrenheit"]}},
                     "required": ["city", "unit"], "additionalProperties": False},
}
# (the client no longer sends temperature, which newer Anthropic models do not take; the server still reads it)
GREEDY = {"extra_body": {"temperature": 0}}
QUESTION = "Name three large cities in France and say one thing about each."


@pytest.fixture(scope="module")
def client(default_server):
    with anthropic.Anthropic(base_url=default_server.http, api_key="unused", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def model(openai_client):
    return openai_client.models.list().data[0].id


def chat(openai_client, model, messages, **fields):
    return openai_client.chat.completions.create(model=model, messages=messages, temperature=0, **fields)


def test_a_text_reply_is_the_chat_completion_of_the_same_conversation(client, openai_client, model, hf_tokenizer):
    system = "You answer in one short paragraph."
    reply = client.messages.create(model=model, max_tokens=24, system=system, **GREEDY,
                                   messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}])
    messages = [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]
    expected = chat(openai_client, model, messages, max_tokens=24)
    assert reply.type == "message" and reply.role == "assistant" and reply.model == model
    assert [block.type for block in reply.content] == ["text"]
    assert reply.content[0].text == expected.choices[0].message.content
    assert reply.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[expected.choices[0].finish_reason]
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 24
    rendered = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    # (Anthropic's count: the prompt is the tokens computed plus those read from the cache)
    prompt = reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    assert prompt == len(getattr(rendered, "input_ids", rendered))
    counted = client.messages.count_tokens(model=model, system=system, messages=[{"role": "user", "content": QUESTION}])
    assert counted.input_tokens == prompt
    asked = [{"role": "user", "content": QUESTION}]
    for ask in (lambda: client.messages.create(model="nope", max_tokens=2, messages=asked),
                lambda: client.messages.count_tokens(model="nope", messages=asked)):  # (a 404 for both)
        with pytest.raises(anthropic.NotFoundError, match="the model 'nope' does not exist"):
            ask()


def test_a_stop_sequence_ends_the_reply_and_is_named(client, openai_client, model):
    whole = chat(openai_client, model, [{"role": "user", "content": QUESTION}], max_tokens=40).choices[0].message.content
    words = whole.split()
    stop = next(w for w in words[3:] if len(w) > 3)  # a word past the start
    reply = client.messages.create(model=model, max_tokens=40, **GREEDY, stop_sequences=["@@none@@", stop],
                                   messages=[{"role": "user", "content": QUESTION}])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert reply.content[0].text == whole[:whole.index(stop)]


def test_cached_prompt_tokens_are_not_counted_twice(client, model):
    """Anthropic's usage: input_tokens + cache_read_input_tokens is the prompt. A prompt sent again is read from
    the prefix cache, and the streamed reply starts (message_start, which clients read the input usage from) and
    ends (message_delta) with the same usage as the one unstreamed."""
    request = {"model": model, "max_tokens": 4, **GREEDY,
               "messages": [{"role": "user", "content": QUESTION + " Answer in French, please."}]}
    first, again = client.messages.create(**request), client.messages.create(**request)
    total = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens == total - again.usage.cache_read_input_tokens
    with client.messages.stream(**request) as stream:
        start = next(event for event in stream if event.type == "message_start").message.usage
        streamed = stream.get_final_message()
    assert streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens == total
    assert streamed.usage.cache_read_input_tokens == again.usage.cache_read_input_tokens
    assert (start.input_tokens, start.cache_read_input_tokens) == (again.usage.input_tokens,
                                                                   again.usage.cache_read_input_tokens)


def test_a_final_assistant_message_is_continued(client, openai_client, model, hf_tokenizer):
    """Anthropic's prefill: a conversation that ends with the assistant's words has the model go on with them
    (the template's end-of-turn cut, no new turn opened): its prompt is transformers' rendering with
    continue_final_message, and the reply is the continuation chat completions give with vLLM's
    continue_final_message."""
    start = "The capital of France is"
    messages = [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": start}]
    reply = client.messages.create(model=model, max_tokens=6, **GREEDY, messages=messages)
    rendered = hf_tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=True)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == len(getattr(rendered, "input_ids",
                                                                                          rendered))
    expected = chat(openai_client, model, messages, max_tokens=6,
                    extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert reply.content[0].text == expected.choices[0].message.content
    assert expected.usage.prompt_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens


def test_a_tool_use_round_trip(client, openai_client, model):
    question = {"role": "user", "content": "What is the weather like in Paris today?"}
    first = client.messages.create(model=model, max_tokens=100, **GREEDY, tools=[WEATHER],
                                   tool_choice={"type": "any"}, messages=[question])
    assert first.stop_reason == "tool_use"
    (use,) = [block for block in first.content if block.type == "tool_use"]
    assert use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER["input_schema"])
    result = {"type": "tool_result", "tool_use_id": use.id, "content": '{"temperature": 21, "sky": "clear"}'}
    history = [question, {"role": "assistant", "content": [block.model_dump() for block in first.content]},
               {"role": "user", "content": [result]}]
    # (a few tokens: the second of two equal prompts runs from the prefix cache, whose rounding may tip a near tie
    # further on)
    second = client.messages.create(model=model, max_tokens=8, **GREEDY, tools=[WEATHER], messages=history)
    # the same conversation as chat completions: the call, then the tool's message
    tool = {"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                             "parameters": WEATHER["input_schema"]}}
    call = {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}
    expected = chat(openai_client, model, [question, {"role": "assistant", "content": None, "tool_calls": [call]},
                                           {"role": "tool", "tool_call_id": use.id, "content": result["content"]}],
                    tools=[tool], max_tokens=8)
    text = "".join(block.text for block in second.content if block.type == "text")
    assert text == (expected.choices[0].message.content or "")
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == expected.usage.prompt_tokens


def test_a_stream_is_anthropics_event_sequence_and_the_same_reply(client, model):
    request = {"model": model, "max_tokens": 20, **GREEDY, "messages": [{"role": "user", "content": QUESTION}]}
    whole = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    raw = [e for e in events if e in ("message_start", "content_block_start", "content_block_delta",
                                      "content_block_stop", "message_delta", "message_stop")]
    assert raw[:2] == ["message_start", "content_block_start"] and raw[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(raw[2:-3]) == {"content_block_delta"} and len(raw) - 5 >= 2
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    # Anthropic's message ids: "msg_" and a part of letters, digits, "_" and "-", each reply its own
    assert re.fullmatch(r"msg_[\w-]+", whole.id) and re.fullmatch(r"msg_[\w-]+", final.id) and whole.id != final.id


def test_a_streamed_tool_use_streams_its_input(client, model):
    """The tool's input arrives in several input_json_delta events, which join into the input of the same request
    unstreamed (greedy)."""
    request = {"model": model, "max_tokens": 100, **GREEDY, "tools": [WEATHER],
               "tool_choice": {"type": "tool", "name": "get_weather"},
               "messages": [{"role": "user", "content": "Weather in Rome?"}]}
    whole = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_message()
    (use,) = [block for block in final.content if block.type == "tool_use"]
    jsonschema.validate(use.input, WEATHER["input_schema"])
    assert final.stop_reason == "tool_use" and use.input == whole.content[0].input
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"
              and e.delta.type == "input_json_delta"]
    assert len(pieces) >= 2 and json.loads("".join(pieces)) == use.input


def test_a_tool_use_cut_off_by_max_tokens_stops_for_max_tokens(client, model):
    """A forced tool_use that max_tokens cuts off halfway is not one to run: stop_reason "max_tokens" (not
    "tool_use"), streamed and not, and its input as far as it came, marked partial."""
    request = {"model": model, "max_tokens": 16, **GREEDY, "tools": [WEATHER], "tool_choice": {"type": "any"},
               "messages": [{"role": "user", "content": "Weather in Rome?"}]}
    reply = client.messages.create(**request)
    (use,) = [block for block in reply.content if block.type == "tool_use"]
    assert reply.stop_reason == "max_tokens" and set(use.input) == {"_partial_arguments"}
    with client.messages.stream(**request) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens" and [block.type for block in final.content] == ["tool_use"]


def test_disable_parallel_tool_use_leaves_one_tool_use(client, model):
    """Shown an earlier turn that called the tool three times, the model calls it more than once again (three
    times on one CPU, twice on another: greedy tokens follow the kernels' rounding); with
    tool_choice.disable_parallel_tool_use only the first of them comes back, streamed and not."""
    def use(i, city):
        return {"type": "tool_use", "id": f"toolu_{i}", "name": WEATHER["name"], "input": {"city": city,
                                                                                          "unit": "celsius"}}

    weather = {"Oslo": "5 C", "Lima": "20 C", "Cairo": "30 C"}
    messages = [{"role": "user", "content": "Weather in Oslo, Lima and Cairo?"},
                {"role": "assistant", "content": [use(i, city) for i, city in enumerate(weather)]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": answer}
                                             for i, answer in enumerate(weather.values())]},
                {"role": "assistant", "content": "Oslo 5 C, Lima 20 C, Cairo 30 C."},
                {"role": "user", "content": "Weather in Tokyo, Madrid and Quito?"}]
    request = {"model": model, "max_tokens": 150, **GREEDY, "tools": [WEATHER], "messages": messages}
    parallel = client.messages.create(**request, tool_choice={"type": "auto"})
    assert len(parallel.content) >= 2 and {block.type for block in parallel.content} == {"tool_use"}, parallel.content
    single = client.messages.create(**request, tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [block.type for block in single.content] == ["tool_use"] and single.stop_reason == "tool_use"
    assert single.content[0].input == parallel.content[0].input
    with client.messages.stream(**request, tool_choice={"type": "auto", "disable_parallel_tool_use": True}) as stream:
        streamed = stream.get_final_message()
    assert [block.input for block in streamed.content] == [single.content[0].input]


def test_bad_requests_get_anthropics_error_shape(client, default_server, model):
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=model, max_tokens=10, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": ""}}]}])
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[0]: image blocks are not supported" in caught.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="no-such-model", max_tokens=10, messages=[{"role": "user", "content": "Hi"}])
    assert caught.value.body["error"]["type"] == "not_found_error"
    # no max_tokens, a tool_use from the user, and a stream that cannot fit the context: each a 400 in that shape
    url = f"{default_server.http}/v1/messages"
    for body in ({"messages": [{"role": "user", "content": "Hi"}]},
                 {"max_tokens": 5, "messages": [{"role": "user", "content": [
                     {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
                 {"max_tokens": 10**6, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}):
        response = httpx.post(url, json=body, timeout=60)
        assert response.status_code == 400, response.text
        assert response.json()["type"] == "error" and response.json()["error"]["message"], response.text


def test_sampling_fields_outside_anthropics_ranges_are_refused(default_server, model):
    """Anthropic's API refuses a temperature outside [0, 1] and a negative top_k: a client written for it gets the
    same 400 here, not a reply sampled as vLLM reads the value (hotter than 1, or top_k -1 as no limit)."""
    url = f"{default_server.http}/v1/messages"
    request = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    for field, value in (("temperature", 1.5), ("temperature", -0.5), ("top_k", -1)):
        response = httpx.post(url, json={**request, field: value}, timeout=60)
        assert response.status_code == 400, (field, value, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and field in error["message"], error
    for field, value in (("temperature", 1.0), ("top_k", 0)):
        assert httpx.post(url, json={**request, field: value}, timeout=60).status_code == 200, (field, value)
    # /openapi.json says the same ranges, so that a client generating from it sends none of the refused values
    document = httpx.get(f"{default_server.http}/openapi.json", timeout=60).json()
    validator = jsonschema.Draft202012Validator({"$ref": "#/components/schemas/MessagesRequest", **document})
    for field, value in (("temperature", 1.5), ("temperature", -0.5), ("top_k", -1)):
        assert not validator.is_valid({**request, field: value}), (field, value)
    for field, value in (("temperature", 1.0), ("top_k", 0)):
        assert validator.is_valid({**request, field: value}), (field, value)


def test_images_and_documents_are_refused_by_name(client, model):
    """An image or a document block, in a message or in a tool's result, and counted or sent, is a 400 that says
    the block is not supported where it is, not a complaint about its type's value."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    document = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "Some text."}}
    asked = {"type": "tool_use", "id": "toolu_1", "name": WEATHER["name"], "input": {"city": "Oslo", "unit": "celsius"}}
    cases = [([{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}],
              "messages[0].content[1]: image blocks are not supported"),
             ([{"role": "user", "content": [document]}], "messages[0].content[0]: document blocks are not supported"),
             ([{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": [asked]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [image]}]}],
              "messages[2].content[0].content[0]: image blocks are not supported")]
    for messages, expected in cases:
        for send in (lambda: client.messages.create(model=model, max_tokens=1, messages=messages, tools=[WEATHER]),
                     lambda: client.messages.count_tokens(model=model, messages=messages, tools=[WEATHER])):
            with pytest.raises(anthropic.BadRequestError) as caught:
                send()
            assert caught.value.body["error"]["type"] == "invalid_request_error"
            assert expected in caught.value.body["error"]["message"], caught.value.body


def test_a_final_assistant_message_ending_in_whitespace_is_refused(client, model):
    """As Anthropic's API does, a prefill that ends in whitespace is a 400 naming the message, sent or counted,
    not a continuation of a prompt cut after a space."""
    question = {"role": "user", "content": "What is the capital of France?"}
    for content in ("The capital of France is ", [{"type": "text", "text": "The capital of France is\n"}]):
        messages = [question, {"role": "assistant", "content": content}]
        for send in (lambda: client.messages.create(model=model, max_tokens=1, messages=messages),
                     lambda: client.messages.count_tokens(model=model, messages=messages)):
            with pytest.raises(anthropic.BadRequestError) as caught:
                send()
            error = caught.value.body["error"]
            assert error["type"] == "invalid_request_error" and error["message"].startswith("messages[1]:"), error
            assert "whitespace" in error["message"], error


def test_tools_and_tool_choice_are_checked_in_the_requests_words(client, model):
    """Two tools of one name are a 400, as in Anthropic's API (which of them a call means could not be told); a
    tool_choice of "any" or "tool" without tools is a 400 that names the type sent, not the chat path's "required"."""
    question = [{"role": "user", "content": "Weather in Oslo?"}]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=model, max_tokens=1, messages=question, tools=[WEATHER, {**WEATHER,
                                                                                            "description": "Other."}])
    message = caught.value.body["error"]["message"]
    assert "'get_weather'" in message and "unique" in message, message
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        with pytest.raises(anthropic.BadRequestError) as caught:
            client.messages.create(model=model, max_tokens=1, messages=question, tool_choice=choice)
        assert caught.value.body["error"]["message"] == f"tool_choice: type '{choice['type']}' needs tools"


def test_bad_stop_sequences_are_refused_by_their_name(default_server, model):
    """An empty stop sequence, one too long or too many of them: a 400 naming stop_sequences, the field sent, not
    the chat path's "stop"."""
    url = f"{default_server.http}/v1/messages"
    request = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    for stop_sequences in ([""], ["x" * 300], [f"s{i}" for i in range(17)]):
        response = httpx.post(url, json={**request, "stop_sequences": stop_sequences}, timeout=60)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["message"].startswith("stop_sequences"), response.text
