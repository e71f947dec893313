"""A worker of a split model dies under load: its requests end with 503, the engine restarts all its
workers, and no process is left behind."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest

from tests.server import Server, http_config
from tests.test_parallel import tiny_llama  # noqa: F401 - the fixture

pytestmark = pytest.mark.slow

NUM_STREAMS = 8


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def stream(server: Server, results: list) -> None:
    """One streaming completion; its events go to ``results`` (or its JSON error, where the engine never took it
    and so never opened the stream)."""
    body = {"prompt": "once upon a time", "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.http}/v1/completions", json=body, timeout=120) as response:
        if response.status_code != 200:
            results.append([json.loads(response.read())])
            return
        lines = (line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: "))
        results.append([json.loads(data) for data in lines if data != "[DONE]"])


def kill_a_worker_under_load(server: Server, rank: int) -> None:
    """Streams in flight, the workers held still (no step can finish, however fast the device), worker
    ``rank`` SIGKILLed: every stream ends with a 503 error and none finished; the engine comes back with new
    workers, serves again, and the old processes are gone."""
    engine, workers = server.engine_pid, server.worker_pids
    results: list = []
    threads = [threading.Thread(target=stream, args=(server, results)) for _ in range(NUM_STREAMS)]
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    try:
        for thread in threads:
            thread.start()
        server.wait_for(lambda: server.metric("conveyor_num_requests_in_flight") == NUM_STREAMS, timeout=60,
                        what="every stream in flight")
        os.kill(workers[rank], signal.SIGKILL)
    finally:
        for pid in workers:
            if pid != workers[rank]:
                os.kill(pid, signal.SIGCONT)
    for thread in threads:
        thread.join(120)
    assert len(results) == NUM_STREAMS
    for events in results:
        assert events and events[-1]["error"]["code"] == 503, events
        assert not any(c.get("finish_reason") for e in events if "choices" in e for c in e["choices"])
    server.wait_for(lambda: server.engine_pid != engine and server.worker_pids != workers
                    and httpx.get(f"{server.http}/health").status_code == 200, timeout=180,
                    what="the engine and its workers to restart")
    response = httpx.post(f"{server.http}/v1/completions", json={"prompt": "hello", "max_tokens": 4,
                                                                  "ignore_eos": True}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    assert server.metric("conveyor_engine_restarts_total") == 1
    assert gone(engine) and all(gone(pid) for pid in workers), "a process of the dead engine is left"


def serve_split(path, tmp, device: str = "auto", **parallel) -> Server:
    overrides = [f"model.path={path}", f"model.device={device}", "model.dtype=float32", "model.max_model_len=128",
                 "kvcache.memory_gb=0.05", "engine.num_threads=1", *(f"parallel.{k}={v}" for k, v in parallel.items())]
    return Server(http_config(), tmp, overrides=overrides).start()


def test_killing_a_tp_worker_fails_its_requests_and_the_engine_restarts(tiny_llama, tmp_path):  # noqa: F811
    server = serve_split(tiny_llama, tmp_path, tensor_parallel_size=2)
    try:
        kill_a_worker_under_load(server, rank=1)
        workers = server.worker_pids
    finally:
        assert server.stop() == 0, server.output
    assert all(gone(pid) for pid in workers), "a worker outlived the server"
