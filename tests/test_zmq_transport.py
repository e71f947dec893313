"""The ZMQ transport on a real server: a raw client written from docs/zmq-protocol.md,
conveyor.entrypoints.zmq_client sync and async, HTTP and ZMQ served at once, and CURVE."""

from __future__ import annotations

import threading
import time
from array import array
from contextlib import aclosing

import anyio
import httpx
import msgspec
import pytest
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from conveyor.entrypoints.zmq_client import AsyncClient, Client, ServerError
from tests.server import Server

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def zmq_config(options: str = "") -> str:
    return f"""
[server]
status_interval = 0
# the frontend <-> engine sockets over TCP instead of the default ipc://
engine_address = "tcp://127.0.0.1"

[[transport]]
plugin = "http"
port = 0

[[transport]]
plugin = "zmq"
address = "tcp://127.0.0.1:*"
{options}
"""


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """A server key pair, one authorized client and one stranger."""
    root = tmp_path_factory.mktemp("keys")
    (root / "clients").mkdir()
    (root / "strangers").mkdir()
    zmq.auth.create_certificates(root, "server")
    zmq.auth.create_certificates(root / "clients", "alice")
    zmq.auth.create_certificates(root / "strangers", "mallory")
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory, keys):
    curve = (
        f'curve_secret_key_file = "{keys / "server.key_secret"}"\n'
        f'curve_authorized_keys_dir = "{keys / "clients"}"'
    )
    server = Server(zmq_config(curve), tmp_path_factory.mktemp("zmq-server")).start()
    yield server
    assert server.stop() == 0


@pytest.fixture()
def client_keys(keys):
    return {"server_public_key_file": keys / "server.key", "secret_key_file": keys / "clients" / "alice.key_secret"}


