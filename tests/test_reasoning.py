"""A reasoning model's thinking apart from its answer ([model] reasoning_parser = "think"), on a tiny random Qwen3
made here with a template that opens the thinking for the model: in chat completions, Responses and Messages,
streamed and not, each split checked against the raw text of the same sampled reply (the completions API, which
never splits); and the splitter on its own, in any pieces."""

from __future__ import annotations

import itertools
import json

import anthropic
import httpx
import openai
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.api.reasoning import ThinkSplitter
from tests.server import Server, http_config
from tests.test_zmq_transport import raw_generate

WORDS = ["<unk>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "user", "assistant", "system",
         "sun", "rain", "snow", "wind", "cloud", "fog"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant <think>{% endif %}")
QUESTION = "sun rain"
# the prompt the template makes of QUESTION
PROMPT = f"<|im_start|>user {QUESTION}<|im_end|><|im_start|>assistant <think>"
TOKENS = 24


def save_thinking_qwen3(path) -> None:
    """A one-layer Qwen3 over a 14-word vocabulary (so a sampled reply soon closes its thinking), whose
    template ends the prompt inside <think> as DeepSeek-R1's do."""
    import torch
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|im_end|>"}))
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      max_position_embeddings=256, eos_token_id=2, bos_token_id=1)
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("thinking_qwen3")
    save_thinking_qwen3(path)
    config = f"""
[model]
path = "{path}"
dtype = "float32"
max_model_len = 256
reasoning_parser = "think"

""" + http_config(status_interval=0.0) + '''
[[transport]]
plugin = "zmq"
address = "tcp://127.0.0.1:*"
'''
    server = Server(config, tmp_path_factory.mktemp("thinking")).start()
    yield server
    assert server.stop() == 0, server.output


@pytest.fixture(scope="module")
def reply(server):
    """A seed whose sampled reply thinks, closes its thinking and answers, and that reply's thinking and answer
    as the raw text shows them."""
    for seed in range(50):
        raw = httpx.post(f"{server.http}/v1/completions", timeout=60, json={
            "prompt": PROMPT, "max_tokens": TOKENS, "seed": seed, "ignore_eos": True}).json()["choices"][0]["text"]
        thinking, closed, answer = raw.partition("</think>")
        if closed and thinking.strip() and answer.strip():
            return seed, thinking.strip(), answer.strip()
    raise AssertionError("no seed in 50 gave a reply that closes its thinking")


SAMPLED = {"max_tokens": TOKENS, "ignore_eos": True}


def test_chat_completions_give_the_thinking_as_reasoning_content(server, reply):
    seed, thinking, answer = reply
    with openai.OpenAI(base_url=f"{server.http}/v1", api_key="unused", max_retries=0) as client:
        model = client.models.list().data[0].id
        request = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "seed": seed,
                   "max_tokens": TOKENS, "extra_body": {"ignore_eos": True}}
        message = client.chat.completions.create(**request).choices[0].message
        assert (message.reasoning_content, message.content) == (thinking, answer)
        reasoning, content = "", ""
        for chunk in client.chat.completions.create(**request, stream=True):
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
        assert (reasoning, content) == (thinking, answer)


def test_responses_give_a_reasoning_item_before_the_message(server, reply):
    seed, thinking, answer = reply
    body = {"input": QUESTION, "max_output_tokens": TOKENS, "seed": seed, "ignore_eos": True}
    response = httpx.post(f"{server.http}/v1/responses", json=body, timeout=60).json()
    assert [item["type"] for item in response["output"]] == ["reasoning", "message"]
    assert response["output"][0]["content"][0]["text"] == thinking
    assert response["output"][1]["content"][0]["text"] == answer
    assert 0 < response["usage"]["output_tokens_details"]["reasoning_tokens"] < TOKENS
    with openai.OpenAI(base_url=f"{server.http}/v1", api_key="unused", max_retries=0) as client, \
            client.responses.stream(model=response["model"], input=QUESTION, max_output_tokens=TOKENS,
                                    extra_body={"seed": seed, "ignore_eos": True}) as stream:
        events = list(stream)
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (deltas, text) == (thinking, answer)
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"] and final.output_text == answer


def test_messages_give_a_thinking_block_before_the_text(server, reply):
    seed, thinking, answer = reply
    with anthropic.Anthropic(base_url=server.http, api_key="unused", max_retries=0) as client:
        model = httpx.get(f"{server.http}/v1/models").json()["data"][0]["id"]
        request = {"model": model, "max_tokens": TOKENS, "messages": [{"role": "user", "content": QUESTION}],
                   "extra_body": {"seed": seed, "ignore_eos": True}}
        message = client.messages.create(**request)
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == [
            ("thinking", thinking), ("text", answer)]
        with client.messages.stream(**request) as stream:
            events = list(stream)
            final = stream.get_final_message()
    thought = "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                      and e.delta.type == "thinking_delta")
    assert thought == thinking and [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[1].text == answer


def test_the_zmq_protocol_gives_the_thinking_apart_as_http_does(server, reply):
    """The raw ZMQ protocol (docs/zmq-protocol.md) with messages: the thinking in ``reasoning``, the answer in
    ``text``, streamed and not, as chat completions split the same reply."""
    seed, thinking, answer = reply
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(server.url("tcp"))
    for stream in (True, False):
        chunks = raw_generate(socket, {
            "request_id": f"think-{stream}", "messages": [{"role": "user", "content": QUESTION}], "stream": stream,
            "params": {"max_tokens": TOKENS, "seed": seed, "ignore_eos": True}})
        assert len(chunks) > 2 if stream else len(chunks) == 1
        assert "".join(c["reasoning"] for c in chunks) == thinking
        assert "".join(c["text"] for c in chunks) == answer
        assert chunks[-1]["usage"]["completion_tokens"] == TOKENS
    socket.close()


REPLIES = [
    (True, "  step one \n step two </think>\n\n the answer", "step one \n step two", "the answer"),
    (False, "<think>\nhmm</think>yes", "hmm", "yes"),
    (False, "no thinking here <think> at all", "", "no thinking here <think> at all"),
    (True, "cut short inside the thinking </thi", "cut short inside the thinking </thi", ""),
    (False, "<thi", "", "<thi"),
]


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from(REPLIES), cuts=st.lists(st.integers(0, 60), max_size=8))
def test_the_splitter_reads_any_pieces_as_the_whole(case, cuts):
    opens, text, thinking, answer = case
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)] or [""]
    splitter = ThinkSplitter(prompt_opens_thinking=opens)
    out = [splitter.feed(piece, final=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    assert "".join(t for t, _ in out) == splitter.reasoning == thinking
    assert "".join(a for _, a in out) == answer
