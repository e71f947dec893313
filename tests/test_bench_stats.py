"""The benchmark's statistics and arrival process against hand-computed values and the gamma distribution; its
tables and plot for latencies with no samples; the load generator against a server that streams malformed
events."""

from __future__ import annotations

import argparse
import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import numpy as np
import pytest

from conveyor.bench import command, report
from conveyor.bench.arrivals import arrival_gaps, arrival_times
from conveyor.bench.command import _server_view
from conveyor.bench.load import BenchRequest, LoadOptions, run_load
from conveyor.bench.parallel import parallel_view
from conveyor.bench.report import run_table
from conveyor.bench.stats import RequestRecord, meets_slos, percentiles, summarize
from conveyor.messages import KVCacheStats, SchedulerStats, StepStats
from conveyor.perf.readings import metric_samples
from conveyor.serving.metrics import ServerMetrics


def test_percentiles_interpolate_linearly():
    stats = percentiles([4.0, 1.0, 3.0, 2.0])
    assert stats["mean"] == 2.5
    assert stats["p50"] == pytest.approx(2.5)
    # rank 0.9 x 3 = 2.7: 3 + 0.7 x (4 - 3)
    assert stats["p90"] == pytest.approx(3.7)
    assert stats["p99"] == pytest.approx(3.97)
    assert math.isnan(percentiles([])["p50"])


def test_tpot_excludes_the_first_token():
    record = RequestRecord(0, prompt_tokens=10, output_tokens=5, ttft=0.5, e2e=2.5)
    assert record.tpot == pytest.approx((2.5 - 0.5) / 4)
    assert RequestRecord(1, 10, output_tokens=1, ttft=0.5, e2e=0.5).tpot is None


def test_summary_by_hand():
    records = [
        RequestRecord(0, 10, output_tokens=3, start=0.0, ttft=0.1, e2e=0.5, itl=[0.2, 0.2]),
        RequestRecord(1, 20, output_tokens=5, start=0.1, ttft=0.3, e2e=1.1, itl=[0.1, 0.3, 0.2, 0.2]),
        RequestRecord(2, 30, error="HTTP 500: boom"),
    ]
    s = summarize(records, duration=2.0, slos_ms={"ttft": 200})
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["output_tokens"] == 8 and s["prompt_tokens"] == 30
    assert s["output_throughput"] == pytest.approx(4.0)
    assert s["total_token_throughput"] == pytest.approx(19.0)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    # TPOT: (0.5 - 0.1) / 2 = 0.2 and (1.1 - 0.3) / 4 = 0.2
    assert s["tpot_ms"]["p50"] == pytest.approx(200.0)
    # ITL pools every gap: [0.2, 0.2, 0.1, 0.3, 0.2, 0.2]
    assert s["itl_ms"]["mean"] == pytest.approx(200.0)
    assert s["itl_ms"]["p99"] == pytest.approx(1000 * float(np.percentile([0.2, 0.2, 0.1, 0.3, 0.2, 0.2], 99)))
    # only request 0 has TTFT <= 200 ms; the failed one never counts
    assert s["goodput"] == pytest.approx(0.5)
    assert s["errors"] == ["HTTP 500: boom"]


def test_goodput_checks_every_slo():
    record = RequestRecord(0, 10, output_tokens=11, ttft=0.1, e2e=1.1)  # TPOT 100 ms
    assert meets_slos(record, {"ttft": 100, "tpot": 100})
    assert not meets_slos(record, {"ttft": 100, "tpot": 99})
    assert not meets_slos(record, {"e2e": 1000})
    # itl: the P99 of the request's own gaps (nearest rank): one slow gap in 100 passes, two do not
    gaps = [0.05] * 98 + [0.5, 0.05]
    assert meets_slos(RequestRecord(0, 10, output_tokens=101, ttft=0.1, e2e=6.0, itl=gaps), {"itl": 60})
    gaps[0] = 0.5
    assert not meets_slos(RequestRecord(0, 10, output_tokens=101, ttft=0.1, e2e=6.0, itl=gaps), {"itl": 60})


