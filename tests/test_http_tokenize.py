"""vLLM's /tokenize on the shared real server: a conversation's count is the prompt chat completions runs."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATION = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "user", "content": "And should I take a coat?"},
]


def test_tokenize_counts_a_conversation_with_tools_as_chat_completions_prompts_it(default_server, openai_client):
    """The tools take their place in the prompt (the count grows by their text), and an earlier call is written as
    chat completions writes it: the count is the prompt_tokens a chat completion reports for the same messages
    and tools, whatever tool_choice says."""
    model = openai_client.models.list().data[0].id

    def count(**fields) -> int:
        response = httpx.post(f"{default_server.http}/tokenize", json={"model": model, **fields}, timeout=60)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["count"] == len(answer["tokens"])
        return answer["count"]

    with_tools = count(messages=CONVERSATION, tools=[WEATHER])
    assert with_tools > count(messages=CONVERSATION) + 20
    for tool_choice in ("auto", "none"):
        chat = openai_client.chat.completions.create(model=model, messages=CONVERSATION, tools=[WEATHER],
                                                     tool_choice=tool_choice, max_tokens=1)
        assert chat.usage.prompt_tokens == with_tools
    plain = openai_client.chat.completions.create(model=model, messages=CONVERSATION, max_tokens=1)
    assert plain.usage.prompt_tokens == count(messages=CONVERSATION)

    refused = httpx.post(f"{default_server.http}/tokenize", json={"prompt": "Hi", "tools": [WEATHER]}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools", refused.text