def curve_dealer(keys, client: str = "clients/alice") -> zmq.Socket:
    """A DEALER socket set up the way docs/zmq-protocol.md says, with CURVE keys; not yet connected."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.curve_serverkey, _ = zmq.auth.load_certificate(keys / "server.key")
    socket.curve_publickey, socket.curve_secretkey = zmq.auth.load_certificate(keys / f"{client}.key_secret")
    return socket


def raw_socket(server: Server, keys, client: str = "clients/alice") -> zmq.Socket:
    socket = curve_dealer(keys, client)
    socket.connect(server.url("tcp"))
    return socket


def monitored_socket(server: Server, keys, client: str = "clients/alice") -> tuple[zmq.Socket, zmq.Socket]:
    """``raw_socket``, and its monitor (attached before the connection, so it sees the handshake)."""
    socket = curve_dealer(keys, client)
    monitor = socket.get_monitor_socket()
    socket.connect(server.url("tcp"))
    return socket, monitor


def test_raw_client_from_the_protocol_document(server, keys, tokenizer):
    socket = raw_socket(server, keys)
    request = {
        "request_id": "r1",
        "messages": QUESTION,
        "params": {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 2},
    }
    socket.send_multipart([b"generate", msgspec.msgpack.encode(request)])
    chunks = []
    while True:
        assert socket.poll(60_000), "no reply"
        kind, body = socket.recv_multipart()
        assert kind == b"chunk", msgspec.msgpack.decode(body)
        message = msgspec.msgpack.decode(body)
        assert message["request_id"] == "r1"
        chunks.append(message)
        if message.get("finish_reason"):
            break
    token_ids = [t for c in chunks for t in c["token_ids"]]
    text = "".join(c["text"] for c in chunks)
    final = chunks[-1]
    assert final["finish_reason"] == "length"
    assert final["usage"]["completion_tokens"] == len(token_ids) == 12
    assert final["usage"]["prompt_tokens"] == len(tokenizer.encode_chat(QUESTION))
    assert text == tokenizer.decode(token_ids)
    logprobs = [lp for c in chunks for lp in c.get("logprobs") or []]
    assert [lp["token_id"] for lp in logprobs] == token_ids
    assert all(len(lp["top_ids"]) == 2 and lp["top_ids"][0] == lp["token_id"] for lp in logprobs)  # greedy

    # an embedding (params.pooling) comes in the last chunk, as HTTP's /v1/embeddings computes it
    socket.send_multipart([b"generate", msgspec.msgpack.encode(
        {"request_id": "e1", "prompt": "The sea is", "params": {"max_tokens": 1, "pooling": "last"}})])
    assert socket.poll(60_000)
    kind, body = socket.recv_multipart()
    final = msgspec.msgpack.decode(body)
    assert kind == b"chunk" and final["finish_reason"] == "stop" and not final["token_ids"], final
    vector = array("f", final["embedding"]).tolist()
    served = httpx.post(f"{server.http}/v1/embeddings", json={"input": "The sea is", "normalize": False}).json()
    assert len(vector) == 576 and vector == pytest.approx(served["data"][0]["embedding"], abs=1e-2)

    # a malformed message gets an error naming the problem, and the socket keeps working
    socket.send_multipart([b"generate", msgspec.msgpack.encode({"request_id": "r2", "prompt": "hi", "params": {"tempreature": 1}})])
    assert socket.poll(60_000)
    kind, body = socket.recv_multipart()
    assert kind == b"error"
    error = msgspec.msgpack.decode(body)
    assert error["status"] == 400 and "tempreature" in error["message"]
    assert error["request_id"] == "r2"  # (the id the refused message carried comes back)
    socket.send_multipart([b"generat", msgspec.msgpack.encode({"request_id": "r3", "prompt": "hi"})])
    assert socket.poll(60_000)
    kind, body = socket.recv_multipart()
    error = msgspec.msgpack.decode(body)
    assert kind == b"error" and error["request_id"] == "r3"
    assert error["message"] == "unknown message type 'generat'; expected one of: generate, abort, health", error
    socket.send_multipart([b"generate"])
    assert socket.poll(60_000)
    error = msgspec.msgpack.decode(socket.recv_multipart()[1])
    assert error["request_id"] is None and "got 1" in error["message"], error
    socket.send_multipart([b"health", msgspec.msgpack.encode({})])
    assert socket.poll(60_000)
    kind, body = socket.recv_multipart()
    assert kind == b"health" and msgspec.msgpack.decode(body)["alive"] is True
    socket.close()



def raw_generate(socket: zmq.Socket, request: dict) -> list[dict]:
    """Send one generate on a raw socket; its chunks, up to the one with a finish_reason."""
    socket.send_multipart([b"generate", msgspec.msgpack.encode(request)])
    chunks = []
    while not chunks or not chunks[-1].get("finish_reason"):
        assert socket.poll(120_000), "no reply"
        kind, body = socket.recv_multipart()
        assert kind == b"chunk", msgspec.msgpack.decode(body)
        chunks.append(msgspec.msgpack.decode(body))
    return chunks


def assembled_calls(chunks: list[dict]) -> list[tuple[str, str]]:
    """The tool calls the chunks' pieces make (name, arguments), in order, as a client assembles them."""
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for piece in chunk.get("tool_calls") or []:
            call = calls.setdefault(piece["index"], ["", ""])
            call[0] += piece.get("name") or ""
            call[1] += piece.get("arguments", "")
    return [tuple(call) for _, call in sorted(calls.items())]


