"""`conveyor bench` end to end: against a real Conveyor server, and against an endpoint that fails."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytestmark = pytest.mark.slow


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "conveyor", "bench", "--no-progress", *args],
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def server(default_server):
    return default_server  # (tests/conftest.py: one server with the default config for the whole suite)


def test_bench_against_conveyor(server, tmp_path):
    out = tmp_path / "run.json"
    ttft_before = server.metric("conveyor_time_to_first_token_seconds_count")
    generated_before = server.metric("conveyor_generation_tokens_total")
    queue_before = (server.metric("conveyor_request_queue_time_seconds_sum"),
                    server.metric("conveyor_request_queue_time_seconds_count"))
    result = bench("--url", server.http, "--dataset", "random", "--input-len", "48", "--output-len", "6",
                   "--range-ratio", "0.5", "--num-requests", "5", "--request-rate", "20", "--warmup", "0",
                   "--goodput", "ttft:60000", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "Output token throughput" in result.stdout and "TTFT" in result.stdout
    run = json.loads(out.read_text())
    records = run["requests"]
    assert len(records) == 5 and run["summary"]["completed"] == 5
    assert all(r["ttft"] <= r["e2e"] for r in records)
    # output tokens are what the server's usage reported: their sum is what its counter grew by
    generated = server.metric("conveyor_generation_tokens_total") - generated_before
    assert sum(r["output_tokens"] for r in records) == generated
    assert all(r["output_tokens"] >= 1 for r in records)
    assert server.metric("conveyor_time_to_first_token_seconds_count") - ttft_before == 5
    assert run["summary"]["goodput"] == pytest.approx(5 / run["summary"]["duration_s"])
    # the server view is what the server's queue-time histogram grew by over the run
    queue_sum = server.metric("conveyor_request_queue_time_seconds_sum") - queue_before[0]
    queue_count = server.metric("conveyor_request_queue_time_seconds_count") - queue_before[1]
    assert queue_count == 5
    assert run["server"]["queue_time_mean_ms"] == pytest.approx(1000 * queue_sum / queue_count)


class _Failing(BaseHTTPRequestHandler):
    """Answers /v1/models, then fails completions in turn: a 500, a stream cut short, and (if allowed) a good one."""

    counter = 0
    allow_success = False
    lock = threading.Lock()

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self._reply(200, {"object": "list", "data": [{"id": "broken", "object": "model"}]})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        with self.lock:
            kind = type(self).counter % (3 if self.allow_success else 2)
            type(self).counter += 1
        if kind == 0:
            self._reply(500, {"error": {"message": "the model caught fire", "type": "server_error"}})
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        chunk = {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}
        self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if kind == 2:
            usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
            self.wfile.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True  # kind 1: the stream ends without [DONE]

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture()
def failing_url():
    def serve(allow_success: bool):
        handler = type("Handler", (_Failing,), {"counter": 0, "allow_success": allow_success})
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}"

    servers: list[ThreadingHTTPServer] = []
    yield serve
    for httpd in servers:
        httpd.shutdown()


def test_every_request_failing_exits_non_zero(failing_url, tmp_path):
    out = tmp_path / "failed.json"
    result = bench("--url", failing_url(False), "--dataset", "random", "--input-len", "8", "--num-requests", "4",
                   "--warmup", "0", "--json", str(out))
    assert result.returncode == 1
    assert "every request failed" in result.stderr
    run = json.loads(out.read_text())
    assert (run["summary"]["completed"], run["summary"]["failed"]) == (0, 4)
    errors = [r["error"] for r in run["requests"]]
    assert errors.count("HTTP 500: the model caught fire") == 2
    assert errors.count("the stream ended before [DONE]") == 2
    assert "error: HTTP 500: the model caught fire" in result.stdout


def test_some_failures_are_counted_not_dropped(failing_url, tmp_path):
    out = tmp_path / "mixed.json"
    result = bench("--url", failing_url(True), "--dataset", "random", "--input-len", "8", "--num-requests", "6",
                   "--warmup", "0", "--max-concurrency", "1", "--json", str(out))
    assert result.returncode == 0, result.stderr
    run = json.loads(out.read_text())
    assert len(run["requests"]) == 6
    assert (run["summary"]["completed"], run["summary"]["failed"]) == (2, 4)
    assert run["summary"]["output_tokens"] == 2


def test_a_sweep_with_latencies_without_samples_is_saved_tabled_and_plotted(failing_url, tmp_path):
    """At each of the two rates, three requests in turn: a 500, a stream cut short, and one that streams a single
    chunk: a TTFT but no gap between tokens, so no ITL sample at all (as with --output-len 1)."""
    out = tmp_path / "sweep.json"
    result = bench("--url", failing_url(True), "--dataset", "random", "--input-len", "8", "--num-requests", "3",
                   "--warmup", "0", "--max-concurrency", "1", "--sweep", "50,inf", "--json", str(out))
    assert result.returncode == 0, result.stderr
    runs = json.loads(out.read_text())["runs"]
    assert [(run["summary"]["completed"], run["summary"]["failed"]) for run in runs] == [(1, 2), (1, 2)]
    assert all(run["summary"]["itl_ms"]["p50"] is None and run["summary"]["ttft_ms"]["p50"] > 0 for run in runs)
    rows = [line.split() for line in result.stdout.splitlines() if line.split()[:1] in (["50"], ["inf"])]
    assert [row[7:9] for row in rows] == [["-", "-"], ["-", "-"]]  # ITL P50, P99
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
