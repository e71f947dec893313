"""The OpenAI-compatible HTTP API end to end: a real ``conveyor serve`` on the real weights, driven by the
official ``openai`` client (and httpx where a client would hide what is checked).

Token counts are checked against Conveyor's tokenizer, greedy text against ``conveyor generate``, and
cleanup after a client leaves against the server's own metrics.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import subprocess
import sys
import time

import httpx
import openai
import psutil
import pytest

from tests.conftest import REPO
from tests.server import Server, http_config

pytestmark = pytest.mark.slow

CLI_PROMPT = "What is the capital of France?"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # (a server of its own: test_greedy_chat_matches_conveyor_generate compares with a fresh offline engine, and
    # a prefix cache filled by other files' requests splits its prompt into other pieces)
    server = Server(http_config(), tmp_path_factory.mktemp("http_api")).start()
    yield server
    assert server.stop() == 0, server.output


@pytest.fixture(scope="module")
def model(server) -> str:
    return httpx.get(f"{server.http}/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.http}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def wait_until_idle(server: Server) -> None:
    """No request running or waiting, and every KV block free again."""
    server.wait_for(
        lambda: server.metric("conveyor_num_requests_running") == 0
        and server.metric("conveyor_num_requests_waiting") == 0
        and server.metric("conveyor_kv_cache_free_blocks") == server.metric("conveyor_kv_cache_blocks"),
        timeout=30,
        what="the server to be idle with every KV block free",
    )



def test_greedy_chat_matches_conveyor_generate(server, client, model, tokenizer):
    """The same tokens, or apart from the first difference on only because of a near tie (both runs have the
    two tokens in their top 5 within 0.01 of each other): the server's prefix cache may hold the start of the
    chat template from earlier requests, so its prompt may be computed in other pieces than offline."""
    wait_until_idle(server)  # (the request alone in its steps, as offline)
    offline = subprocess.run(
        [sys.executable, "-m", "conveyor", "generate", "--json", "--chat", "-p", CLI_PROMPT, "--max-tokens", "24",
         "--logprobs", "5"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=True,
    )
    expected = json.loads(offline.stdout.strip().splitlines()[-1])
    response = client.chat.completions.create(model=model, messages=user(CLI_PROMPT), max_tokens=24, temperature=0,
                                              logprobs=True, top_logprobs=5)
    choice = response.choices[0]
    served = [(e.token, {t.token: t.logprob for t in e.top_logprobs}) for e in choice.logprobs.content]
    text = tokenizer.token_text
    offline_steps = [(text(token), {text(t): lp for t, lp in zip(e["top_ids"], e["top_logprobs"])})
                     for token, e in zip(expected["token_ids"], expected["logprobs"])]
    for (mine, mine_top), (theirs, theirs_top) in zip(served, offline_steps):
        if mine != theirs:
            assert theirs in mine_top and mine in theirs_top, f"{mine!r} vs offline {theirs!r}: not a near tie"
            gap = max(abs(mine_top[mine] - mine_top[theirs]), abs(theirs_top[mine] - theirs_top[theirs]))
            assert gap < 0.01, f"{mine!r} vs offline {theirs!r}: logprob gap {gap:.4f}"
            return
    assert choice.message.content == expected["text"]
    assert choice.finish_reason == expected["finish_reason"]
    assert response.usage.completion_tokens == len(expected["token_ids"])


def test_models_lists_the_served_model(server, client):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert len(ids) == 1
    assert re.search(rf"Conveyor is serving {re.escape(ids[0])} ", server.output)


def test_a_model_is_retrieved_by_its_id_and_was_created_when_the_server_started(server, client):
    """GET /v1/models/{id} (the openai client's models.retrieve) answers the object /v1/models lists, whose
    ``created`` is when the server started (its process's start, not 0); an unknown id is a 404 naming model."""
    listed = client.models.list().data[0]
    assert psutil.Process(server.process.pid).create_time() - 1 <= listed.created <= time.time()
    assert client.models.retrieve(listed.id) == listed
    with pytest.raises(openai.NotFoundError) as refused:
        client.models.retrieve("gpt-17")
    assert refused.value.param == "model" and "gpt-17" in refused.value.message


def test_chat_usage_and_stream_match(client, model, tokenizer):
    messages = user("Write a haiku about the sea.")
    n = 12
    kwargs = {"model": model, "messages": messages, "max_tokens": n, "temperature": 0,
              "extra_body": {"ignore_eos": True}}
    # the same request once before, so both compared runs find the same prefix cache
    client.chat.completions.create(**kwargs)

    response = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})

    num_prompt = len(tokenizer.encode_chat(messages))
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == n
    assert response.usage.prompt_tokens == num_prompt
    assert response.usage.total_tokens == num_prompt + n
    assert response.choices[0].message.role == "assistant"

    deltas, finish_reasons, usages, roles = [], [], [], []
    for chunk in stream:
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for choice in chunk.choices:
            deltas.append(choice.delta.content or "")
            roles.append(choice.delta.role)
            if choice.finish_reason is not None:
                finish_reasons.append(choice.finish_reason)
    assert "".join(deltas) == response.choices[0].message.content
    assert finish_reasons == ["length"]
    assert roles[0] == "assistant"
    assert len(usages) == 1
    assert usages[0].completion_tokens == n
    assert usages[0].prompt_tokens == num_prompt


