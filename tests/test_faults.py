"""Faults under load against a real ``conveyor serve``: a client that stops reading its stream, the engine
killed under 32 streams, a KV cache too small for the requests, a burst of 10x max_waiting, and SIGTERM in the
middle of a burst."""

from __future__ import annotations

import json
import os
import signal
import threading

import anyio
import httpx
import pytest

from tests.server import Server, http_config

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Tell me a long story about a dragon."}]


@pytest.fixture(scope="module")
def server(default_server):
    return default_server  # (tests/conftest.py: one server with the default config for the whole suite)


async def stream_events(client: httpx.AsyncClient, body: dict, started: anyio.Event | None = None) -> list:
    """Every SSE payload of one streamed chat ("[DONE]" as the string); ``started`` is set on the first."""
    events = []
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
                if started is not None:
                    started.set()
    return events


def test_a_client_that_stops_reading_holds_up_nobody(server):
    """A stream whose client reads one chunk and then nothing: other requests run and finish meanwhile, and the
    engine finishes it too (the frontend holds its output, at most max_tokens of it); when the client reads
    again it gets every token."""
    body = {"messages": MESSAGES, "max_tokens": 300, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.http}/v1/chat/completions", json=body, timeout=300) as slow:
        lines = slow.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        # (the slow client reads nothing while these run: 48 tokens in all against its 300, so they end while
        # it still runs in the engine, however fast the device)
        for _ in range(3):
            reply = httpx.post(f"{server.http}/v1/chat/completions", timeout=120,
                               json={"messages": MESSAGES, "max_tokens": 16, "ignore_eos": True})
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 16
        # (the gauge comes with each step's stats: the last reply's own step may still count it)
        server.wait_for(lambda: server.metric("conveyor_num_requests_running") <= 1, what="the last reply's step")
        assert server.metric("conveyor_num_requests_running") == 1  # the slow stream, still generating
        server.wait_for(lambda: server.metric("conveyor_num_requests_running") == 0, timeout=300,
                        what="the slow client's request to finish in the engine")
        rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert rest[-1]["usage"]["completion_tokens"] == 300  # (every token arrived)
    assert [c["finish_reason"] for e in rest for c in e["choices"] if c["finish_reason"]] == ["length"]


def test_the_engine_killed_under_32_streams_ends_each_with_one_503_then_serves_again(server):
    results: list[list] = []

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.http, timeout=120) as client:
            started = [anyio.Event() for _ in range(32)]

            async def one(i: int) -> None:
                results.append(await stream_events(
                    client, {"messages": MESSAGES, "max_tokens": 2000, "ignore_eos": True}, started[i]))

            async with anyio.create_task_group() as tg:
                for i in range(32):
                    tg.start_soon(one, i)
                for event in started:
                    await event.wait()
                pid = server.engine_pid
                os.kill(pid, signal.SIGSTOP)  # (no stream can end on its own from here, however fast the device)
                os.kill(pid, signal.SIGKILL)

    anyio.run(run)
    assert len(results) == 32
    for events in results:
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert events[-1] == "[DONE]" and len(errors) == 1 and events[-2] is errors[0]
        assert errors[0]["error"]["code"] == 503
    server.wait_for(lambda: httpx.get(f"{server.http}/health").status_code == 200, timeout=180,
                    what="the engine to restart")
    reply = httpx.post(f"{server.http}/v1/chat/completions", timeout=60,
                       json={"messages": MESSAGES, "max_tokens": 4, "ignore_eos": True})
    assert reply.json()["usage"]["completion_tokens"] == 4
    assert server.metric("conveyor_num_requests_in_flight") == 0


def test_a_full_kv_cache_then_a_burst_of_10x_max_waiting_then_sigterm_in_a_burst(tmp_path):
    """One server, max_num_seqs = max_waiting = 4, a KV cache of 20 blocks of 16 tokens. Four streams of 150
    tokens at once need 48 blocks: requests are preempted and resumed, and each gets all its tokens. Then 40
    requests at once (10x max_waiting) get 200 or 429 (a JSON error naming max_waiting), never a 5xx, and
    service is normal after (a request gets 200, nothing left in flight, every KV block free). Then 40 more at
    once and SIGTERM among them: every request ends (done, 429 or 503: none hangs or gets a 500) and the
    server exits 0."""
    server = Server(http_config(drain_timeout=60.0) + "\n[scheduler]\nmax_num_seqs = 4\nmax_waiting = 4\n"
                    "\n[kvcache]\nnum_blocks = 20\nblock_size = 16\n", tmp_path).start()
    body = {"messages": MESSAGES, "max_tokens": 24, "ignore_eos": True}

    streams: list[list] = []

    async def long_streams() -> None:
        async with httpx.AsyncClient(base_url=server.http, timeout=300) as client:
            long = {"messages": MESSAGES, "max_tokens": 150, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}

            async def one() -> None:
                streams.append(await stream_events(client, long))

            async with anyio.create_task_group() as tg:
                with server.paused_engine():  # (all four in the engine at once, however fast the device)
                    for _ in range(4):
                        tg.start_soon(one)
                    while await anyio.to_thread.run_sync(server.metric, "conveyor_num_requests_in_flight") < 4:
                        await anyio.sleep(0.1)

    anyio.run(long_streams)
    assert len(streams) == 4
    for events in streams:
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 150
    assert server.metric("conveyor_preemptions_total") > 0
    assert server.metric("conveyor_kv_cache_free_blocks") == server.metric("conveyor_kv_cache_blocks") == 20

    def burst(statuses: list[int], errors: list[str]) -> list[threading.Thread]:
        def one() -> None:
            try:
                reply = httpx.post(f"{server.http}/v1/chat/completions", timeout=120, json=body)
                statuses.append(reply.status_code)
                if reply.status_code == 429:
                    errors.append(reply.json()["error"]["message"])
            except httpx.TransportError:  # (the server closed the connection while stopping)
                statuses.append(0)

        threads = [threading.Thread(target=one) for _ in range(40)]
        for thread in threads:
            thread.start()
        return threads

    def arrived(statuses: list[int]) -> bool:  # every request answered (429) or in flight
        return server.metric("conveyor_num_requests_in_flight") + len(statuses) >= 40

    statuses: list[int] = []
    errors: list[str] = []
    with server.paused_engine():  # (the whole burst reaches the engine at once, however fast the device)
        threads = burst(statuses, errors)
        server.wait_for(lambda: arrived(statuses), what="the whole burst to arrive")
    for thread in threads:
        thread.join(120)
    assert len(statuses) == 40 and set(statuses) == {200, 429}, statuses
    assert all("max_waiting=4" in message for message in errors), errors[:3]
    assert httpx.post(f"{server.http}/v1/chat/completions", timeout=120, json=body).status_code == 200
    assert server.metric("conveyor_num_requests_in_flight") == 0
    assert server.metric("conveyor_kv_cache_free_blocks") == server.metric("conveyor_kv_cache_blocks")

    statuses.clear()
    with server.paused_engine():
        threads = burst(statuses, errors)
        server.wait_for(lambda: arrived(statuses), what="the whole burst to arrive")
    server.process.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(120)
    assert server.process.wait(120) == 0
    assert len(statuses) == 40 and set(statuses) <= {200, 429, 503}, statuses
    assert 200 in statuses and 429 in statuses