@pytest.mark.parametrize("rate", [0.5, 4.0, 50.0])
def test_mean_arrival_rate(rate):
    gaps = arrival_gaps(10_000, rate, seed=7)
    assert 1 / gaps.mean() == pytest.approx(rate, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_burstiness_sets_the_gamma_variance(burstiness):
    rate = 2.0
    gaps = arrival_gaps(10_000, rate, burstiness, seed=3)
    # gamma(shape=b, scale=1/(rate b)): variance 1 / (rate^2 b), coefficient of variation 1/sqrt(b)
    assert gaps.var() == pytest.approx(1 / (rate**2 * burstiness), rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_infinite_rate_sends_everything_at_once():
    assert not arrival_times(100, math.inf).any()
    times = arrival_times(100, 3.0, seed=1)
    assert (np.diff(times) >= 0).all()
    assert arrival_times(0, 3.0).size == 0
    with pytest.raises(ValueError, match="rate"):
        arrival_gaps(3, 0.0)


def test_the_first_request_goes_at_once_and_the_gaps_follow():
    """As vLLM's benchmark sends them: the first request at the start, then one gap before each next one."""
    times = arrival_times(100, 3.0, seed=1)
    assert times.size == 100 and times[0] == 0.0
    assert np.diff(times) == pytest.approx(arrival_gaps(99, 3.0, seed=1))


# ---------------------------------------------------------------- the server's parallel metrics over a run

# two engine replicas of TP 2; replica 1 had run no multi-worker step when the run started
BEFORE = """
# TYPE conveyor_step_comm_seconds histogram
conveyor_step_comm_seconds_count{model_name="m"} 100
conveyor_step_comm_seconds_sum{model_name="m"} 0.5
# TYPE conveyor_step_compute_seconds histogram
conveyor_step_compute_seconds_count{model_name="m"} 100
conveyor_step_compute_seconds_sum{model_name="m"} 2.0
# TYPE conveyor_step_bubble_fraction histogram
conveyor_step_bubble_fraction_count{model_name="m"} 100
conveyor_step_bubble_fraction_sum{model_name="m"} 10.0
# TYPE conveyor_worker_step_seconds histogram
conveyor_worker_step_seconds_count{model_name="m",replica="0",rank="0"} 50
conveyor_worker_step_seconds_sum{model_name="m",replica="0",rank="0"} 1.0
conveyor_worker_step_seconds_count{model_name="m",replica="0",rank="1"} 50
conveyor_worker_step_seconds_sum{model_name="m",replica="0",rank="1"} 1.0
# TYPE conveyor_request_queue_time_seconds histogram
conveyor_request_queue_time_seconds_count{model_name="m"} 3
conveyor_request_queue_time_seconds_sum{model_name="m"} 0.3
"""
AFTER = """
# TYPE conveyor_step_comm_seconds histogram
conveyor_step_comm_seconds_count{model_name="m"} 300
conveyor_step_comm_seconds_sum{model_name="m"} 0.8
# TYPE conveyor_step_compute_seconds histogram
conveyor_step_compute_seconds_count{model_name="m"} 300
conveyor_step_compute_seconds_sum{model_name="m"} 3.7
# TYPE conveyor_step_bubble_fraction histogram
conveyor_step_bubble_fraction_count{model_name="m"} 300
conveyor_step_bubble_fraction_sum{model_name="m"} 70.0
# TYPE conveyor_worker_step_seconds histogram
conveyor_worker_step_seconds_count{model_name="m",replica="0",rank="0"} 150
conveyor_worker_step_seconds_sum{model_name="m",replica="0",rank="0"} 2.0
conveyor_worker_step_seconds_count{model_name="m",replica="0",rank="1"} 150
conveyor_worker_step_seconds_sum{model_name="m",replica="0",rank="1"} 2.4
conveyor_worker_step_seconds_count{model_name="m",replica="1",rank="0"} 100
conveyor_worker_step_seconds_sum{model_name="m",replica="1",rank="0"} 1.2
conveyor_worker_step_seconds_count{model_name="m",replica="1",rank="1"} 100
conveyor_worker_step_seconds_sum{model_name="m",replica="1",rank="1"} 1.0
# TYPE conveyor_request_queue_time_seconds histogram
conveyor_request_queue_time_seconds_count{model_name="m"} 9
conveyor_request_queue_time_seconds_sum{model_name="m"} 0.9
"""


def test_parallel_view_by_hand():
    view = parallel_view(list(metric_samples(BEFORE)), list(metric_samples(AFTER)))
    assert view is not None
    assert view["steps"] == 200
    # comm: 0.3 s over 200 steps; compute: 1.7 s over 200 steps; comm share 1.5 / (1.5 + 8.5)
    assert view["comm_ms"] == pytest.approx(1.5)
    assert view["compute_ms"] == pytest.approx(8.5)
    assert view["comm_share"] == pytest.approx(0.15)
    # rank 0: (1.0 + 1.2) s over (100 + 100) steps; rank 1: (1.4 + 1.0) s over (100 + 100) steps
    assert view["rank_step_ms"] == pytest.approx({"0": 11.0, "1": 12.0})
    assert list(view["rank_step_ms"]) == ["0", "1"]
    # 60 over 200 steps
    assert view["bubble_fraction"] == pytest.approx(0.3)


def test_the_server_view_of_a_run_carries_the_parallel_numbers():
    view = _server_view(list(metric_samples(BEFORE)), list(metric_samples(AFTER)))
    assert view["queue_time_mean_ms"] == pytest.approx(100.0)  # 0.6 s over 6 requests
    assert view["parallel"] == parallel_view(list(metric_samples(BEFORE)), list(metric_samples(AFTER)))
    assert "parallel" not in _server_view(list(metric_samples(AFTER)), list(metric_samples(AFTER)))  # no steps


def test_no_parallel_view_without_multi_worker_steps():
    single = ServerMetrics("m")
    single.engine_step(StepStats(1, 0.0, SchedulerStats(), KVCacheStats(), num_decode_tokens=1, forward_time=0.01))
    text = single.render(True, 0).decode()
    assert "conveyor_step_comm_seconds" in text  # the families are there, without samples
    assert parallel_view(list(metric_samples(text)), list(metric_samples(text))) is None
    assert parallel_view([], []) is None  # a server without /metrics
    assert parallel_view(list(metric_samples(AFTER)), list(metric_samples(AFTER))) is None  # no step in the run


def test_parallel_view_reads_what_the_server_exports():
    metrics = ServerMetrics("m")

    def step(rank_times: list[float], comm: float, bubble: float) -> None:
        metrics.engine_step(StepStats(1, 0.0, SchedulerStats(), KVCacheStats(), num_decode_tokens=2,
                                      rank_times=rank_times, comm_time=comm, bubble_fraction=bubble))

    step([0.5, 0.5], comm=0.25, bubble=0.0)  # before the run
    before = list(metric_samples(metrics.render(True, 0).decode()))
    step([0.010, 0.030], comm=0.004, bubble=0.5)  # compute 20 ms x 0.5 - 4 ms = 6 ms
    step([0.020, 0.020], comm=0.002, bubble=0.0)  # compute 18 ms
    view = parallel_view(before, list(metric_samples(metrics.render(True, 0).decode())))
    assert view is not None and view["steps"] == 2
    assert view["comm_ms"] == pytest.approx(3.0) and view["compute_ms"] == pytest.approx(12.0)
    assert view["comm_share"] == pytest.approx(0.2)
    assert view["rank_step_ms"] == pytest.approx({"0": 15.0, "1": 25.0})
    assert view["bubble_fraction"] == pytest.approx(0.25)


def test_the_report_has_a_parallel_section_only_with_its_numbers():
    records = [RequestRecord(0, 10, output_tokens=3, ttft=0.1, e2e=0.5, itl=[0.2, 0.2])]
    run = {"config": {"rate": 1.0}, "summary": summarize(records, 1.0), "server": {}}
    assert "Parallel" not in run_table(run)
    run["server"]["parallel"] = parallel_view(list(metric_samples(BEFORE)), list(metric_samples(AFTER)))
    section = run_table(run).split("Parallel", 1)[1]
    assert "200 steps" in section
    assert "1.50 / 8.50  (comm 15.0%)" in section
    assert "0: 11.0  1: 12.0" in section
    assert "30.0%" in section


def sweep_with_empty_latencies() -> dict:
    """A sweep as `conveyor bench --sweep 2,inf` keeps it: at 2 req/s each request got one token (a TTFT, no gaps
    between tokens: no ITL at all), at inf every request failed (no latency has a sample)."""
    one_token = [RequestRecord(0, 10, output_tokens=1, ttft=0.1, e2e=0.1), RequestRecord(1, 10, output_tokens=1,
                                                                                        ttft=0.3, e2e=0.3)]
    failed = [RequestRecord(0, 10, error="HTTP 500: boom"), RequestRecord(1, 10, error="HTTP 500: boom")]
    runs = [{"label": "x", "config": {"rate": rate}, "summary": summarize(records, 1.0), "server": {}}
            for rate, records in ((2.0, one_token), (math.inf, failed))]
    return {"label": "x", "config": {}, "runs": runs}


def test_the_plot_leaves_out_latencies_with_no_samples(tmp_path):
    path = report.plot([sweep_with_empty_latencies()], tmp_path / "sweep.png")
    assert path.read_bytes().startswith(b"\x89PNG")
    _, ttft, itl = report.figure([sweep_with_empty_latencies()]).axes
    # TTFT: only the run at 2 req/s (x = 0) has samples; P50 200 ms, P99 298 ms, on a log axis
    assert [(list(line.get_xdata()), list(line.get_ydata())) for line in ttft.lines] == [
        ([0], [pytest.approx(200.0)]), ([0], [pytest.approx(298.0)])]
    assert ttft.get_yscale() == "log"
    assert len(itl.lines) == 0 and [t.get_text() for t in itl.texts] == ["no samples"]
    assert itl.get_yscale() == "linear"


def test_compare_marks_latencies_with_no_samples(tmp_path, capsys):
    """As saved by --json, a latency with no samples is null; compare prints "-" for it, and plots the rest."""
    path = tmp_path / "sweep.json"
    path.write_bytes(msgspec.json.encode(sweep_with_empty_latencies()))
    assert json.loads(path.read_text())["runs"][1]["summary"]["ttft_ms"]["p50"] is None
    assert command.compare([str(path)], str(tmp_path / "compare.png")) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[1].split() == ["rate", "ok", "failed", "req/s", "out", "tok/s", "TTFT", "P50", "TTFT", "P99",
                                "ITL", "P50", "ITL", "P99", "E2E", "P50"]
    assert table[2].split() == ["2", "2", "0", "2.00", "2.0", "200", "298", "-", "-", "200"]
    assert table[3].split() == ["inf", "0", "2", "0.00", "0.0", "-", "-", "-", "-", "-"]
    # (the header's columns line up with the cells)
    assert len(table[2]) == len(table[1]) == len(table[3])
    assert (tmp_path / "compare.png").read_bytes().startswith(b"\x89PNG")


def test_run_table_marks_latencies_with_no_samples():
    run = sweep_with_empty_latencies()["runs"][0]
    rows = {line[:12].strip(): line[12:].split() for line in run_table(run).splitlines()}
    assert rows["ITL"] == rows["TPOT"] == ["-"] * 5
    assert rows["TTFT"] == ["200.0", "200.0", "280.0", "290.0", "298.0"]


def test_the_results_are_saved_before_the_plot(tmp_path, monkeypatch):
    """`conveyor bench --sweep ... --json OUT` whose plot fails: the runs measured are in OUT all the same."""
    async def measured(*args):
        return sweep_with_empty_latencies()

    def broken_plot(*args, **kwargs):
        raise RuntimeError("the plot failed")

    monkeypatch.setattr(command, "build_workload", lambda *args: [])
    monkeypatch.setattr(command, "_run_all", measured)
    monkeypatch.setattr(report, "plot", broken_plot)
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    out = tmp_path / "sweep.json"
    args = parser.parse_args(["--url", "http://127.0.0.1:1", "--sweep", "2,inf", "--warmup", "0", "--json", str(out)])
    with pytest.raises(RuntimeError, match="the plot failed"):
        command.main(args)
    saved = json.loads(out.read_text())
    assert [run["summary"]["completed"] for run in saved["runs"]] == [2, 0]


class _Streams(BaseHTTPRequestHandler):
    """Streams two content chunks; then, for the prompt "bad", the event ``bad`` instead of the usage; then [DONE]."""

    bad = b""

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        prompt = json.loads(self.rfile.read(int(self.headers["content-length"])))["prompt"]
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        chunk = b'data: {"choices": [{"index": 0, "text": "hi"}]}\n\n'
        usage = b'data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2}}\n\n'
        self.wfile.write(chunk + chunk + (b"data: " + self.bad + b"\n\n" if prompt == "bad" else usage))
        self.wfile.write(b"data: [DONE]\n\n")
        self.close_connection = True


@pytest.mark.parametrize(("event", "reason"), [
    (b"[1, 2]", "Expected `object`, got `array`"),
    (b'"done"', "Expected `object`, got `str`"),
    (b"7", "Expected `object`, got `int`"),
    (b'{"usage": {"prompt_tokens": 7, "completion_tokens": null}}',
     "Expected `int`, got `null` - at `$.usage.completion_tokens`"),
    (b'{"choices": [null]}', "Expected `object`, got `null` - at `$.choices[0]`"),
    (b'{"choices": [{"delta": "hi"}]}', "Expected `object | null`, got `str` - at `$.choices[0].delta`"),
    (b"{not json", "JSON is malformed"),
])
async def test_a_malformed_stream_event_fails_its_request_only(event, reason):
    handler = type("Handler", (_Streams,), {"bad": event})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        requests = [BenchRequest(None, prompt, 3, 2) for prompt in ("good", "bad", "good")]
        records, _ = await run_load(f"http://127.0.0.1:{httpd.server_address[1]}", "m", requests,
                                    LoadOptions(max_concurrency=1))
    finally:
        httpd.shutdown()
    good_first, bad, good_last = records
    assert bad.error is not None and reason in bad.error, bad.error
    assert event.decode() in bad.error  # (the event itself, to see what the server sent)
    assert bad.output_tokens == 0 and bad.e2e is None
    for record in (good_first, good_last):
        assert record.error is None and (record.output_tokens, record.prompt_tokens) == (2, 7)