def test_a_streamed_line_separator_reaches_a_line_reader_whole(server, model):
    """Text with U+2028, U+2029 and U+0085 (a regex forces it), streamed: every data line a line reader gives (httpx's
    iter_lines splits as str.splitlines does, at those characters too) is one whole JSON event, and the deltas
    join to the text."""
    body = {"model": model, "messages": user("Hi"), "max_tokens": 16, "stream": True,
            "structured_outputs": {"regex": "a\u2028b\u2029c\x85d"}}
    deltas = []
    with httpx.stream("POST", f"{server.http}/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                deltas += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
    assert "".join(deltas) == "a\u2028b\u2029c\x85d"


def test_completions_usage_and_stream_match(client, model, tokenizer):
    prompt = "The three primary colors are"
    n = 10
    kwargs = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "extra_body": {"ignore_eos": True}}
    client.completions.create(**kwargs)

    response = client.completions.create(**kwargs)
    stream = client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})

    num_prompt = len(tokenizer.encode(prompt))
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == n
    assert response.usage.prompt_tokens == num_prompt
    assert response.usage.total_tokens == num_prompt + n

    texts, finish_reasons, usages = [], [], []
    for chunk in stream:
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for choice in chunk.choices:
            texts.append(choice.text)
            if choice.finish_reason is not None:
                finish_reasons.append(choice.finish_reason)
    assert "".join(texts) == response.choices[0].text
    assert finish_reasons == ["length"]
    assert len(usages) == 1
    assert (usages[0].prompt_tokens, usages[0].completion_tokens) == (num_prompt, n)