@pytest.mark.parametrize("tool_choice", ["required", "auto", "none"])
def test_tool_calls_through_the_raw_protocol_equal_https(server, keys, client_keys, tool_choice):
    """A chat turn with tools, greedy, through the ZMQ protocol (streamed and not, and by conveyor.entrypoints.zmq_client) and
    through HTTP's chat completions on the same server: the same calls (name and arguments), the same text, the
    same finish reason."""
    from tests.test_tool_calls import QUESTION as WEATHER_QUESTION
    from tests.test_tool_calls import TIME, WEATHER

    body = {"messages": WEATHER_QUESTION, "tools": [WEATHER, TIME], "tool_choice": tool_choice}
    http = httpx.post(f"{server.http}/v1/chat/completions", timeout=120,
                      json={**body, "max_tokens": 60, "temperature": 0}).json()
    choice = http["choices"][0]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"].get("tool_calls") or []]
    if tool_choice == "required":
        assert calls and choice["finish_reason"] == "tool_calls", choice
    if tool_choice == "none":
        assert not calls, choice
    socket = raw_socket(server, keys)
    for stream in (True, False):
        chunks = raw_generate(socket, {"request_id": f"tools-{stream}", **body, "stream": stream,
                                       "params": {"max_tokens": 60, "temperature": 0}})
        assert len(chunks) > 1 if stream else len(chunks) == 1
        assert assembled_calls(chunks) == calls
        assert "".join(c["text"] for c in chunks) == (choice["message"]["content"] or "")
        assert chunks[-1]["finish_reason"] == choice["finish_reason"]
        assert not any(c.get("reasoning") for c in chunks)  # (this server splits no thinking)
    with Client(server.url("tcp"), timeout=120, **client_keys) as client:
        done = client.generate(messages=WEATHER_QUESTION, tools=[WEATHER, TIME], tool_choice=tool_choice,
                               max_tokens=60, temperature=0)
    assert [(c.name, c.arguments) for c in done.tool_calls or []] == calls
    assert (done.text, done.finish_reason) == (choice["message"]["content"] or "", choice["finish_reason"])
    # tools without a chat are refused, naming why; the socket goes on
    socket.send_multipart([b"generate", msgspec.msgpack.encode({"request_id": "bad", "prompt": "hi",
                                                                 "tools": [WEATHER]})])
    assert socket.poll(60_000)
    kind, reply = socket.recv_multipart()
    error = msgspec.msgpack.decode(reply)
    assert kind == b"error" and error["status"] == 400 and "need messages" in error["message"], error
    socket.close()


def next_event(monitor: zmq.Socket, *wanted: int, timeout_ms: int = 60_000) -> dict:
    """The first of the ``wanted`` events a socket's monitor reports (others, such as connection retries, are
    skipped)."""
    while monitor.poll(timeout_ms):
        event = recv_monitor_message(monitor)
        if event["event"] in wanted:
            return event
    raise AssertionError(f"no event {wanted} in {timeout_ms} ms")


def test_a_client_sending_an_oversized_message_is_dropped_and_others_are_served(server, keys):
    """max_message_bytes (4 MiB): a message under it is decoded (and refused as the garbage it is), one over it
    has the server close the connection before anything is decoded (the client's socket sees it closed, with no
    reply first); the server goes on."""
    hostile, monitor = monitored_socket(server, keys)
    next_event(monitor, zmq.EVENT_HANDSHAKE_SUCCEEDED)
    hostile.send_multipart([b"generate", b"\x00" * (3 * 1024 * 1024)])
    assert hostile.poll(60_000)
    kind, body = hostile.recv_multipart()
    assert kind == b"error" and msgspec.msgpack.decode(body)["status"] == 400
    hostile.send_multipart([b"generate", b"\x00" * (5 * 1024 * 1024)])
    next_event(monitor, zmq.EVENT_DISCONNECTED)
    assert not hostile.poll(0)  # (nothing was answered before the connection closed)
    hostile.disable_monitor()
    monitor.close()
    hostile.close()
    socket = raw_socket(server, keys)
    request = {"request_id": "after", "prompt": "Hi", "params": {"max_tokens": 2}, "stream": False}
    socket.send_multipart([b"generate", msgspec.msgpack.encode(request)])
    assert socket.poll(60_000)
    assert msgspec.msgpack.decode(socket.recv_multipart()[1])["finish_reason"] == "length"
    socket.close()


