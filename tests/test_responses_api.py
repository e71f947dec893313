"""OpenAI's Responses API on the real server, through the openai client: each answer checked against the same
conversation sent as chat completions (greedy, so the two agree token for token), a follow-up through the stored
conversation, a function-tool round trip, a JSON-schema format validated, and the stream's typed events."""

from __future__ import annotations

import json
import os
import signal

import httpx
import jsonschema
import openai
import pytest

from tests.server import Server, http_config

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False},
}
QUESTION = "Name three large cities in France and say one thing about each."


@pytest.fixture(scope="module")
def model(openai_client):
    return openai_client.models.list().data[0].id


def chat(openai_client, model, messages, **fields):
    return openai_client.chat.completions.create(model=model, messages=messages, temperature=0, **fields)


def test_text_with_instructions_is_the_chat_completion(openai_client, model):
    response = openai_client.responses.create(model=model, input=QUESTION, instructions="Answer briefly.",
                                              temperature=0, max_output_tokens=16)
    expected = chat(openai_client, model, [{"role": "system", "content": "Answer briefly."},
                                           {"role": "user", "content": QUESTION}], max_tokens=16)
    assert response.object == "response" and response.model == model
    assert response.output_text == expected.choices[0].message.content
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == expected.usage.prompt_tokens
    assert response.usage.output_tokens == 16 == response.usage.total_tokens - response.usage.input_tokens


def test_a_response_is_what_openais_response_model_requires(openai_client, model):
    """The whole reply validates as the openai package's Response (every field it requires present, usage's
    input_tokens_details included); the input tokens split into those the prefix cache served and those written to
    it, and a second ask of the same input is served from it."""
    from openai.types.responses import Response

    url = f"{openai_client.base_url}responses".replace("/v1/v1", "/v1")
    body = {"model": model, "input": QUESTION * 3, "temperature": 0, "max_output_tokens": 4}
    first, again = (Response.model_validate(httpx.post(url, json=body, timeout=60).json()) for _ in range(2))
    assert first.tool_choice == "auto"  # (OpenAI's default echo, with no tools given)
    for response in (first, again):
        details = response.usage.input_tokens_details
        assert details.cached_tokens + details.cache_write_tokens == response.usage.input_tokens
    assert again.usage.input_tokens_details.cached_tokens > first.usage.input_tokens_details.cached_tokens