async def test_concurrent_streams_all_complete(server, model, tokenizer):
    prompts = [f"Count from {i} to {i + 5}." for i in range(32)]

    async def one(aclient: openai.AsyncOpenAI, prompt: str, max_tokens: int):
        stream = await aclient.chat.completions.create(
            model=model, messages=user(prompt), max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        text, finish_reasons, usage = "", [], None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                text += choice.delta.content or ""
                if choice.finish_reason is not None:
                    finish_reasons.append(choice.finish_reason)
        return text, finish_reasons, usage

    first_new_line = len(server.lines)
    async with openai.AsyncOpenAI(base_url=f"{server.http}/v1", api_key="unused", max_retries=0,
                                  timeout=300) as aclient:
        max_tokens = [4 + i % 13 for i in range(len(prompts))]
        results = await asyncio.gather(*(one(aclient, p, m) for p, m in zip(prompts, max_tokens)))

    for prompt, n, (text, finish_reasons, usage) in zip(prompts, max_tokens, results):
        assert finish_reasons == ["length"], prompt
        assert usage is not None, prompt
        assert usage.completion_tokens == n, prompt
        assert usage.prompt_tokens == len(tokenizer.encode_chat(user(prompt))), prompt
        assert text, prompt
    wait_until_idle(server)
    # these requests show in a one-line status report (status_interval = 1 s), however short the burst was

    def generation_rates() -> list[float]:
        pattern = r"running \d+, waiting \d+, KV [\d.]+%, prompt [\d.]+ tok/s, generation ([\d.]+) tok/s"
        return [float(m.group(1)) for line in server.lines[first_new_line:] if (m := re.search(pattern, line))]

    server.wait_for(lambda: any(rate > 0 for rate in generation_rates()), timeout=10, what="a status line")


async def test_a_long_prompt_is_tokenized_off_the_event_loop(server, model):
    """A prompt of nearly 4 MB takes seconds to tokenize (then it is refused: far past max_model_len). Meanwhile a
    running stream goes on and /health answers: the longest wait for /health while the long prompt is out is a
    small part of its time (tokenized on the event loop, it was most of it)."""
    huge = json.dumps({"model": model, "prompt": "The sky is blue. " * 240_000, "max_tokens": 1}).encode()
    story = {"model": model, "messages": user("Tell me a long story about a dragon."), "max_tokens": 1000,
             "ignore_eos": True, "temperature": 0, "stream": True}
    chunk_times: list[float] = []
    health_times: list[float] = []
    refused = asyncio.Event()

    async def read(lines) -> None:
        async for line in lines:
            if line.startswith("data: "):
                chunk_times.append(time.perf_counter())

    async def poll_health(http: httpx.AsyncClient) -> None:
        while not refused.is_set():
            assert (await http.get("/health")).status_code == 200
            health_times.append(time.perf_counter())

    async with httpx.AsyncClient(base_url=server.http, timeout=120) as http:
        async with http.stream("POST", "/v1/chat/completions", json=story) as stream:
            lines = stream.aiter_lines()
            async for line in lines:  # the story runs
                if line.startswith("data: "):
                    break
            reader, poller = asyncio.create_task(read(lines)), asyncio.create_task(poll_health(http))
            sent = time.perf_counter()
            response = await http.post("/v1/completions", content=huge, headers={"Content-Type": "application/json"})
            answered = time.perf_counter()
            refused.set()
            await poller
            reader.cancel()
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text
    assert "max_model_len" in response.json()["error"]["message"]

    def longest_wait(times: list[float]) -> float:
        inside = [sent, *(t for t in times if sent < t < answered), answered]
        return max(b - a for a, b in zip(inside, inside[1:]))

    assert longest_wait(health_times) < (answered - sent) / 4, (answered - sent, len(health_times))
    assert longest_wait(chunk_times) < (answered - sent) / 2, (answered - sent, len(chunk_times))


def test_created_is_when_the_request_came_in_every_chunk_and_in_the_reply(server, client, model):
    """``created`` is the request's arrival, one value for a whole stream, as OpenAI and vLLM stamp it: the engine
    is held still for more than a second mid-stream (a clock read per chunk would then differ), and before a
    reply is made (a reply stamped at its finish would then carry a later second)."""
    kwargs = {"model": model, "max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
    sent = time.time()
    stream = client.chat.completions.create(messages=user("Count to twenty."), stream=True, **kwargs)
    chunks, first_arrival = [], None
    for chunk in stream:
        first_arrival = first_arrival or time.time()
        chunks.append(chunk)
        if len(chunks) == 3:
            with server.paused_engine():
                time.sleep(1.5)
    assert len(chunks) > 3
    assert {chunk.created for chunk in chunks} == {chunks[0].created}
    assert sent - 1 < chunks[0].created <= first_arrival

    sent = time.time()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with server.paused_engine():
            reply = pool.submit(client.completions.create, prompt="One, two,", **kwargs)
            time.sleep(2.5)
    assert sent - 1 < reply.result().created <= sent + 1


def test_chat_logprobs(client, model):
    n = 8
    response = client.chat.completions.create(
        model=model, messages=user("Explain photosynthesis in one sentence."), max_tokens=n, temperature=0,
        logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True},
    )
    choice = response.choices[0]
    content = choice.logprobs.content
    assert len(content) == response.usage.completion_tokens == n
    for entry in content:
        top = entry.top_logprobs
        assert len(top) == 3
        values = [t.logprob for t in top]
        assert values == sorted(values, reverse=True)
        assert all(v <= 0 for v in values)
        # greedy: the chosen token is the most likely one
        assert entry.token == top[0].token
        assert entry.logprob == pytest.approx(top[0].logprob, abs=1e-6)
        assert bytes(entry.bytes).decode() == entry.token
    assert "".join(e.token for e in content) == choice.message.content


def test_completion_logprobs(client, model):
    n = 8
    response = client.completions.create(
        model=model, prompt="Photosynthesis is the process", max_tokens=n, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True},
    )
    choice = response.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == n
    assert len(logprobs.text_offset) == n
    text = choice.text
    assert "".join(logprobs.tokens) == text
    for token, offset in zip(logprobs.tokens, logprobs.text_offset):
        assert text[offset:offset + len(token)] == token
    assert logprobs.text_offset[0] == 0
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert 1 <= len(top) <= 2
        assert logprob == pytest.approx(max(top.values()), abs=1e-6)
        assert top[token] == pytest.approx(logprob, abs=1e-6)