def test_raw_client_abort(server, keys):
    socket = raw_socket(server, keys)
    engine_aborted = server.engine_aborts()
    request = {"request_id": "long", "prompt": "Tell me a story.", "params": {"max_tokens": 500, "ignore_eos": True}}
    socket.send_multipart([b"generate", msgspec.msgpack.encode(request)])
    assert socket.poll(60_000)
    socket.recv_multipart()
    # stopped until the abort has gone out: the request cannot end by itself first
    with server.paused_engine():
        socket.send_multipart([b"abort", msgspec.msgpack.encode({"request_id": "long"})])
        while True:
            assert socket.poll(60_000), "no final chunk after abort"
            _, body = socket.recv_multipart()
            message = msgspec.msgpack.decode(body)
            if message.get("finish_reason"):
                break
    assert message["finish_reason"] == "abort"
    assert message["usage"]["completion_tokens"] < 500
    server.wait_for(lambda: server.metric("conveyor_kv_cache_free_blocks") == server.metric("conveyor_kv_cache_blocks"),
                    what="the aborted request's blocks to be freed")
    assert server.engine_aborts() == engine_aborted + 1
    socket.close()


def receive(socket: zmq.Socket) -> tuple[bytes, dict]:
    assert socket.poll(60_000), "no reply"
    kind, body = socket.recv_multipart()
    return kind, msgspec.msgpack.decode(body)


def until_final(socket: zmq.Socket, request_id: str) -> list[dict]:
    """Every chunk of the request up to its final one (those of others skipped)."""
    chunks = []
    while not chunks or not chunks[-1]["finish_reason"]:
        kind, message = receive(socket)
        assert kind == b"chunk", message
        if message["request_id"] == request_id:
            chunks.append(message)
    return chunks


def test_streamed_chunks_carry_every_token_and_every_logprob_key(server, keys, tokenizer):
    """A stop string that never matches holds text back now and then, so some chunks carry tokens and no text
    yet: every token still comes, in order (their text the decoded tokens), and each logprob map has all four
    keys, with no alternatives at logprobs 0."""
    socket = raw_socket(server, keys)
    params = {"max_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": [" la la XYZQ"], "logprobs": 0}
    socket.send_multipart([b"generate", msgspec.msgpack.encode({"request_id": "s", "messages": QUESTION,
                                                                "params": params})])
    chunks = until_final(socket, "s")
    tokens = [t for c in chunks for t in c["token_ids"]]
    assert len(tokens) == chunks[-1]["usage"]["completion_tokens"] == 24
    assert "".join(c["text"] for c in chunks) == tokenizer.decode(tokens)
    logprobs = [lp for c in chunks for lp in c["logprobs"] or []]
    assert [lp["token_id"] for lp in logprobs] == tokens
    assert all(lp["top_ids"] == [] and lp["top_logprobs"] == [] and lp["logprob"] <= 0 for lp in logprobs)
    socket.close()


def test_a_duplicate_id_leaves_its_request_running_and_an_aborted_id_may_be_used_again(server, keys):
    """A second generate with the id of a request in flight is refused with no request_id (so that a client
    ending the request named by an error keeps the first); the first goes on. Aborted while the engine is
    stopped (it has not yet ended the request), the id is taken again at once and that request runs."""
    socket = raw_socket(server, keys)
    long = {"request_id": "d", "prompt": "Tell me a story.", "params": {"max_tokens": 300, "ignore_eos": True}}
    socket.send_multipart([b"generate", msgspec.msgpack.encode(long)])
    assert receive(socket)[0] == b"chunk"
    with server.paused_engine():  # (the first cannot end by itself meanwhile, however fast the device)
        socket.send_multipart([b"generate", msgspec.msgpack.encode(long)])
        while (reply := receive(socket))[0] == b"chunk":
            assert reply[1]["request_id"] == "d" and not reply[1]["finish_reason"]
        kind, error = reply
        assert kind == b"error" and error["request_id"] is None and "'d' is already in flight" in error["message"]
        socket.send_multipart([b"abort", msgspec.msgpack.encode({"request_id": "d"})])
        assert until_final(socket, "d")[-1]["finish_reason"] == "abort"
        short = {"request_id": "d", "prompt": "Hi", "params": {"max_tokens": 4, "ignore_eos": True}, "stream": False}
        socket.send_multipart([b"generate", msgspec.msgpack.encode(short)])
    (final,) = until_final(socket, "d")
    assert final["finish_reason"] == "length" and len(final["token_ids"]) == 4
    socket.close()


