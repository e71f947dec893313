"""`conveyor bench` against a real two-stage pipeline: the report's "Parallel" section is what the server's
histograms grew by over the run."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tests.server import Server, http_config

pytestmark = pytest.mark.slow

HISTOGRAMS = ("conveyor_step_comm_seconds", "conveyor_step_compute_seconds", "conveyor_step_bubble_fraction")


def bench(url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "conveyor", "bench", "--no-progress", "--url", url, "--dataset",
                           "random", "--warmup", "0", *args], capture_output=True, text=True, timeout=300, check=False)


def test_bench_reports_the_pipelines_comm_compute_and_bubbles(tmp_path):
    server = Server(http_config(), tmp_path, overrides=["parallel.pipeline_parallel_size=2"]).start()
    try:
        def histogram(name: str, **labels: str) -> tuple[float, float]:
            return server.metric(f"{name}_sum", **labels), server.metric(f"{name}_count", **labels)

        # one request first, so that the histograms have samples when the run starts
        warmup = httpx.post(f"{server.http}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=120)
        assert warmup.status_code == 200, warmup.text
        before = {name: histogram(name) for name in HISTOGRAMS}
        ranks_before = {rank: histogram("conveyor_worker_step_seconds", rank=rank) for rank in ("0", "1")}
        out = tmp_path / "run.json"
        result = bench(server.http, "--input-len", "48", "--output-len", "6", "--num-requests", "4",
                       "--request-rate", "20", "--json", str(out))
        assert result.returncode == 0, result.stderr
        growth = {name: [a - b for a, b in zip(histogram(name), start)] for name, start in before.items()}
        rank_growth = {rank: [a - b for a, b in zip(histogram("conveyor_worker_step_seconds", rank=rank), start)]
                       for rank, start in ranks_before.items()}
    finally:
        server.stop()
    assert "Parallel (from the server" in result.stdout and "Pipeline bubble fraction" in result.stdout
    view = json.loads(out.read_text())["server"]["parallel"]
    steps = growth["conveyor_step_comm_seconds"][1]
    assert view["steps"] == steps > 0
    assert view["comm_ms"] == pytest.approx(1000 * growth["conveyor_step_comm_seconds"][0] / steps)
    assert view["compute_ms"] == pytest.approx(1000 * growth["conveyor_step_compute_seconds"][0] / steps)
    assert view["bubble_fraction"] == pytest.approx(growth["conveyor_step_bubble_fraction"][0] / steps)
    assert 0 < view["comm_share"] < 1
    assert view["rank_step_ms"] == pytest.approx({rank: 1000 * s / n for rank, (s, n) in rank_growth.items()})