def logprob_token_bytes(token: str) -> bytes:
    """A logprobs token's bytes: its text's UTF-8, or the bytes a name "bytes:\\xf0\\x9f" spells."""
    if token.startswith("bytes:"):
        return bytes(int(byte, 16) for byte in token.removeprefix("bytes:").split("\\x")[1:])
    return token.encode()


def test_tokens_that_split_a_character_keep_apart_in_logprobs(client, model):
    """Emojis are several byte-level tokens, none of them UTF-8 alone: completions name each by its bytes, as
    OpenAI's names them ("bytes:\\xf0\\x9f"), so the top 5 are five tokens and the chosen one's logprob is its own;
    the tokens' bytes make the text, and each token's text_offset is the character its first byte is part of
    (the characters whole before it, by Python's decoder), streamed or not. Chat names them so too, with each
    token's exact bytes."""
    kwargs = {"model": model, "prompt": "Emoji: \U0001F600\U0001F600\U0001F600\U0001F600", "max_tokens": 8,
              "temperature": 0, "logprobs": 5, "extra_body": {"ignore_eos": True}}
    choice = client.completions.create(**kwargs).choices[0]
    logprobs = choice.logprobs
    assert any(token.startswith("bytes:") for token in logprobs.tokens), logprobs.tokens
    pieces = [logprob_token_bytes(token) for token in logprobs.tokens]
    assert b"".join(pieces).decode(errors="replace") == choice.text
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) == 5, top
        assert top[token] == pytest.approx(logprob, abs=1e-6) == max(top.values())
    whole_before = [len(b"".join(pieces[:i]).decode(errors="ignore")) for i in range(len(pieces))]
    assert logprobs.text_offset == whole_before
    tokens, offsets = [], []
    for chunk in client.completions.create(**kwargs, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            offsets += chunk.choices[0].logprobs.text_offset
    assert (tokens, offsets) == (logprobs.tokens, logprobs.text_offset)

    chat = client.chat.completions.create(model=model, messages=user("Reply with three \U0001F600 emojis."),
                                          max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
                                          extra_body={"ignore_eos": True}).choices[0]
    content = chat.logprobs.content
    entries = [e for entry in content for e in (entry, *entry.top_logprobs)]
    assert any(e.token.startswith("bytes:") for e in entries)
    for e in entries:
        assert logprob_token_bytes(e.token) == bytes(e.bytes), e
    assert b"".join(bytes(e.bytes) for e in content).decode(errors="replace") == chat.message.content


def test_seed_reproduces_sampling(client, model):
    kwargs = {"model": model, "messages": user("Write a haiku about the sea."), "max_tokens": 12,
              "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    first = client.chat.completions.create(**kwargs, seed=1234).choices[0].message.content
    again = client.chat.completions.create(**kwargs, seed=1234).choices[0].message.content
    other = client.chat.completions.create(**kwargs, seed=99).choices[0].message.content
    assert first == again
    assert first != other  # the seed decides the sample


def test_n_choices(client, model):
    kwargs = {"model": model, "messages": user("Write a haiku about the sea."), "max_tokens": 8,
              "temperature": 1.0, "n": 3, "seed": 7, "extra_body": {"ignore_eos": True}}
    response = client.chat.completions.create(**kwargs)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in response.choices)
    assert response.usage.completion_tokens == 3 * 8
    texts = [c.message.content for c in response.choices]
    assert len(set(texts)) > 1  # the choices are sampled apart
    again = client.chat.completions.create(**kwargs)
    assert [c.message.content for c in again.choices] == texts


def test_a_batch_of_prompts_answers_each_as_it_is_answered_alone(client, model, tokenizer):
    """OpenAI's and vLLM's batch: a list of prompts (texts, or lists of token ids) gets n choices of each, choice
    prompt_index * n + i with the text its prompt gets alone (greedy), usage summed; streamed, each chunk carries
    its choice's index, and the usage comes once, summed."""
    prompts = ["The capital of France is", "The sky is"]
    kwargs = {"model": model, "max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
    # (each compared with a request run as it is, from the prefix cache: a prompt computed whole may tip a near tie)
    for prompt in prompts:
        client.completions.create(prompt=prompt, **kwargs)
    alone = [client.completions.create(prompt=prompt, **kwargs) for prompt in prompts]
    texts = [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2
    num_prompt_tokens = sum(reply.usage.prompt_tokens for reply in alone)

    batch = client.completions.create(prompt=prompts, n=2, **kwargs)
    assert [(c.index, c.text, c.finish_reason) for c in batch.choices] == [
        (i, text, "length") for i, text in enumerate(texts)]
    assert (batch.usage.prompt_tokens, batch.usage.completion_tokens) == (num_prompt_tokens, 4 * 6)
    by_ids = client.completions.create(prompt=[tokenizer.encode(prompt) for prompt in prompts], **kwargs)
    assert [(c.index, c.text) for c in by_ids.choices] == [(0, texts[0]), (1, texts[2])]

    streamed, finishes, usages, ids = [""] * 4, [None] * 4, [], set()
    for chunk in client.completions.create(prompt=prompts, n=2, stream=True, stream_options={"include_usage": True},
                                           **kwargs):
        ids.add(chunk.id)
        assert len(chunk.choices) <= 1
        usages += [chunk.usage] if chunk.usage else []
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert (streamed, finishes) == (texts, ["length"] * 4) and len(ids) == 1
    assert [(u.prompt_tokens, u.completion_tokens) for u in usages] == [(num_prompt_tokens, 4 * 6)]


def test_stop_string_cuts_the_text(client, model):
    kwargs = {"model": model, "messages": user("Who wrote Romeo and Juliet?"), "max_tokens": 16,
              "temperature": 0, "extra_body": {"ignore_eos": True}}
    client.chat.completions.create(**kwargs)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    words = full.split()
    assert len(words) >= 4, full
    stop = " " + words[3]
    cut = full[: full.index(stop)]

    response = client.chat.completions.create(**kwargs, stop=[stop])
    assert response.choices[0].message.content == cut
    assert response.choices[0].finish_reason == "stop"

    stream = client.chat.completions.create(**kwargs, stop=stop, stream=True)
    chunks = [(c.delta.content or "", c.finish_reason) for chunk in stream for c in chunk.choices]
    assert "".join(text for text, _ in chunks) == cut
    assert [reason for _, reason in chunks if reason] == ["stop"]



def test_a_stop_string_completed_by_the_last_token_allowed_is_a_stop(client, model):
    """The stop string ends the text on the last token max_tokens allows: the finish is "stop" (the stop matched
    and cut the text), not "length", streamed or not, chat and completions."""
    chat = {"model": model, "messages": user("Who painted the Mona Lisa?"), "temperature": 0, "max_tokens": 4,
            "extra_body": {"ignore_eos": True}}
    completion = {"model": model, "prompt": "The Mona Lisa was painted by", "temperature": 0, "max_tokens": 4,
                  "extra_body": {"ignore_eos": True}}
    for create, kwargs, text_of in ((client.chat.completions.create, chat, lambda c: c.message.content),
                                    (client.completions.create, completion, lambda c: c.text)):
        whole = create(**kwargs).choices[0]
        full = text_of(whole)
        assert whole.finish_reason == "length"
        # the shortest tail of the text found nowhere earlier in it: it ends only on the last token
        stop = next(full[-n:] for n in range(1, len(full) + 1) if full.find(full[-n:]) == len(full) - n)
        cut = create(**kwargs, stop=[stop]).choices[0]
        assert (text_of(cut), cut.finish_reason) == (full[: -len(stop)], "stop")
        streamed = [c for chunk in create(**kwargs, stop=[stop], stream=True) for c in chunk.choices]
        assert [c.finish_reason for c in streamed if c.finish_reason] == ["stop"]


def test_a_field_sent_as_null_takes_its_default(client, model):
    """OpenAI's SDK sends None as null, and OpenAI's server and vLLM's read a null field as one left out."""
    kwargs = {"model": model, "messages": user("Say hello."), "temperature": 0, "max_tokens": 3}
    # (each compared with a request run as it is, from the prefix cache: a prompt computed whole may tip a near tie)
    client.chat.completions.create(**kwargs)
    expected = client.chat.completions.create(**kwargs).choices[0].message.content
    nulls = {"n": None, "presence_penalty": None, "frequency_penalty": None, "logprobs": None, "stream": None,
             "top_p": None, "seed": None, "stop": None}
    response = client.chat.completions.create(**kwargs, **nulls)
    assert [c.message.content for c in response.choices] == [expected]
    client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0)
    text = client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0).choices[0].text
    again = client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0, n=None, echo=None,
                                      stream=None, presence_penalty=None, frequency_penalty=None, logprobs=None)
    assert again.choices[0].text == text
    # and so in an object: include_usage takes its default, false (no usage chunk)
    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": None},
                                            response_format={"type": "text", "json_schema": None})
    chunks = list(stream)
    assert "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices) == expected
    assert all(chunk.usage is None for chunk in chunks)