def test_an_aborted_request_without_streaming_returns_what_it_made(server, keys, tokenizer):
    socket = raw_socket(server, keys)
    made = server.metric("conveyor_generation_tokens_total")
    request = {"request_id": "w", "prompt": "Tell me a story.", "params": {"max_tokens": 400, "ignore_eos": True},
               "stream": False}
    socket.send_multipart([b"generate", msgspec.msgpack.encode(request)])
    server.wait_for(lambda: server.metric("conveyor_generation_tokens_total") >= made + 8, what="some tokens")
    with server.paused_engine():  # (it cannot end by itself before the abort, however fast the device)
        socket.send_multipart([b"abort", msgspec.msgpack.encode({"request_id": "w"})])
        (final,) = until_final(socket, "w")
    assert final["finish_reason"] == "abort"
    assert 8 <= len(final["token_ids"]) == final["usage"]["completion_tokens"] < 400
    assert final["text"] == tokenizer.decode(final["token_ids"])
    socket.close()


def test_a_client_that_disconnects_mid_stream_has_its_request_aborted(server, keys):
    """The ROUTER learns of the departure at the next chunk, which the request then never makes past: it ends
    in the engine as an abort and frees its blocks, where it used to run to its max_tokens for nobody."""
    socket = raw_socket(server, keys)
    engine_aborted = server.engine_aborts()
    request = {"request_id": "left", "prompt": "Tell me a story.", "params": {"max_tokens": 1500, "ignore_eos": True}}
    socket.send_multipart([b"generate", msgspec.msgpack.encode(request)])
    assert receive(socket)[0] == b"chunk"
    socket.close(linger=0)
    server.wait_for(lambda: server.engine_aborts() == engine_aborted + 1, what="the request to be aborted")
    server.wait_for(lambda: server.metric("conveyor_kv_cache_free_blocks") == server.metric("conveyor_kv_cache_blocks"),
                    what="its blocks to be freed")


def test_a_client_that_stops_reading_has_its_requests_aborted(tmp_path):
    """A client that stays connected and reads nothing fills its queue (one message here, plus the network's
    buffers: 16 kB and 4 kB); its requests wait, a second client is served meanwhile, and once the queue has stayed full for the
    timeout the first client's requests are aborted (they used to run to their end, their output buffered
    without bound)."""
    server = Server(zmq_config("client_queue_messages = 1\nslow_client_timeout_s = 1.0\nsend_buffer_bytes = 16384"), tmp_path).start()
    try:
        stuck = zmq.Context.instance().socket(zmq.DEALER)
        stuck.setsockopt(zmq.LINGER, 0)
        stuck.setsockopt(zmq.RCVHWM, 1)
        stuck.setsockopt(zmq.RCVBUF, 4096)
        stuck.connect(server.url("tcp"))
        params = {"max_tokens": 1500, "ignore_eos": True, "logprobs": 20}  # (some 400 bytes a chunk)
        for i in range(8):
            request = {"request_id": f"s{i}", "prompt": f"Tell me story number {i}.", "params": params}
            stuck.send_multipart([b"generate", msgspec.msgpack.encode(request)])
        other = zmq.Context.instance().socket(zmq.DEALER)
        other.setsockopt(zmq.LINGER, 0)
        other.connect(server.url("tcp"))
        other.send_multipart([b"generate", msgspec.msgpack.encode(
            {"request_id": "o", "prompt": "Hi", "params": {"max_tokens": 8, "ignore_eos": True}, "stream": False})])
        (final,) = until_final(other, "o")
        assert final["finish_reason"] == "length" and len(final["token_ids"]) == 8
        server.wait_for(lambda: server.engine_aborts() == 8, timeout=120, what="the unread requests to be aborted")
        server.wait_for(lambda: server.metric("conveyor_kv_cache_free_blocks") == server.metric("conveyor_kv_cache_blocks"),
                        what="their blocks to be freed")
        assert "read nothing for 1 s with its queue full; request 's0' ends without its reply" in server.output
        stuck.close()
        other.close()
    finally:
        assert server.stop() == 0


