"""Bad requests to a real ``conveyor serve``: each gets its HTTP status and an OpenAI error body that names
the problem, never a 500, and the server keeps serving afterwards."""

from __future__ import annotations

import json
import os
import shlex
import signal
import threading

import anthropic
import anyio
import httpx
import openai
import pytest

from conveyor.entrypoints.zmq_client import Client, ServerError
from tests.server import Server

pytestmark = pytest.mark.slow

KEY = "test-key-1234"
MAX_MODEL_LEN = 256
MAX_BODY_BYTES = 4096
CONFIG = f"""
[model]
max_model_len = {MAX_MODEL_LEN}

[scheduler]
max_num_seqs = 1
max_waiting = 1

[server]
status_interval = 1.0

[[transport]]
plugin = "http"
port = 0
api_key_env = "CONVEYOR_TEST_KEY"
max_body_bytes = {MAX_BODY_BYTES}

[[transport]]
plugin = "zmq"
address = "tcp://127.0.0.1:*"
"""
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = Server(CONFIG, tmp_path_factory.mktemp("http_errors"), env={"CONVEYOR_TEST_KEY": KEY}).start()
    yield server
    assert server.stop() == 0, server.output


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.http, headers=AUTH, timeout=60) as http:
        yield http


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.http}/v1", api_key=KEY, max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def model(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def error_of(response: httpx.Response, status: int) -> dict:
    """The OpenAI error object of a response that must have ``status``."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["code"] == status
    return error


def assert_still_serving(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


def chat(**fields) -> bytes:
    return json.dumps({"messages": MESSAGES, "max_tokens": 4, **fields}).encode()


# (route, body, status, param, words the message must contain)
BAD_REQUESTS = {
    "malformed JSON": ("chat/completions", b'{"messages": [', 400, None, ["JSON"]),
    "not an object": ("chat/completions", b"[1, 2]", 400, None, ["object"]),
    "missing messages": ("chat/completions", b'{"max_tokens": 4}', 400, "messages", ["messages"]),
    "messages wrong type": ("chat/completions", b'{"messages": "Hi"}', 400, "messages", ["messages"]),
    "max_tokens a string": ("chat/completions", chat(max_tokens="ten"), 400, "max_tokens", ["max_tokens", "str"]),
    "temperature a string": ("completions", b'{"prompt": "Hi", "temperature": "hot"}', 400, "temperature",
                             ["temperature"]),
    "negative max_tokens": ("chat/completions", chat(max_tokens=-5), 400, "max_tokens", ["max_tokens", "-5"]),
    "zero max_tokens": ("completions", b'{"prompt": "Hi", "max_tokens": 0}', 400, "max_tokens", ["max_tokens"]),
    "negative temperature": ("chat/completions", chat(temperature=-0.5), 400, "temperature",
                             ["temperature", "-0.5"]),
    "seed beyond 64 bits": ("chat/completions", chat(seed=2**70), 400, "seed", ["seed"]),
    "priority beyond 64 bits": ("completions", json.dumps({"prompt": "Hi", "priority": -(2**70)}).encode(), 400,
                                "priority", ["priority"]),
    "empty stop string": ("chat/completions", chat(stop=["ok", ""]), 400, "stop", ["stop"]),
    "too many stop strings": ("chat/completions", chat(stop=[f"s{i}" for i in range(17)]), 400, "stop",
                              ["17", "at most 16"]),
    "a stop string too long": ("completions", json.dumps({"prompt": "Hi", "stop": "x" * 300}).encode(), 400, "stop",
                               ["256"]),
    "too many stop token ids": ("chat/completions", chat(stop_token_ids=list(range(100))), 400, "stop_token_ids",
                                ["100", "at most 64"]),
    "too many choices": ("chat/completions", chat(structured_outputs={"choice": [str(i) for i in range(300)]}), 400,
                         "structured_outputs", ["300", "at most 256"]),
    "top_p zero": ("chat/completions", chat(top_p=0), 400, "top_p", ["top_p"]),
    "n zero": ("chat/completions", chat(n=0), 400, "n", ["n=0"]),
    "n above 16": ("completions", json.dumps({"prompt": "Hi", "max_tokens": 2, "n": 17}).encode(), 400, "n",
                   ["n=17", "between 1 and 16"]),
    "min_tokens over max_tokens": (
        "completions", json.dumps({"prompt": "Hi", "max_tokens": 4, "min_tokens": 8}).encode(), 400, "min_tokens",
        ["min_tokens=8", "max_tokens=4"]),
    "min_tokens over completions' default max_tokens": (
        "completions", json.dumps({"prompt": "Hi", "min_tokens": 17}).encode(), 400, "min_tokens",
        ["min_tokens=17", "max_tokens=16"]),
    "min_tokens over max_completion_tokens": ("chat/completions", chat(max_completion_tokens=2, min_tokens=3), 400,
                                              "min_tokens", ["min_tokens=3", "max_completion_tokens=2"]),
    "zero max_completion_tokens": ("chat/completions", chat(max_completion_tokens=0), 400, "max_completion_tokens",
                                   ["max_completion_tokens=0"]),
    "prompt + max_completion_tokens over max_model_len": (
        "chat/completions", chat(max_completion_tokens=MAX_MODEL_LEN), 400, "max_completion_tokens",
        ["max_completion_tokens (256)", "max_model_len=256"]),
    "stream_options without stream": ("chat/completions", chat(stream_options={"include_usage": True}), 400,
                                      "stream_options", ["stream=True"]),
    "stream_options with stream false": (
        "completions", json.dumps({"prompt": "Hi", "stream": False, "stream_options": {}}).encode(), 400,
        "stream_options", ["stream=True"]),
    "too many top_logprobs": ("chat/completions", chat(logprobs=True, top_logprobs=50), 400, "top_logprobs",
                              ["50"]),
    "empty prompt": ("completions", b'{"prompt": ""}', 400, "prompt", ["empty"]),
    "a batch's prompt over max_model_len": (
        "completions", json.dumps({"prompt": ["Hi", "hello " * 300], "max_tokens": 1}).encode(), 400, "prompt[1]",
        ["prompt[1]", "max_model_len=256"]),
    "a batch's token id outside the vocabulary": ("completions", b'{"prompt": [[1, 2], [3, 99999999]]}', 400,
                                                  "prompt[1]", ["prompt[1]", "99999999"]),
    "too many prompts": ("completions", json.dumps({"prompt": ["Hi"] * 65, "max_tokens": 1}).encode(), 400, "prompt",
                         ["65", "at most 64"]),
    "token id outside the vocabulary": ("completions", b'{"prompt": [1, 99999999]}', 400, "prompt",
                                        ["99999999"]),
    "prompt + max_tokens over max_model_len": (
        "chat/completions", chat(max_tokens=MAX_MODEL_LEN), 400, "max_tokens", ["max_model_len=256", "256"]),
    "prompt alone over max_model_len": (
        "completions", json.dumps({"prompt": "hello " * 300, "max_tokens": 1}).encode(), 400, "prompt",
        ["max_model_len=256"]),
    "unknown role": ("chat/completions", json.dumps({"messages": [{"role": "bogus", "content": "Hi"}]}).encode(),
                     400, "messages", ["bogus", "allowed"]),
    "user message without content": ("chat/completions", json.dumps({"messages": [{"role": "user"}]}).encode(),
                                     400, "messages", ["messages[0]", "no content"]),
    "unknown model": ("chat/completions", chat(model="gpt-17"), 404, "model", ["gpt-17"]),
    "oversized body": ("completions", json.dumps({"prompt": "x" * (2 * MAX_BODY_BYTES)}).encode(), 413, None,
                       [str(MAX_BODY_BYTES)]),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request(http, case):
    route, body, status, param, words = BAD_REQUESTS[case]
    response = http.post(f"/v1/{route}", content=body, headers={"Content-Type": "application/json"})
    error = error_of(response, status)
    assert error["param"] == param
    for word in words:
        assert word in error["message"], error["message"]
    assert_still_serving(http)


def test_unknown_route_and_wrong_method(http):
    error = error_of(http.get("/v1/engines"), 404)
    assert "/v1/engines" in error["message"]
    error = error_of(http.get("/v1/chat/completions"), 405)
    assert "GET" in error["message"] and error["type"] == "invalid_request_error"
    assert_still_serving(http)


def test_the_files_api_of_a_server_without_a_batch_dir_answers_404_naming_the_key(http, client):
    for method, path in [("GET", "/v1/files"), ("POST", "/v1/files"), ("GET", "/v1/files/file-1"),
                         ("DELETE", "/v1/files/file-1"), ("GET", "/v1/files/file-1/content")]:
        error = error_of(http.request(method, path), 404)
        assert "set [batch] dir" in error["message"], (method, path)
    with pytest.raises(openai.NotFoundError, match=r"\[batch\] dir"):
        client.files.create(file=("a.jsonl", b"{}\n"), purpose="batch")
    assert_still_serving(http)


def test_oversized_body_without_content_length(http):
    def chunks():
        for _ in range(2 * MAX_BODY_BYTES // 512):
            yield b" " * 512
        yield b'{"prompt": "Hi"}'

    response = http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert "content-length" not in response.request.headers
    error = error_of(response, 413)
    assert str(MAX_BODY_BYTES) in error["message"]
    assert_still_serving(http)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-key"}, {"Authorization": KEY}],
                         ids=["missing", "wrong", "no bearer"])
def test_api_key_required(server, http, headers):
    with httpx.Client(base_url=server.http, headers=headers, timeout=60) as anonymous:
        for method, path in [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
                             ("POST", "/v1/responses"), ("GET", "/v1/responses/resp-1"), ("GET", "/v1/files"),
                             ("POST", "/v1/files"), ("GET", "/v1/files/file-1/content")]:
            response = anonymous.request(method, path, json={"messages": MESSAGES, "prompt": "Hi", "max_tokens": 2,
                                                             "input": "Hi"})
            error = error_of(response, 401)
            assert "API key" in error["message"]
        for path in ("/v1/messages", "/v1/messages/count_tokens"):  # in Anthropic's shape
            response = anonymous.post(path, json={"messages": MESSAGES, "max_tokens": 2})
            assert response.status_code == 401, response.text
            assert response.json()["error"]["type"] == "authentication_error", response.text
        # health and metrics stay open to probes and scrapers
        assert anonymous.get("/health").status_code == 200
        assert anonymous.get("/metrics").status_code == 200
    assert_still_serving(http)


def test_bench_asks_for_the_model_with_its_api_key(server):
    """`conveyor bench --api-key` sends the key with its first request (which model is served) too; without it the
    refusal says to pass one, at once, rather than waiting as for a server still starting."""
    from conveyor.bench.load import served_model

    async def model(key):
        async with httpx.AsyncClient(timeout=60) as client:
            return await served_model(client, server.http, key)

    assert anyio.run(model, KEY) == httpx.get(f"{server.http}/v1/models", headers={"Authorization": f"Bearer {KEY}"},
                                             timeout=60).json()["data"][0]["id"]
    with pytest.raises(ValueError, match=r"401 .*API key.*\(pass --api-key\)"):
        anyio.run(model, None)


@pytest.mark.parametrize("value", [None, ""], ids=["unset", "empty"])
def test_the_server_refuses_to_start_without_the_api_key_it_names(tmp_path, monkeypatch, value):
    """api_key_env names a variable that is unset (or empty): `conveyor serve` exits with status 2 before it
    serves anything, with one error line naming the config file and the variable."""
    name = "CONVEYOR_TEST_MISSING_KEY"
    monkeypatch.delenv(name, raising=False)
    server = Server(CONFIG.replace("CONVEYOR_TEST_KEY", name), tmp_path, env={} if value is None else {name: value})
    try:
        with pytest.raises(RuntimeError, match="exited during start-up"):
            server.start()
    finally:
        server.stop()
    assert server.process.returncode == 2
    errors = [line for line in server.lines if line.startswith("error:")]
    state = "is not set" if value is None else "is empty"
    assert errors == [f"error: {server.config_path}: [transport] api_key_env = '{name}': that environment variable "
                      f"{state}"], server.output


def test_the_banners_example_request_sends_the_key(server, monkeypatch):
    """The start-up banner's curl command, read as a shell reads it (the key's variable set, as the server's is):
    it gets an answer, where one without the key gets 401."""
    lines = server.lines[server.lines.index("Try:") + 1:]
    command = " ".join(line.removesuffix("\\").strip() for line in lines[:next(
        i for i, line in enumerate(lines) if not line.endswith("\\")) + 1])
    monkeypatch.setenv("CONVEYOR_TEST_KEY", KEY)
    words = shlex.split(os.path.expandvars(command))
    assert words[0] == "curl" and "Authorization: Bearer test-key-1234" in words, command
    headers = dict(words[i + 1].split(": ", 1) for i, word in enumerate(words) if word == "-H")
    body = words[words.index("-d") + 1]
    response = httpx.post(words[1], headers=headers, content=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]


def test_anthropic_clients_send_the_key_as_x_api_key(server, model, http):
    with anthropic.Anthropic(base_url=server.http, api_key=KEY, max_retries=0, timeout=60) as client:
        reply = client.messages.create(model=model, max_tokens=2, messages=MESSAGES)
        assert reply.usage.output_tokens == 2
    with anthropic.Anthropic(base_url=server.http, api_key="wrong", max_retries=0) as stranger, \
            pytest.raises(anthropic.AuthenticationError):
        stranger.messages.create(model=model, max_tokens=2, messages=MESSAGES)
    # (x-api-key on the OpenAI routes too: one key, however a client sends it)
    response = httpx.post(f"{server.http}/v1/completions", headers={"x-api-key": KEY},
                          json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert response.status_code == 200, response.text
    assert_still_serving(http)


def test_openai_client_sees_typed_errors(server, client, model, http):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-17", messages=MESSAGES, max_tokens=2)
    assert "gpt-17" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, temperature=-1)
    assert "temperature" in e.value.message
    stranger = openai.OpenAI(base_url=f"{server.http}/v1", api_key="wrong", max_retries=0)
    with stranger, pytest.raises(openai.AuthenticationError):
        stranger.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
    assert_still_serving(http)


def test_full_queue_gets_429(server, client, model, http):
    """max_num_seqs = 1 and max_waiting = 1: with one request running and one waiting, the next two are refused.
    A stream's status comes once the engine took its request; the engine is stopped while the two are sent, so
    they meet the full queue in the engine at once, however fast it is."""
    url = f"{server.http}/v1/chat/completions"
    long = {"model": model, "messages": MESSAGES, "max_tokens": 200, "ignore_eos": True, "stream": True}
    refused: dict[str, object] = {}

    def plain() -> None:
        refused["http"] = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})

    def openai_client() -> None:
        try:
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
        except openai.APIStatusError as e:
            refused["openai"] = e

    with httpx.stream("POST", url, json=long, headers=AUTH, timeout=60) as running:
        lines = running.iter_lines()
        next(line for line in lines if '"content"' in line and '"role"' not in line)  # it is generating
        threads = [threading.Thread(target=plain), threading.Thread(target=openai_client)]
        with httpx.stream("POST", url, json=long, headers=AUTH, timeout=60) as waiting, server.paused_engine():
            assert waiting.status_code == 200  # (taken: it waits in the queue)
            for thread in threads:
                thread.start()
            server.wait_for(lambda: server.metric("conveyor_num_requests_in_flight") == 4, timeout=30,
                            what="four requests in flight")
            server.resume_engine()
            for thread in threads:
                thread.join(60)
        error = error_of(refused["http"], 429)
        assert "max_waiting=1" in error["message"], error["message"]
        assert isinstance(refused["openai"], openai.RateLimitError)
    # both streams closed: the slot and the queue empty again
    server.wait_for(lambda: server.metric("conveyor_num_requests_running") == 0
                    and server.metric("conveyor_num_requests_waiting") == 0
                    and server.metric("conveyor_kv_cache_free_blocks") == server.metric("conveyor_kv_cache_blocks"),
                    timeout=30, what="the server to be idle")
    assert_still_serving(http)


def test_latency_targets_change_while_serving_and_one_that_cannot_be_met_is_refused(server, http):
    """POST /v1/admin/scheduler changes the scheduler's targets in the running engine (the API key required; only
    the keys the scheduler allows, checked), and a restarted engine keeps them. A TTFT target of 1 ms, which no
    step here meets: once the engine has timed a few steps, a new request is refused with 400 (its prompt alone
    would miss it: no Retry-After, since no wait helps) and its JSON error, streamed or not (over ZeroMQ: an error
    with status 400), and the requests served under it count as missing their TTFT target on /metrics; the targets
    off again, the server serves. (The queue's 429 with a Retry-After: tests/test_slo.py.)"""
    def missed(target: str) -> float:
        try:
            return server.metric("conveyor_requests_missed_slo_total", target=target)
        except KeyError:
            return 0.0

    assert httpx.get(f"{server.http}/v1/admin/scheduler").status_code == 401
    options = http.get("/v1/admin/scheduler").json()
    assert options["plugin"] == "continuous" and options["ttft_slo_ms"] == 0 and options["max_num_seqs"] == 1
    error = error_of(http.post("/v1/admin/scheduler", json={"max_num_seqs": 4}), 400)
    assert "cannot change max_num_seqs at run time (allowed: decode_stretch, itl_slo_ms, slo_admission, " \
           "slo_classes, ttft_slo_ms)" in error["message"]
    error_of(http.post("/v1/admin/scheduler", json={"ttft_slo_ms": -1}), 400)
    error_of(http.post("/v1/admin/scheduler", content=b"[1]"), 400)
    changed = http.post("/v1/admin/scheduler", json={"ttft_slo_ms": 1, "itl_slo_ms": 60000})
    assert changed.status_code == 200 and changed.json()["ttft_slo_ms"] == 1
    assert server.metric("conveyor_slo_target_seconds", target="ttft") == 0.001
    try:
        killed = server.engine_pid
        os.kill(killed, signal.SIGKILL)  # (the new engine reads the config file, then gets the changes again)
        server.wait_for(lambda: server.engine_pid != killed and httpx.get(f"{server.http}/health").status_code == 200,
                        timeout=180, what="the engine to restart")
        before, served = missed("ttft"), 0
        for _ in range(8):  # (the engine times a few steps before it predicts: until then it takes every request)
            response = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
            if response.status_code != 200:
                break
            served += 1
        error = error_of(response, 400)
        assert served >= 2 and missed("ttft") == before + served and missed("itl") == 0
        assert "its prompt alone would take" in error["message"], error["message"]
        assert "TTFT target (1 ms)" in error["message"] and "retry-after" not in response.headers
        # streamed: the same 400, not a 200 whose stream then ends with an error event
        streamed = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "stream": True})
        assert "TTFT target (1 ms)" in error_of(streamed, 400)["message"]
        with Client(server.url("tcp"), timeout=60) as zmq_client, pytest.raises(ServerError) as refused:
            zmq_client.generate(messages=MESSAGES, max_tokens=2)
        assert refused.value.status == 400 and "TTFT target (1 ms)" in refused.value.message
        assert refused.value.retry_after == 0
    finally:
        assert http.post("/v1/admin/scheduler", json={"ttft_slo_ms": 0, "itl_slo_ms": 0}).status_code == 200
    assert_still_serving(http)