def test_continue_final_message_continues_the_last_message_whatever_add_generation_prompt_says(
        client, model, hf_tokenizer):
    """vLLM's continue_final_message: the prompt is transformers' rendering with continue_final_message (no new
    turn opened, even with add_generation_prompt left at its default); a last message with no text is a 400."""
    messages = user("Name a color.") + [{"role": "assistant", "content": "My favourite color is"}]
    rendered = hf_tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=True)
    for extra in ({"continue_final_message": True}, {"continue_final_message": True, "add_generation_prompt": False}):
        response = client.chat.completions.create(model=model, messages=messages, max_tokens=2, extra_body=extra)
        assert response.usage.prompt_tokens == len(getattr(rendered, "input_ids", rendered))
    with pytest.raises(openai.BadRequestError, match="final message"):
        client.chat.completions.create(model=model, messages=user("Hi") + [{"role": "assistant", "content": ""}],
                                       max_tokens=2, extra_body={"continue_final_message": True})


def test_client_leaving_a_stream_aborts_the_request(server, client, model):
    wait_until_idle(server)
    aborted, engine_aborted = server.num_finished("abort"), server.engine_aborts()
    body = {"model": model, "messages": user("Tell me a long story about a dragon."), "max_tokens": 200,
            "ignore_eos": True, "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", f"{server.http}/v1/chat/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # held: dropping the iterator would close the connection here
            events = 0
            for line in lines:
                if line.startswith("data: "):
                    events += 1
                if events == 3:
                    break
            # stopped while the client leaves: the request cannot end by itself before the abort arrives
            server.pause_engine()
            # the request holds KV blocks while it runs
            assert server.metric("conveyor_num_requests_running") == 1
            assert server.metric("conveyor_kv_cache_free_blocks") < server.metric("conveyor_kv_cache_blocks")
        # the server saw the client go (and sent the abort) before the engine runs again
        server.wait_for(lambda: server.num_finished("abort") == aborted + 1, what="the frontend to abort")
    finally:
        server.resume_engine()
    wait_until_idle(server)
    assert server.engine_aborts() == engine_aborted + 1
    after = client.chat.completions.create(model=model, messages=user("Hi"), max_tokens=4, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert after.usage.completion_tokens == 4


def test_a_stop_string_ends_the_request_in_the_engine_as_finished_not_aborted(server, client, model):
    """The frontend finds the stop string and ends the request in the engine: its blocks are freed at once, and
    the engine counts it finished, not among its aborts (which count requests cut short)."""
    wait_until_idle(server)
    prompt = "The capital of France is"
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    words = plain.choices[0].text.split()
    assert len(words) >= 4
    engine_aborted, stopped = server.engine_aborts(), server.num_finished("stop")
    cut = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stop=[words[2]],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens < 12
    wait_until_idle(server)
    client.completions.create(model=model, prompt="Hi", max_tokens=2)  # (a step: the engine's counters come)
    assert server.num_finished("stop") == stopped + 1
    assert server.engine_aborts() == engine_aborted


def test_client_timing_out_aborts_the_request(server, client, model):
    wait_until_idle(server)
    aborted, engine_aborted = server.num_finished("abort"), server.engine_aborts()
    body = {"model": model, "messages": user("Tell me a long story about a dragon."), "max_tokens": 200,
            "ignore_eos": True, "temperature": 0}
    with server.paused_engine():  # no answer can come in time, and nothing ends before the abort arrives
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{server.http}/v1/chat/completions", json=body, timeout=1.0)
        server.wait_for(lambda: server.num_finished("abort") == aborted + 1, what="the frontend to abort")
    wait_until_idle(server)
    assert server.engine_aborts() == engine_aborted + 1
    after = client.chat.completions.create(model=model, messages=user("Hi"), max_tokens=4, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert after.usage.completion_tokens == 4