def test_sync_client_matches_http(server, client_keys):
    import openai

    with Client(server.url("tcp"), timeout=60, **client_keys) as client:
        assert client.health().alive
        # the same request once before, so the compared ones find the same prefix cache (the same blocks
        # cached, the same pieces computed: equal usage, cached tokens included)
        client.generate(messages=QUESTION, max_tokens=1, temperature=0)
        whole = client.generate(messages=QUESTION, max_tokens=16, temperature=0)
        chunks = list(client.stream(messages=QUESTION, max_tokens=16, temperature=0))
        with pytest.raises(ServerError) as error:
            client.generate("hello", max_tokens=10**6)
        assert error.value.status == 400 and "max_model_len" in error.value.message
        # model: the served model by name (a LoRA adapter's name picks it); a name not served is a 404
        named = client.generate(messages=QUESTION, max_tokens=16, temperature=0, model="smollm2-135m-instruct")
        with pytest.raises(ServerError) as error:
            client.generate("hello", max_tokens=2, model="no-such-adapter")
        assert error.value.status == 404
    assert "".join(c.text for c in chunks) == whole.text == named.text
    assert chunks[-1].finish_reason == whole.finish_reason and chunks[-1].usage == whole.usage
    http = openai.OpenAI(base_url=f"{server.http}/v1", api_key="unused")
    reply = http.chat.completions.create(model="smollm2-135m-instruct", messages=QUESTION, max_tokens=16, temperature=0)
    assert reply.choices[0].message.content == whole.text
    assert reply.usage.completion_tokens == whole.usage.completion_tokens


async def until(predicate, what: str, timeout: float = 60.0) -> None:
    """Poll ``predicate`` without blocking the event loop (the client's reader runs meanwhile)."""
    with anyio.fail_after(timeout):
        while not await anyio.to_thread.run_sync(predicate):
            await anyio.sleep(0.05)



async def test_async_client_runs_requests_concurrently(server, client_keys, tokenizer):
    prompts = [f"Count from {i} to {i + 5}:" for i in range(6)]
    engine_aborted, aborted = server.engine_aborts(), server.num_finished("abort")
    async with AsyncClient(server.url("tcp"), timeout=120, **client_keys) as client:
        assert (await client.health()).alive
        results: dict[int, object] = {}
        # when each request's first and last chunks came
        spans: dict[int, tuple[float, float]] = {}

        async def one(i: int) -> None:
            chunks = []
            async for chunk in client.stream(prompts[i], max_tokens=8 + i, temperature=0, ignore_eos=True):
                chunks.append((anyio.current_time(), chunk))
            spans[i] = (chunks[0][0], chunks[-1][0])
            results[i] = chunks[-1][1]

        # the engine stopped until all six are in: it takes them together, however fast it is
        server.pause_engine()
        try:
            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
                await until(lambda: server.metric("conveyor_num_requests_in_flight") == 6, "six requests in flight")
                server.resume_engine()
        finally:
            server.resume_engine()
        # leaving a stream early aborts the request
        try:
            async with aclosing(client.stream("Tell me a long story.", max_tokens=400, ignore_eos=True)) as chunks:
                async for _ in chunks:
                    server.pause_engine()  # nothing more happens in the engine until the abort has gone out
                    break
            await until(lambda: server.num_finished("abort") == aborted + 1, "the frontend to abort the stream")
        finally:
            server.resume_engine()
    for i, prompt in enumerate(prompts):
        result = results[i]
        assert result.finish_reason == "length"
        assert result.usage.completion_tokens == 8 + i
        assert result.usage.prompt_tokens == len(tokenizer.encode(prompt))
    # all six were in flight at once: every one started before any one ended
    assert max(first for first, _ in spans.values()) < min(last for _, last in spans.values())
    await until(lambda: server.engine_aborts() == engine_aborted + 1, "the engine to abort the abandoned stream")
    await until(lambda: server.metric("conveyor_num_requests_running") == 0, "the engine to be idle")