def test_a_follow_up_continues_the_stored_conversation(openai_client, model):
    first = openai_client.responses.create(model=model, input=[{"role": "user", "content": "Name a city in Italy."}],
                                           temperature=0, max_output_tokens=10)
    follow_up = "And one in Spain?"
    second = openai_client.responses.create(model=model, input=follow_up, previous_response_id=first.id,
                                            temperature=0, max_output_tokens=10)
    assert second.previous_response_id == first.id
    expected = chat(openai_client, model, [{"role": "user", "content": "Name a city in Italy."},
                                           {"role": "assistant", "content": first.output_text},
                                           {"role": "user", "content": follow_up}], max_tokens=10)
    assert second.usage.input_tokens == expected.usage.prompt_tokens
    assert second.output_text == expected.choices[0].message.content
    assert openai_client.responses.retrieve(first.id).output_text == first.output_text
    openai_client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.responses.create(model=model, input="Hi", previous_response_id=first.id)
    assert caught.value.body["param"] == "previous_response_id"
    # not stored: nothing to follow
    unstored = openai_client.responses.create(model=model, input="Hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(unstored.id)


def test_a_function_tool_round_trip(openai_client, model):
    question = "What is the weather like in Paris today?"
    first = openai_client.responses.create(model=model, input=question, tools=[WEATHER], tool_choice="required",
                                           temperature=0, max_output_tokens=100)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    output = '{"temperature": 21, "sky": "clear"}'
    # the call's output sent back as an item, after the stored conversation
    second = openai_client.responses.create(
        model=model, previous_response_id=first.id, tools=[WEATHER], temperature=0, max_output_tokens=8,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": output}])
    tool = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}
    chat_call = {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    expected = chat(openai_client, model, [{"role": "user", "content": question},
                                           {"role": "assistant", "content": None, "tool_calls": [chat_call]},
                                           {"role": "tool", "tool_call_id": call.call_id, "content": output}],
                    tools=[tool], max_tokens=8)
    assert second.usage.input_tokens == expected.usage.prompt_tokens
    assert second.output_text == (expected.choices[0].message.content or "")
    # the same conversation given whole, as items, needs no stored response
    items = openai_client.responses.create(
        model=model, tools=[WEATHER], temperature=0, max_output_tokens=8, store=False,
        input=[{"role": "user", "content": [{"type": "input_text", "text": question}]},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": output}])
    assert items.usage.input_tokens == expected.usage.prompt_tokens


def test_a_json_schema_format_gives_a_valid_answer(openai_client, model):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20}},
              "required": ["city", "country"], "additionalProperties": False}
    response = openai_client.responses.create(
        model=model, input="Give a city and its country as JSON.", max_output_tokens=60, temperature=0,
        text={"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"


@pytest.mark.parametrize(("max_output_tokens", "last"), [(100, "response.completed"), (3, "response.incomplete")])
def test_a_stream_is_the_typed_event_sequence_and_the_same_response(openai_client, model, max_output_tokens, last):
    request = {"model": model, "input": "What is 2+2? Answer with a number.", "temperature": 0,
               "max_output_tokens": max_output_tokens}
    whole = openai_client.responses.create(**request)
    with openai_client.responses.stream(**request) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          last]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) >= 2 and "".join(deltas) == whole.output_text == events[-4].text
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    assert final.id == events[0].response.id and final.output_text == whole.output_text
    assert final.status == whole.status and final.usage.output_tokens == whole.usage.output_tokens
    if last == "response.completed":  # (the client's own accumulation, which only a completed response ends)
        assert stream.get_final_response().output_text == whole.output_text


def test_a_streamed_function_call_streams_its_arguments(openai_client, model):
    """The arguments arrive in several deltas, which join into those of the same request unstreamed (greedy)."""
    request = {"model": model, "input": "Weather in Rome?", "tools": [WEATHER], "temperature": 0,
               "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 100}
    whole = openai_client.responses.create(**request)
    with openai_client.responses.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_response()
    (call,) = [item for item in final.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert call.arguments == whole.output[0].arguments
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) >= 2 and "".join(deltas) == call.arguments
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [call.arguments]


def test_a_function_call_cut_off_by_max_output_tokens_is_incomplete(openai_client, model):
    """A forced call that max_output_tokens cuts off halfway: the response and the function_call item are both
    "incomplete", streamed (the item's output_item.done and the final response) and not."""
    request = {"model": model, "input": "Weather in Rome?", "tools": [WEATHER], "tool_choice": "required",
               "temperature": 0, "max_output_tokens": 16}
    whole = openai_client.responses.create(**request)
    (call,) = whole.output
    assert (whole.status, call.type, call.status) == ("incomplete", "function_call", "incomplete")
    with pytest.raises(json.JSONDecodeError):
        json.loads(call.arguments)
    with openai_client.responses.stream(**request) as stream:
        events = list(stream)
    (done,) = [e for e in events if e.type == "response.output_item.done"]
    assert done.item.status == "incomplete" and done.item.arguments == call.arguments
    assert events[-1].type == "response.incomplete" and events[-1].response.output[0].status == "incomplete"


def test_an_engine_failing_mid_stream_ends_it_with_an_error_then_response_failed(default_server, model):
    """The engine killed while a response streams: an ``error`` event, then ``response.failed`` with the
    response as far as it came, both numbered in sequence like every other event (OpenAI's ResponseErrorEvent
    needs it); the engine restarts and serves again."""
    from openai.types.responses import ResponseError, ResponseErrorEvent

    body = {"model": model, "input": QUESTION, "max_output_tokens": 2000, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", f"{default_server.http}/v1/responses", json=body, timeout=120) as response:
        data = (json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: "))
        for event in data:
            events.append(event)
            if event["type"] == "response.output_text.delta":
                break
        killed = default_server.engine_pid
        os.kill(killed, signal.SIGSTOP)  # (the stream cannot end on its own from here, however fast the device)
        os.kill(killed, signal.SIGKILL)
        events += data
    default_server.wait_for(lambda: default_server.engine_pid != killed
                            and httpx.get(f"{default_server.http}/health").status_code == 200,
                            timeout=180, what="the engine to restart")
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert [event["type"] for event in events[-2:]] == ["error", "response.failed"]
    error = ResponseErrorEvent.model_validate(events[-2])
    failed = events[-1]["response"]
    assert failed["id"] == events[0]["response"]["id"] and failed["status"] == "failed"
    assert ResponseError.model_validate(failed["error"]).code == "server_error"
    assert failed["error"]["message"] == error.message and "engine" in error.message
    text = "".join(event["delta"] for event in events if event["type"] == "response.output_text.delta")
    (message,) = failed["output"]
    assert message["status"] == "incomplete" and message["content"][0]["text"] == text
    served = httpx.post(f"{default_server.http}/v1/responses", timeout=60,
                        json={"model": model, "input": "Hi", "max_output_tokens": 2, "ignore_eos": True})
    assert served.status_code == 200 and served.json()["usage"]["output_tokens"] == 2


def test_bad_requests_name_the_field(default_server):
    url = f"{default_server.http}/v1/responses"
    for body, param in (({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
                        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                         "input[0].content[0].type"),
                        ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
                        ({"input": "Hi", "max_output_tokens": 10**6}, "max_output_tokens"),
                        ({"input": "Hi", "max_output_tokens": 10**6, "stream": True}, "max_output_tokens")):
        response = httpx.post(url, json=body, timeout=60)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param, response.text


def test_a_refused_max_output_tokens_is_named_so_in_the_message(default_server):
    """The message of a refusal names the Responses field, not the chat field it ran as."""
    for value in (0, 10**6):
        response = httpx.post(f"{default_server.http}/v1/responses", json={"input": "Hi", "max_output_tokens": value},
                              timeout=60)
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert "max_output_tokens" in message and "max_tokens" not in message.replace("max_output_tokens", "")


def test_a_response_echoes_its_request_and_its_progress_as_openai_does(default_server, model):
    """``text.format`` echoed as OpenAI does (a JSON object's type alone, no schema fields set to null); usage null
    while the response is in progress; ``completed_at`` only once completed."""
    url = f"{default_server.http}/v1/responses"
    body = {"model": model, "input": "What is 2+2? Answer with a number.", "temperature": 0, "max_output_tokens": 100}
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    assert [event["response"]["usage"] for event in events[:2]] == [None, None]
    assert [event["response"]["completed_at"] for event in events[:2]] == [None, None]
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["usage"]["output_tokens"] > 0
    assert final["completed_at"] >= final["created_at"]
    cut = httpx.post(url, json={**body, "max_output_tokens": 2, "text": {"format": {"type": "json_object"}}},
                     timeout=60).json()
    assert cut["status"] == "incomplete" and cut["completed_at"] is None
    assert cut["text"] == {"format": {"type": "json_object"}}


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    """A server on test_reasoning's tiny Qwen3 whose template opens the thinking ([model] reasoning_parser)."""
    from tests.test_reasoning import save_thinking_qwen3

    path = tmp_path_factory.mktemp("thinking_qwen3")
    save_thinking_qwen3(path)
    config = (f'[model]\npath = "{path}"\ndtype = "float32"\nmax_model_len = 256\nreasoning_parser = "think"\n\n'
              + http_config())
    server = Server(config, tmp_path_factory.mktemp("thinking")).start()
    yield server
    assert server.stop() == 0, server.output


@pytest.fixture(scope="module")
def thought_and_answered(thinking_server):
    """The events of a streamed response that thinks, then answers (the first seed that gives one)."""
    from tests.test_reasoning import QUESTION as THINKING_QUESTION

    for seed in range(20):
        body = {"input": THINKING_QUESTION, "max_output_tokens": 24, "seed": seed, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{thinking_server.http}/v1/responses", json=body, timeout=60) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
        added = [event["item"]["type"] for event in events if event["type"] == "response.output_item.added"]
        if added == ["reasoning", "message"]:
            return events
    raise AssertionError("no seed in 20 gave thinking and then an answer")


def test_a_streamed_reasoning_item_opens_and_closes_its_reasoning_text_part(thought_and_answered):
    """As a message's output_text: the reasoning item is added in progress, its reasoning_text part added empty
    (content_part.added), its deltas, then reasoning_text.done, content_part.done with the whole text and the item
    done; each event one of the openai package's typed events."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    events = thought_and_answered
    reasoning = [event for event in events if event.get("output_index") == 0]
    for event in events:
        TypeAdapter(ResponseStreamEvent).validate_python(event)
    kinds = [event["type"] for event in reasoning]
    assert kinds[:2] == ["response.output_item.added", "response.content_part.added"]
    assert set(kinds[2:-3]) == {"response.reasoning_text.delta"}
    assert kinds[-3:] == ["response.reasoning_text.done", "response.content_part.done", "response.output_item.done"]
    assert reasoning[0]["item"]["status"] == "in_progress" and reasoning[1]["part"] == {"type": "reasoning_text",
                                                                                          "text": ""}
    text = "".join(event["delta"] for event in reasoning[2:-3])
    assert reasoning[-2]["part"] == {"type": "reasoning_text", "text": text} == reasoning[-1]["item"]["content"][0]


def test_thinking_cut_off_by_max_output_tokens_is_an_incomplete_reasoning_item(thinking_server):
    """max_output_tokens ending the reply inside its thinking: the reasoning item, the last one, is "incomplete"
    with the response, streamed (its output_item.done and the final response) and not."""
    from tests.test_reasoning import QUESTION as THINKING_QUESTION

    url = f"{thinking_server.http}/v1/responses"
    body = {"input": THINKING_QUESTION, "max_output_tokens": 2, "ignore_eos": True, "temperature": 0}
    whole = httpx.post(url, json=body, timeout=60).json()
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    (done,) = [event for event in events if event["type"] == "response.output_item.done"]
    for response, item in ((whole, whole["output"][-1]), (events[-1]["response"], done["item"])):
        assert response["status"] == "incomplete" and [i["type"] for i in response["output"]] == ["reasoning"]
        assert item["type"] == "reasoning" and item["status"] == "incomplete"


def test_the_thinking_is_done_before_the_answer_begins(thought_and_answered):
    """The reasoning item's done events come before the message is added (one item open at a time, as OpenAI
    streams them), and the final response has both items as they were done."""
    kinds = [(event["type"], event.get("output_index")) for event in thought_and_answered]
    done = kinds.index(("response.output_item.done", 0))
    assert kinds[done - 2:done + 2] == [("response.reasoning_text.done", 0), ("response.content_part.done", 0),
                                        ("response.output_item.done", 0), ("response.output_item.added", 1)]
    items = [event["item"] for event in thought_and_answered if event["type"] == "response.output_item.done"]
    assert thought_and_answered[-1]["response"]["output"] == items


def test_an_engine_failing_during_the_answer_keeps_the_thinking_completed(thinking_server):
    """The engine killed while the answer streams: response.failed has the reasoning item as its output_item.done
    gave it ("completed"), the message "incomplete"."""
    from tests.test_reasoning import QUESTION as THINKING_QUESTION

    for seed in range(20):
        body = {"input": THINKING_QUESTION, "max_output_tokens": 200, "seed": seed, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{thinking_server.http}/v1/responses", json=body, timeout=120) as response:
            data = (json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: "))
            events = []
            for event in data:
                events.append(event)
                if event["type"] == "response.output_text.delta":
                    break
            if events[-1]["type"] != "response.output_text.delta" or events[2]["item"]["type"] != "reasoning":
                continue
            killed = thinking_server.engine_pid
            os.kill(killed, signal.SIGSTOP)
            os.kill(killed, signal.SIGKILL)
            events += data
            break
    else:
        raise AssertionError("no seed in 20 gave thinking and then an answer")
    thinking_server.wait_for(lambda: thinking_server.engine_pid != killed
                             and httpx.get(f"{thinking_server.http}/health").status_code == 200,
                             timeout=180, what="the engine to restart")
    (done,) = [event["item"] for event in events if event["type"] == "response.output_item.done"]
    failed = events[-1]["response"]
    assert events[-1]["type"] == "response.failed" and [item["status"] for item in failed["output"]] == [
        "completed", "incomplete"]
    assert failed["output"][0] == done and done["type"] == "reasoning"
