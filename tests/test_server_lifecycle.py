"""A real ``conveyor serve`` through its life: health, losing its engine process, and stopping on SIGTERM
with requests in flight."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import httpx
import pytest
import torch

from tests.server import Server, http_config

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Tell me a long story about a dragon."}]


def events(response: httpx.Response):
    """The SSE ``data:`` payloads of a streaming response, decoded; ``[DONE]`` as the string."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            yield data if data == "[DONE]" else json.loads(data)


def health(server: Server) -> int | None:
    try:
        return httpx.get(f"{server.http}/health", timeout=5).status_code
    except httpx.TransportError:
        return None


def chat(server: Server, **fields) -> httpx.Response:
    body = {"messages": MESSAGES, "temperature": 0, **fields}
    return httpx.post(f"{server.http}/v1/chat/completions", json=body, timeout=120)


@pytest.fixture(scope="module")
def server(default_server):
    return default_server  # (tests/conftest.py: one server with the default config for the whole suite)


def test_health_is_ok_when_up(server):
    response = httpx.get(f"{server.http}/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}
    assert server.metric("conveyor_engine_alive") == 1


def test_engine_death_fails_in_flight_requests_and_the_engine_restarts(server):
    # the banner names the engine (the first one: an earlier test may have killed it since)
    assert re.search(r"engine pid (\d+)", server.output).group(1) == re.search(r"engine process (\d+) ready",
                                                                               server.output).group(1)
    pid = server.engine_pid
    restarts = server.metric("conveyor_engine_restarts_total")

    # a non-streaming request in flight as well
    results: list[httpx.Response] = []
    plain = threading.Thread(target=lambda: results.append(chat(server, max_tokens=400, ignore_eos=True)))
    body = {"messages": MESSAGES, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.http}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        received = events(response)
        for _ in range(3):
            next(received)
        # the engine stopped here: neither request can finish before it dies, however fast the device
        os.kill(pid, signal.SIGSTOP)
        plain.start()
        server.wait_for(lambda: server.metric("conveyor_num_requests_in_flight") == 2, timeout=30,
                        what="both requests in flight")
        os.kill(pid, signal.SIGKILL)
        rest = list(received)  # ends, or the client timeout fails the test
    plain.join(60)

    assert rest[-1] == "[DONE]"
    errors = [e for e in rest[:-1] if "error" in e]
    assert len(errors) == 1 and rest[-2] is errors[0]
    assert errors[0]["error"]["code"] == 503
    assert "engine" in errors[0]["error"]["message"]
    assert not any(c.get("finish_reason") for e in rest[:-1] if "choices" in e for c in e["choices"])

    assert len(results) == 1
    assert results[0].status_code == 503
    assert "engine" in results[0].json()["error"]["message"]

    # down until the new engine is ready (loading the model takes seconds)
    assert health(server) == 503
    assert server.metric("conveyor_engine_alive") == 0
    assert chat(server, max_tokens=2).status_code == 503
    server.wait_for(lambda: health(server) == 200, timeout=180, what="the engine to restart")

    response = chat(server, max_tokens=4, ignore_eos=True)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    assert server.metric("conveyor_engine_restarts_total") == restarts + 1
    assert server.metric("conveyor_engine_alive") == 1
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_stalled_engine_is_replaced_then_a_second_loss_is_one_too_many(tmp_path):
    """The engine stopped (SIGSTOP) with a stream in flight for longer than engine_timeout: the stream ends with
    a 503 naming the stall, the engine is killed and a new one serves. With max_engine_restarts = 1, the new
    engine's death within ten minutes is one too many: the server exits 1 and says so."""
    server = Server(http_config(engine_timeout=2.0, max_engine_restarts=1), tmp_path).start()
    try:
        stalled = server.engine_pid
        body = {"messages": MESSAGES, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.http}/v1/chat/completions", json=body, timeout=60) as response:
            received = events(response)
            next(received)
            os.kill(stalled, signal.SIGSTOP)
            rest = list(received)  # ends once the stall is noticed, or the client timeout fails the test
        errors = [e for e in rest[:-1] if "error" in e]
        assert len(errors) == 1 and errors[0]["error"]["code"] == 503, rest[-3:]
        assert "sent nothing for" in server.output
        server.wait_for(lambda: health(server) == 200 and server.engine_pid != stalled, timeout=180,
                        what="a new engine")
        assert chat(server, max_tokens=4, ignore_eos=True).json()["usage"]["completion_tokens"] == 4
        with pytest.raises(ProcessLookupError):
            os.kill(stalled, 0)

        os.kill(server.engine_pid, signal.SIGKILL)
        assert server.process.wait(60) == 1
        assert re.search(r"error: the engine process died 2 times in 600 s .*; giving up", server.output), server.output
    finally:
        server.stop()


def test_sigterm_lets_the_request_in_flight_finish(tmp_path):
    server = Server(http_config(drain_timeout=60.0), tmp_path).start()
    try:
        n = 30
        body = {"messages": MESSAGES, "max_tokens": n, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{server.http}/v1/chat/completions", json=body, timeout=120) as response:
            received = events(response)
            next(received)
            with server.paused_engine():  # the request cannot finish while the drain is checked
                server.process.send_signal(signal.SIGTERM)
                # draining: not ready for new work, new requests refused, the one in flight goes on
                server.wait_for(lambda: health(server) == 503, timeout=10, what="/health to report draining")
                refused = chat(server, max_tokens=2)
                assert refused.status_code == 503
                assert "shutting down" in refused.json()["error"]["message"]
            rest = list(received)
        assert rest[-1] == "[DONE]"
        finish_reasons = [c["finish_reason"] for e in rest[:-1] for c in e["choices"] if c["finish_reason"]]
        assert finish_reasons == ["length"]
        assert rest[-2]["usage"]["completion_tokens"] == n
        assert not any("error" in e for e in rest[:-1])
        assert server.process.wait(60) == 0
    finally:
        server.stop()


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie nobody reaped has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_an_engine_whose_frontend_is_killed_stops_by_itself(tmp_path):
    """A frontend killed with SIGKILL sends its engine no SHUTDOWN: the engine, mid-stream, must not live on."""
    server = Server(http_config(), tmp_path).start()
    engine = server.engine_pid
    try:
        body = {"messages": MESSAGES, "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.http}/v1/chat/completions", json=body, timeout=120) as response:
            next(events(response))
            server.process.kill()
            server.process.wait(30)
        server.wait_for(lambda: not running(engine), timeout=60, what="the engine to exit")
    finally:
        server.stop()
        if running(engine):
            os.kill(engine, signal.SIGKILL)


def engine_child(parent: int) -> int | None:
    """The pid of ``parent``'s engine process, once it has started one."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == parent and b"conveyor.engine.process" in cmdline:
            return int(stat.parent.name)
    return None


@contextlib.contextmanager
def engine_held_at_start(tmp_path: Path):
    """A server launched with its engine process stopped (SIGSTOP) from its first moments: (server, engine pid).
    On leaving, the engine goes on, the server stops, and an engine still left is killed."""
    server = Server(http_config(), tmp_path).launch()
    engine = None
    try:
        server.wait_for(lambda: engine_child(server.process.pid) is not None, timeout=60, what="the engine to start")
        engine = engine_child(server.process.pid)
        os.kill(engine, signal.SIGSTOP)
        yield server, engine
    finally:
        if engine is not None and running(engine):
            os.kill(engine, signal.SIGCONT)
        server.stop()
        if engine is not None and running(engine):
            os.kill(engine, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_an_engine_whose_frontend_is_killed_while_it_loads_stops_by_itself(tmp_path, sig):
    """Killed while its engine still starts (before the frontend handles signals), the frontend leaves its engine
    behind: the engine must still find that it is gone and stop, not hold the model's memory for good. It is held
    still (SIGSTOP) from its first moments until the frontend has exited, so it cannot have looked before."""
    with engine_held_at_start(tmp_path) as (server, engine):
        server.process.send_signal(sig)
        server.process.wait(30)
        assert not any(re.search(r"engine process \d+ ready", line) for line in server.lines), server.output
        os.kill(engine, signal.SIGCONT)
        server.wait_for(lambda: not running(engine), timeout=120, what="the engine to exit")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_models_are_listed_only_once_the_engine_is_up(tmp_path):
    """Scripts written for vLLM wait for /v1/models to answer before they send work: while the engine starts,
    it answers 503 naming why (as /health and completions do), then lists the model with its context length;
    `conveyor bench` waits for it. The engine is held still (SIGSTOP) until the HTTP server has answered."""
    with engine_held_at_start(tmp_path) as (server, engine):
        server.wait_for(lambda: any("(503 until it is ready)" in line for line in server.lines), timeout=60,
                        what="the HTTP server")
        http = re.search(r"\(503 until it is ready\): (http\S+)", server.output).group(1)
        starting = httpx.get(f"{http}/v1/models", timeout=5)
        assert starting.status_code == 503 and "starting" in starting.json()["error"]["message"]
        assert httpx.get(f"{http}/health", timeout=5).status_code == 503
        # `conveyor bench` asks which model is served: it gives up after its ready timeout, naming the 503 ...
        with pytest.raises(ValueError, match=r"not ready after 0 s \(503 the engine is starting\)"):
            anyio.run(served_model_of, http, 0.0)
        # ... and otherwise waits for the engine, however long it is held still
        found = []
        waiting = threading.Thread(target=lambda: found.append(anyio.run(served_model_of, http, 300.0)), daemon=True)
        waiting.start()
        time.sleep(2.0)
        assert waiting.is_alive() and not found
        os.kill(engine, signal.SIGCONT)
        server.wait_for(lambda: httpx.get(f"{http}/health", timeout=5).status_code == 200, timeout=120,
                        what="the engine")
        (model,) = httpx.get(f"{http}/v1/models", timeout=5).json()["data"]
        assert model["max_model_len"] > 0 and model["id"]
        waiting.join(timeout=60)
        assert found == [model["id"]]


async def served_model_of(url: str, ready_timeout: float) -> str:
    from conveyor.bench.load import served_model

    async with httpx.AsyncClient(timeout=5) as client:
        return await served_model(client, url, ready_timeout=ready_timeout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_worker_whose_engine_died_while_it_started_exits(tmp_path):
    """An engine process that dies while its worker still imports sends no parent-death signal (the worker has
    not asked for one yet), and the worker's new parent is another process: the worker must find that the
    engine named on its command line is gone, not wait for a config that never comes. Its stdin is held open
    here, and the engine exits as soon as the worker is spawned."""
    log = tmp_path / "worker.log"
    config_in, held = os.pipe()
    worker = None
    spawn = ("import os, subprocess, sys\n"
             "worker = subprocess.Popen([sys.executable, '-m', 'conveyor.worker.process', '--rank', '0', "
             "'--executor', 'tcp://127.0.0.1:9', '--init-method', 'tcp://127.0.0.1:9', '--parent', str(os.getpid())], "
             f"stdin={config_in}, stderr=open({str(log)!r}, 'w'))\n"
             "print(worker.pid, flush=True)\n"
             "os._exit(0)\n")
    try:
        worker = int(subprocess.run([sys.executable, "-c", spawn], pass_fds=(config_in,), check=True, timeout=60,
                                    capture_output=True, text=True).stdout)
        deadline = time.monotonic() + 60
        while running(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not running(worker), log.read_text()
        assert "the engine process" in log.read_text() and "is gone" in log.read_text()
    finally:
        os.close(config_in)
        os.close(held)
        if worker is not None and running(worker):
            os.kill(worker, signal.SIGKILL)


def test_sigterm_aborts_what_outlasts_drain_timeout(tmp_path):
    server = Server(http_config(drain_timeout=1.0), tmp_path).start()
    try:
        n = 400
        body = {"messages": MESSAGES, "max_tokens": n, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{server.http}/v1/chat/completions", json=body, timeout=120) as response:
            received = events(response)
            next(e for e in received if e["choices"] and e["choices"][0]["delta"].get("content"))  # it generates
            # stopped until the drain gives up on it: it outlasts drain_timeout however fast the device
            with server.paused_engine():
                server.process.send_signal(signal.SIGTERM)
                server.wait_for(lambda: any("aborting 1 requests" in line for line in server.lines), timeout=30,
                                what="the drain to give up and abort")
            rest = list(received)  # a broken connection would raise here
        # a clean end: the last choice says "abort", the usage follows, then [DONE]
        assert rest[-1] == "[DONE]"
        assert not any("error" in e for e in rest[:-1])
        finish_reasons = [c["finish_reason"] for e in rest[:-1] for c in e["choices"] if c["finish_reason"]]
        assert finish_reasons == ["abort"]
        generated = rest[-2]["usage"]["completion_tokens"]
        assert 0 < generated < n
        assert server.process.wait(60) == 0
    finally:
        server.stop()


def test_a_second_signal_aborts_the_requests_at_once_and_the_server_still_exits_cleanly(tmp_path):
    """Ctrl-C twice: the first starts a drain of up to 60 s, the second aborts the request still running at once;
    its stream ends cleanly (finish_reason abort, usage, [DONE]), a third is only noted, and the server exits 0
    without a traceback (the second was a KeyboardInterrupt: exit 130, a broken stream)."""
    server = Server(http_config(drain_timeout=60.0), tmp_path).start()
    try:
        body = {"messages": MESSAGES, "max_tokens": 400, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{server.http}/v1/chat/completions", json=body, timeout=120) as response:
            received = events(response)
            next(e for e in received if e["choices"] and e["choices"][0]["delta"].get("content"))
            with server.paused_engine():  # (the request cannot end by itself meanwhile)
                for expected in ("draining 1 requests", "again: aborting the 1 requests", "stopping already"):
                    server.process.send_signal(signal.SIGINT)
                    server.wait_for(lambda: any(expected in line for line in server.lines), timeout=30,
                                    what=expected)
            rest = list(received)
        assert rest[-1] == "[DONE]" and not any("error" in e for e in rest[:-1])
        assert [c["finish_reason"] for e in rest[:-1] for c in e["choices"] if c["finish_reason"]] == ["abort"]
        assert 0 < rest[-2]["usage"]["completion_tokens"] < 400
        assert server.process.wait(60) == 0
        assert not any("Traceback" in line for line in server.lines), server.output
    finally:
        server.stop()


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton runs on this machine")
def test_an_attention_backend_the_machine_cannot_run_stops_the_server_at_start():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "conveyor", "serve", "--set", "engine.attention=triton", "--set", "transport.0.port=0"],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, result.stderr
    assert re.fullmatch(r"error: .*\[engine\] attention = 'triton': the Triton kernels need a CUDA GPU .*"
                        r"TRITON_INTERPRET=1.*", errors[0]), errors[0]
    assert "Listening on" not in result.stdout and "loaded layer" not in result.stderr  # before any weight loads