def test_curve_rejects_a_client_with_the_wrong_key(server, keys):
    """The handshake fails, as the client's socket reports it, for a key not in the authorized directory (the
    server's authenticator answers 400) and for a client without CURVE (a mechanism mismatch); neither gets a
    reply. The authorized client's handshake succeeds and it gets its answer."""
    stranger, monitor = monitored_socket(server, keys, client="strangers/mallory")
    stranger.send_multipart([b"health", msgspec.msgpack.encode({})])
    refused = next_event(monitor, zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_SUCCEEDED)
    assert (refused["event"], refused["value"]) == (zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400), refused
    assert not stranger.poll(0)
    stranger.disable_monitor()
    monitor.close()
    stranger.close()
    plain = zmq.Context.instance().socket(zmq.DEALER)  # no CURVE at all
    plain.setsockopt(zmq.LINGER, 0)
    monitor = plain.get_monitor_socket()
    plain.connect(server.url("tcp"))
    plain.send_multipart([b"health", msgspec.msgpack.encode({})])
    refused = next_event(monitor, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_SUCCEEDED)
    assert (refused["event"], refused["value"]) == (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                                                    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH), refused
    assert not plain.poll(0)
    plain.disable_monitor()
    monitor.close()
    plain.close()
    # the authorized client still gets through
    trusted, monitor = monitored_socket(server, keys)
    trusted.send_multipart([b"health", msgspec.msgpack.encode({})])
    next_event(monitor, zmq.EVENT_HANDSHAKE_SUCCEEDED)
    assert trusted.poll(60_000)
    assert trusted.recv_multipart()[0] == b"health"
    trusted.disable_monitor()
    monitor.close()
    trusted.close()


async def test_a_health_reply_after_its_timeout_does_not_break_the_async_client():
    """A server that answers health late: the call times out, the late reply is dropped, and the client goes on
    (its next health call gets its answer)."""
    context = zmq.Context.instance()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:*")
    address = router.getsockopt_string(zmq.LAST_ENDPOINT)

    def answer(delay: float) -> None:
        assert router.poll(60_000)
        identity, kind, _ = router.recv_multipart()
        assert kind == b"health"
        time.sleep(delay)
        router.send_multipart([identity, b"health", msgspec.msgpack.encode(
            {"alive": True, "model": "m", "max_model_len": 8, "num_in_flight": 0})])

    try:
        async with AsyncClient(address, timeout=0.5) as client:
            late = threading.Thread(target=answer, args=(1.5,))
            late.start()
            with pytest.raises(TimeoutError):
                await client.health()
            await anyio.to_thread.run_sync(late.join)
            await anyio.sleep(0.2)  # (the late reply reaches the client's reader)
            prompt = threading.Thread(target=answer, args=(0.0,))
            prompt.start()
            assert (await client.health()).model == "m"
            await anyio.to_thread.run_sync(prompt.join)
    finally:
        router.close()
