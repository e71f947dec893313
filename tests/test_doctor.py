"""``conveyor doctor`` against real servers driven into each regime of the checklist: it names the regime, with
the evidence that shows it and the config key to change first. Two servers, two regimes each."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from dataclasses import asdict
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anyio
import httpx
import pytest
import torch

import conveyor.bench.doctor
from conveyor.bench.doctor import examine, timed_readings
from conveyor.entrypoints.cli import main
from conveyor.perf.checklist import checklist, diagnose
from conveyor.perf.readings import quantile, read_metrics
from tests.helpers import save_tiny_model_with_smollm2_vocab
from tests.server import Server, http_config
from tests.test_parallel import tiny_llama  # noqa: F401 - a fixture
from tests.test_parallel_faults import serve_split

pytestmark = pytest.mark.slow

SHORT = [{"role": "user", "content": "Tell me a long story about a dragon."}]


def long_prompt(i: int) -> list:
    """About 1,200 prompt tokens, different from the first token on (the prefix cache cannot serve it)."""
    return [{"role": "user", "content": f"{i} Summarize: " + f"The river {i} ran past the old mill. " * 110}]


async def one(client: httpx.AsyncClient, messages: list, max_tokens: int, **extra) -> None:
    await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": max_tokens,
                                                    "ignore_eos": True, **extra})


async def diagnose_under(server: Server, ready, seconds: float, *loads, cli: bool = False) -> dict:
    """Start the loads (coroutine functions of a client), wait until ``ready(server)``, read /metrics for
    ``seconds`` (through ``conveyor doctor --json`` where ``cli``), then cancel the loads (their clients leave, so
    the server aborts what is left). Returns the diagnosis as the command's JSON has it."""
    async with httpx.AsyncClient(base_url=server.http, timeout=300,
                                 limits=httpx.Limits(max_connections=100)) as client, anyio.create_task_group() as tg:
        for load in loads:
            tg.start_soon(load, client)
        with anyio.fail_after(120):
            while not ready(server):
                await anyio.sleep(0.2)
        if cli:
            done = await anyio.run_process([sys.executable, "-m", "conveyor", "doctor", server.http,
                                            "--interval", str(seconds), "--json"])
            diagnosis = json.loads(done.stdout)
        else:
            diagnosis = asdict(await anyio.to_thread.run_sync(examine, server.http, seconds))
        tg.cancel_scope.cancel()
    server.wait_for(lambda: server.metric("conveyor_num_requests_in_flight") == 0, what="the loads to end")
    return diagnosis


def many(count: int, messages: list, max_tokens: int | tuple[int, ...], **extra):
    """``count`` requests at once; a tuple of ``max_tokens`` is taken in turn."""
    lengths = max_tokens if isinstance(max_tokens, tuple) else (max_tokens,)

    async def load(client: httpx.AsyncClient) -> None:
        async with anyio.create_task_group() as tg:
            for i in range(count):
                tg.start_soon(partial(one, client, messages, lengths[i % len(lengths)], **extra))
    return load


def test_a_small_kv_cache_and_a_small_batch(tmp_path):
    """max_num_seqs = 2 and a KV cache of 14 blocks of 16 tokens. Two requests of 140 tokens fit one at a time:
    read from before they arrive, the window sees a preemption, and the verdict is KV capacity. Then 120 short
    requests at once (more than a fast device finishes in the window; the rest are cancelled): two run, the rest
    wait, the cache has room and compute idles, so the verdict is a batch too small. (Of two lengths, so that the
    two running rarely end in one step: a pair that did left the batch empty for the next pair's prompt step, which
    the window read often enough to call the batch not held at its cap once decodes got fast.)"""
    server = Server(http_config() + "\n[scheduler]\nmax_num_seqs = 2\nmax_waiting = 128\n"
                    "\n[kvcache]\nnum_blocks = 14\nblock_size = 16\n", tmp_path).start()
    try:
        kv = anyio.run(diagnose_under, server, lambda s: True, 5.0, many(2, SHORT, 140))
        assert kv["verdict"] == "kv_capacity", kv["window"]
        finding = kv["findings"][0]
        assert finding["evidence"]["preemptions"] > 0 and finding["change"] == "kvcache.memory_gb"

        small = anyio.run(diagnose_under, server, lambda s: s.metric("conveyor_num_requests_waiting") >= 5, 3.0,
                          many(120, SHORT, (24, 29)))
        assert small["verdict"] == "batch_too_small", small["window"]
        finding = small["findings"][0]
        assert finding["evidence"]["running_max"] == 2 and finding["evidence"]["waiting_mean"] >= 1
        assert finding["change"] == "scheduler.max_num_seqs"
    finally:
        assert server.stop() == 0, server.output


def test_long_prompts_among_decodes_and_a_flood(tmp_path):
    """max_num_seqs = 16. Six decoding requests while a prompt of about 1,200 tokens arrives every half second:
    most steps decode alone, the few that carry a 512-token chunk are many times slower, so the verdict is prefill
    interference (ITL P99 over 3x P50). Then 120 long requests at once: 16 run, the rest wait, and the verdict is
    queueing, with the doctor's JSON from the command line."""
    server = Server(http_config() + "\n[scheduler]\nmax_num_seqs = 16\nmax_waiting = 128\n"
                    "max_num_batched_tokens = 512\n", tmp_path).start()
    try:
        async def prompts(client: httpx.AsyncClient) -> None:
            for i in range(1000):
                await one(client, long_prompt(i), 1)
                await anyio.sleep(0.5)

        def decoding(s: Server) -> bool:
            return s.metric("conveyor_num_requests_running") >= 6

        mixed = anyio.run(diagnose_under, server, decoding, 4.0, many(6, SHORT, 2000), prompts)
        window = mixed["window"]
        assert window["prompt_tokens"] > 1000 and window["itl_count"] >= 20, window
        if torch.cuda.is_available():
            # (a 512-token chunk of a 135M model costs about one launch-bound decode step on a GPU: the spread
            # the verdict needs is not there to find; test_every_regime_at_its_threshold holds the rule)
            assert window["itl_p99_s"] >= window["itl_p50_s"] > 0, window
        else:
            assert mixed["verdict"] == "prefill_interference", window
            finding = mixed["findings"][0]
            assert finding["evidence"]["itl_p99_s"] > 3 * finding["evidence"]["itl_p50_s"] > 0
            assert finding["change"] == "scheduler.max_num_batched_tokens"

        # (2,000 tokens each: the queue outlasts the command's start-up and its window on any device)
        flood = anyio.run(partial(diagnose_under, cli=True), server,
                          lambda s: s.metric("conveyor_num_requests_waiting") >= 20, 3.0, many(120, SHORT, 2000))
        window = flood["window"]
        assert window["waiting_mean"] >= 10 and window["running_mean"] >= 8, window
        finding = flood["findings"][0]
        if torch.cuda.is_available() and finding["regime"] == "host_overhead":
            # (16 decodes of a 135M model take a few ms on a GPU: the host's share of the step is named before the
            # queue, its change a larger batch; test_regimes_in_order holds that order)
            assert finding["evidence"]["host_fraction"] >= 0.4, window
        else:
            assert flood["verdict"] == "queueing", window
            assert finding["evidence"]["waiting_mean"] >= 10 and finding["evidence"]["running_mean"] >= 8
            assert finding["change"] == "parallel.data_parallel_size"
    finally:
        assert server.stop() == 0, server.output


async def completions_until_cancelled(client: httpx.AsyncClient) -> None:
    """Completions of 100 tokens, one after another, for as long as the load runs."""
    while True:
        await client.post("/v1/completions", json={"prompt": "once upon a time", "max_tokens": 100,
                                                   "ignore_eos": True})


def test_tensor_and_pipeline_parallel_workers(tiny_llama, tmp_path):  # noqa: F811
    """A tiny Llama over four worker processes: two per pipeline stage (heads, MLP and vocabulary split), two
    stages. Eight streams: every layer's two all-reduces (gloo here) outweigh a half of a tiny layer's matmuls,
    so the verdict is communication-bound, with the collectives counted (two per layer of the stage, and one for
    the vocabulary: the first stage's embedding all-reduced, the last one's logits gathered). Then one stream:
    one batch at a time passes the two stages in turn, so each waits for the other, and the pipeline's bubbles
    are named."""
    # (on this machine's cores over gloo, whatever devices it has: the regimes come from the split, not the device)
    server = serve_split(tiny_llama, tmp_path, device="cpu", tensor_parallel_size=2, pipeline_parallel_size=2)
    try:
        def running(n: int):
            return lambda s: s.metric("conveyor_num_requests_running") >= n

        loaded = anyio.run(diagnose_under, server, running(4), 3.0, *[completions_until_cancelled] * 8)
        assert loaded["verdict"] == "communication_bound", loaded["window"]
        finding = loaded["findings"][0]
        evidence = finding["evidence"]
        print("eight streams:", [f["regime"] for f in loaded["findings"]], evidence)
        assert evidence["comm_share"] >= 0.3 and evidence["tensor_parallel_size"] == 2, evidence
        assert evidence["collectives_per_step"] == 5 and evidence["collective_mb_per_step"] > 0, evidence
        assert finding["change"] == "parallel.tensor_parallel_size"

        alone = anyio.run(diagnose_under, server, running(1), 3.0, completions_until_cancelled)
        bubbles = {f["regime"]: f for f in alone["findings"]}.get("pipeline_bubbles")
        assert bubbles is not None, alone["window"]
        print("one stream:", [f["regime"] for f in alone["findings"]], bubbles["evidence"])
        assert bubbles["evidence"]["bubble_fraction"] >= 0.25 and bubbles["evidence"]["pipeline_parallel_size"] == 2
        assert bubbles["change"] == "parallel.pipeline_parallel_size"
    finally:
        assert server.stop() == 0, server.output


@pytest.fixture(scope="module")
def no_compute_model(tmp_path_factory, tokenizer) -> str:
    """A stand-in for a model whose forward pass costs next to nothing: one layer 32 wide, SmolLM2's 49,152-token
    vocabulary (so sampling, outside the forward pass, is most of a step)."""
    path = tmp_path_factory.mktemp("no_compute")
    save_tiny_model_with_smollm2_vocab(path, tokenizer, max_position_embeddings=4096)
    return str(path)


def test_a_model_with_no_compute_is_host_bound(no_compute_model, tmp_path):
    """Sixteen streams on the stand-in model, each asking for 20 alternatives' logprobs under a presence penalty:
    the steps' time goes to sampling, scheduling and recording, not the forward pass, so the verdict is host
    overhead, each stage's share in the evidence."""
    # (on the CPU: there the per-token extras over a 49k vocabulary outweigh the one tiny layer on any machine)
    server = Server(http_config(), tmp_path, overrides=[f"model.path={no_compute_model}", "model.device=cpu",
                                                        "model.dtype=float32",
                                                        "model.max_model_len=4096"]).start()
    try:
        host = anyio.run(diagnose_under, server, lambda s: s.metric("conveyor_num_requests_running") >= 16, 3.0,
                         many(16, SHORT, 4000, logprobs=True, top_logprobs=20, presence_penalty=0.5))
        assert host["verdict"] == "host_overhead", host["window"]
        evidence = host["findings"][0]["evidence"]
        print("no compute:", [f["regime"] for f in host["findings"]], evidence)
        assert evidence["host_fraction"] >= 0.4
        assert evidence["host_fraction"] == pytest.approx(
            evidence["schedule_fraction"] + evidence["sample_fraction"] + evidence["update_fraction"], abs=1e-3)
        assert host["findings"][0]["change"] == "scheduler.max_num_seqs"
    finally:
        assert server.stop() == 0, server.output


class _Clock:
    """time.monotonic and time.sleep for the doctor: a sleep moves the clock on by its seconds, a /metrics request
    by 0.05 s (the request's own time)."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_the_doctor_takes_rates_over_the_time_its_readings_span(monkeypatch, capsys):
    """Each reading of /metrics finds 10 more steps and 40 more tokens. With --interval 1.2 the readings arrive at
    0.05, 0.6, 1.15 and 1.7 s: rates are over the 1.65 s between the first and the last, not over 1.2."""
    clock = _Clock()
    served = []

    class Metrics(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            clock.now += 0.05
            served.append(clock.now)
            n = len(served)
            body = (f"conveyor_engine_step_seconds_count {10 * n}\nconveyor_engine_step_seconds_sum {0.01 * n}\n"
                    f"conveyor_forward_seconds_total {0.5 * n}\nconveyor_generation_tokens_total {40 * n}\n").encode()
            self.send_response(200)
            self.send_header("content-type", "text/plain")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    monkeypatch.setattr(conveyor.bench.doctor, "time", clock)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        assert main(["doctor", f"http://127.0.0.1:{httpd.server_address[1]}", "--interval", "1.2", "--json"]) == 0
    finally:
        httpd.shutdown()
    assert served == pytest.approx([100.05, 100.6, 101.15, 101.7])
    window = json.loads(capsys.readouterr().out)["window"]
    assert window["seconds"] == pytest.approx(1.65)
    assert (window["steps"], window["generated_tokens"]) == (30, 120)
    assert window["steps_per_second"] == pytest.approx(30 / 1.65)
    assert window["busy_fraction"] == pytest.approx(1.5 / 1.65)


def test_histogram_quantiles_interpolate_within_buckets():
    def reading(counts: list[float]) -> dict:
        bounds = ["0.01", "0.02", "0.05", "+Inf"]
        return read_metrics("".join(f'x_bucket{{le="{b}"}} {c}\n' for b, c in zip(bounds, counts)))

    first, last = reading([0, 0, 0, 0]), reading([50, 90, 100, 100])
    assert quantile(first, last, "x", 0.5) == pytest.approx(0.01)  # 50 of 100 at or below 0.01
    assert quantile(first, last, "x", 0.7) == pytest.approx(0.015)  # halfway through the second bucket
    assert quantile(first, last, "x", 0.99) == pytest.approx(0.047)
    assert quantile(last, last, "x", 0.5) == 0.0  # (nothing observed between the readings)
    assert checklist(dict.fromkeys(diagnose([first, last], 1.0).window, 0.0) | {"seconds": 1.0}) == []


# A window where nothing on the checklist holds: a few requests decoding, nothing waiting, the hardware far from
# its limits. Each regime below moves only the numbers its rule reads.
CALM = {
    "seconds": 4.0, "steps": 100.0, "steps_per_second": 25.0, "mfu": 0.05, "mbu": 0.2, "busy_fraction": 0.9,
    "running_mean": 4.0, "running_max": 4.0, "waiting_mean": 0.0, "waiting_max": 0.0, "kv_usage_mean": 0.3,
    "kv_usage_max": 0.4, "preemptions": 0.0, "rejected": 0.0, "prompt_tokens": 0.0, "generated_tokens": 400.0,
    "tokens_per_step": 4.0, "queue_time_mean_s": 0.0, "ttft_mean_s": 0.05, "itl_count": 400.0, "itl_p50_s": 0.02,
    "itl_p99_s": 0.03, "host_fraction": 0.1, "schedule_fraction": 0.04, "sample_fraction": 0.03,
    "update_fraction": 0.03,
    # one worker
    "tensor_parallel_size": 1.0, "pipeline_parallel_size": 1.0, "parallel_steps": 0.0, "comm_ms": 0.0,
    "compute_ms": 0.0, "comm_share": 0.0, "comm_share_max_group": 0.0, "collectives_per_step": 0.0,
    "collective_mb_per_step": 0.0, "bubble_fraction": 0.0, "stage_imbalance": 1.0,
    # no latency targets
    "slo_ttft_s": 0.0, "slo_itl_s": 0.0, "within_slo": 0.0, "goodput": 0.0, "missed_ttft": 0.0, "missed_itl": 0.0,
    # one replica
    "replicas": 1.0, "replica_requests_max": 0.0, "replica_requests_min": 0.0, "replica_kv_usage_max": 0.0,
    "replica_kv_usage_min": 0.0, "replica_steps_max": 0.0, "replica_steps_min": 0.0, "lagging_replica": -1.0,
    # the rates against the peaks (5% and 20% of 1 TFLOP/s and 100 GB/s), no device named, float weights
    "flops_per_second": 5e10, "bytes_per_second": 2e10, "peak_flops": 1e12, "peak_bytes_per_second": 1e11,
    "flops_past_peak": 0.0, "bytes_past_peak": 0.0, "on_cpu": 0.0, "integer_weights": 0.0,
}
TP3 = {"tensor_parallel_size": 3.0, "parallel_steps": 100.0, "comm_ms": 20.0, "compute_ms": 30.0}
PP2 = {"pipeline_parallel_size": 2.0, "parallel_steps": 100.0, "stage_imbalance": 1.1}
DP2 = {"replicas": 2.0, "replica_steps_max": 100.0, "replica_steps_min": 90.0, "lagging_replica": 1.0,
       "replica_kv_usage_max": 0.3, "replica_kv_usage_min": 0.2}
SLO = {"slo_ttft_s": 2.0, "slo_itl_s": 0.15, "within_slo": 30.0, "goodput": 7.5}
# regime: (the window's changes that make it hold, the same changes just short of its threshold)
REGIMES = {
    "kv_capacity": ({"preemptions": 1.0}, {"kv_usage_max": 0.94, "waiting_mean": 3.0, "running_max": 64.0}),
    "batch_too_small": ({"waiting_mean": 3.0, "running_max": 8.0, "running_mean": 8.0, "mfu": 0.3},
                        {"waiting_mean": 3.0, "running_max": 8.0, "running_mean": 5.9, "mfu": 0.3}),
    "queueing": ({"waiting_mean": 0.5, "running_max": 64.0, "running_mean": 60.0},
                 {"waiting_mean": 0.49, "running_max": 64.0, "running_mean": 60.0}),
    "prefill_interference": ({"prompt_tokens": 2048.0, "itl_p99_s": 0.0601},
                             {"prompt_tokens": 2048.0, "itl_p99_s": 0.06}),
    "compute_bound": ({"mfu": 0.5}, {"mfu": 0.499}),
    "bandwidth_bound": ({"mbu": 0.6}, {"mbu": 0.599}),
    "communication_bound": (TP3 | {"comm_share": 0.3}, TP3 | {"comm_share": 0.299, "comm_share_max_group": 0.299}),
    "pipeline_bubbles": (PP2 | {"bubble_fraction": 0.25}, PP2 | {"bubble_fraction": 0.249}),
    "host_overhead": ({"host_fraction": 0.4}, {"host_fraction": 0.399}),
    "dp_imbalance": (DP2 | {"replica_steps_min": 9.9}, DP2 | {"replica_steps_min": 10.0}),
    "slo_missed": (SLO | {"missed_ttft": 1.0}, SLO),
}


@pytest.mark.parametrize("regime", REGIMES)
def test_every_regime_at_its_threshold(regime):
    """Synthetic windows, so each rule is checked at its threshold whatever device the suite runs on: the regime
    holds just past it (and is the verdict, as the most pressing one there) and not just short of it."""
    assert checklist(CALM) == []
    past, short = REGIMES[regime]
    findings = checklist(CALM | past)
    assert [f.regime for f in findings] == [regime]
    assert set(findings[0].evidence) <= set(CALM)
    assert regime not in [f.regime for f in checklist(CALM | short)]


@pytest.mark.parametrize(("changes", "regimes"), [
    # preempted while requests wait at a small batch: the KV cache is named first (the batch could not grow into a
    # full cache); queueing is left out where a finding above it explains the wait
    ({"preemptions": 2.0, "waiting_mean": 3.0, "running_max": 4.0}, ["kv_capacity", "batch_too_small"]),
    ({"preemptions": 2.0, "waiting_mean": 3.0, "running_max": 64.0, "running_mean": 60.0, "mfu": 0.6},
     ["kv_capacity", "compute_bound"]),
    # a small batch at a busy compute unit is not called too small: the hardware is the limit
    ({"waiting_mean": 3.0, "mfu": 0.6}, ["queueing", "compute_bound"]),
    ({"prompt_tokens": 512.0, "itl_p99_s": 0.2, "mbu": 0.7}, ["prefill_interference", "bandwidth_bound"]),
    # compute-bound steps are not also called bandwidth-bound
    ({"mfu": 0.7, "mbu": 0.9}, ["compute_bound"]),
    # too few decode tokens in the window to read a P99 from
    ({"prompt_tokens": 512.0, "itl_p99_s": 0.2, "itl_count": 19.0}, []),
    # the TP group where communication weighs most is enough; too few multi-worker steps to judge are not
    (TP3 | {"comm_share": 0.2, "comm_share_max_group": 0.35}, ["communication_bound"]),
    (TP3 | {"comm_share": 0.5, "parallel_steps": 9.0}, []),
    # requests queue behind communication: the workers' time is named, not the server's capacity
    (TP3 | {"comm_share": 0.6, "waiting_mean": 3.0, "running_max": 64.0, "running_mean": 60.0},
     ["communication_bound"]),
    # bubbles without stages cannot be
    ({"bubble_fraction": 0.5, "parallel_steps": 100.0}, []),
    # replicas apart by their queues or their KV usage, and the lagging replica named before the queue it makes
    (DP2 | {"replica_requests_max": 7.0, "replica_requests_min": 2.0}, ["dp_imbalance"]),
    (DP2 | {"replica_requests_max": 6.9, "replica_requests_min": 2.0}, []),
    (DP2 | {"replica_kv_usage_max": 0.75}, ["dp_imbalance"]),
    (DP2 | {"replica_kv_usage_max": 0.65}, []),
    # a stalled replica (no step with requests of its own) is named in a window too short for the 10 steps that
    # call one slow: on a slow device the other replica's long prefills may run only a few steps
    (DP2 | {"replica_steps_max": 3.0, "replica_steps_min": 0.0}, ["dp_imbalance"]),
    (DP2 | {"replica_steps_max": 2.0, "replica_steps_min": 0.0}, []),
    (DP2 | {"replica_steps_max": 9.0, "replica_steps_min": 0.5}, []),
    (DP2 | {"replica_steps_min": 0.0, "waiting_mean": 3.0, "running_max": 64.0, "running_mean": 60.0},
     ["dp_imbalance"]),
    # requests queue behind a host-bound step at a full batch: the host's share is named, not the capacity
    ({"host_fraction": 0.6, "waiting_mean": 3.0, "running_max": 64.0, "running_mean": 60.0}, ["host_overhead"]),
    # latency targets missed: named first, the binding target (missed more often) in its summary and its advice,
    # and the resource behind it after; misses without targets set cannot be
    (SLO | {"missed_itl": 3.0, "missed_ttft": 1.0, "prompt_tokens": 512.0, "itl_p99_s": 0.2},
     ["slo_missed", "prefill_interference"]),
    (SLO | {"missed_ttft": 3.0, "waiting_mean": 3.0, "running_max": 64.0, "running_mean": 60.0},
     ["slo_missed", "queueing"]),
    ({"missed_itl": 3.0}, []),
    # a host-bound step that is also too small a batch: the batch first
    ({"host_fraction": 0.6, "waiting_mean": 3.0, "running_max": 4.0, "running_mean": 4.0},
     ["batch_too_small", "host_overhead"]),
])
def test_regimes_in_order(changes, regimes):
    assert [f.regime for f in checklist(CALM | changes)] == regimes


def test_the_slo_finding_names_the_binding_target():
    itl = checklist(CALM | SLO | {"missed_itl": 3.0, "missed_ttft": 1.0})[0]
    assert "binding latency target is ITL (150 ms)" in itl.summary and itl.change == "scheduler.max_num_seqs"
    ttft = checklist(CALM | SLO | {"missed_itl": 1.0, "missed_ttft": 3.0})[0]
    assert "binding latency target is TTFT (2000 ms)" in ttft.summary
    assert ttft.change == "parallel.data_parallel_size"


# what a CPU's advice must not name
GPU_WORDS = ("GPU", "fp8 units", "memory_fraction", "NVLink", "NVSwitch", "CUDA", "tensor core", "HBM", "NCCL")


@pytest.mark.parametrize("packed", [0.0, 1.0])
@pytest.mark.parametrize("regime", REGIMES)
def test_the_advice_on_a_cpu_names_no_gpu_feature(regime, packed):
    past, _ = REGIMES[regime]
    findings = checklist(CALM | past | {"on_cpu": 1.0, "integer_weights": packed})
    assert [f.regime for f in findings] == [regime]
    for finding in findings:
        text = f"{finding.summary} {finding.change} {finding.advice}"
        assert not [word for word in GPU_WORDS if word in text], text


def test_compute_bound_on_a_cpu_names_the_arithmetic_and_what_changes_it():
    """Float weights: the first change is the integer kernels (quant.plugin); packed ones: more cores."""
    floats = checklist(CALM | {"mfu": 0.7, "on_cpu": 1.0, "integer_weights": 0.0})[0]
    assert floats.change == "quant.plugin" and "float weights" in floats.summary
    assert "int4" in floats.advice and "int8" in floats.advice and "conveyor profile" in floats.advice
    packed = checklist(CALM | {"mfu": 0.7, "on_cpu": 1.0, "integer_weights": 0.9})[0]
    assert "int8 dot products" in packed.summary and "quant.plugin" not in packed.advice
    assert packed.change == "parallel.pipeline_parallel_size" and "cores" in packed.advice
    gpu = checklist(CALM | {"mfu": 0.7})[0]
    assert gpu.change == "parallel.tensor_parallel_size" and "fp8" in gpu.advice


def _exposition(flops: float, forward: float, peak_flops: float, moved: float, peak_bandwidth: float) -> str:
    """A CPU engine's /metrics after ``forward`` seconds of steps (the default GGUF's weights)."""
    return (f"conveyor_engine_step_seconds_count {100 * forward}\nconveyor_forward_seconds_total {forward}\n"
            f"conveyor_model_flops_total {flops}\nconveyor_bytes_moved_total {moved}\n"
            f"conveyor_device_peak_flops {peak_flops}\nconveyor_device_peak_bytes_per_second {peak_bandwidth}\n"
            'conveyor_device_info{device="cpu"} 1\n'
            'conveyor_weight_bytes{format="Q4_1"} 66355200\nconveyor_weight_bytes{format="Q8_0"} 30081024\n')


def test_steps_past_the_cached_peak_count_as_it_and_the_doctor_says_the_peak_is_wrong():
    """A profile measured on a busy machine: 146 GFLOP/s cached, steps at 184 (1.26x). MFU is 100%, not 126%; the
    compute-bound finding gives both rates and how to measure the peak again. Bandwidth within its peak stays a
    plain share."""
    first = read_metrics(_exposition(0, 0, 146e9, 0, 30e9))
    last = read_metrics(_exposition(184e9 * 2, 2.0, 146e9, 30e9, 30e9))
    diagnosis = diagnose([first, last], 2.0)
    w = diagnosis.window
    assert w["mfu"] == 1.0 and w["flops_past_peak"] == pytest.approx(184 / 146)
    assert w["mbu"] == pytest.approx(0.5) and w["bytes_past_peak"] == 0.0
    assert w["on_cpu"] == 1.0 and w["integer_weights"] == 1.0
    finding = next(f for f in diagnosis.findings if f.regime == "compute_bound")
    assert "184 GFLOP/s, 1.26x the peak of 146 GFLOP/s" in finding.summary
    assert "conveyor profile" in finding.summary and finding.evidence["mfu"] == 1.0
    text = conveyor.bench.doctor.format_diagnosis(diagnosis)
    assert "MFU 100.0% of 146 GFLOP/s" in text and "126%" not in text
    assert not [word for word in GPU_WORDS if word in text], text


def test_under_bench_load_no_share_passes_its_peak(default_server):
    """`conveyor bench` sends 32 requests at once to the shared default server while the doctor reads it: MFU and
    MBU stay within 0..1, and on a CPU the doctor knows it and that the default GGUF's weights are packed. Then the
    same readings with each peak at half the rate the steps reached, as a profile measured on a busy machine gives:
    each share is 1, not 2, the window keeps the 2x, and the compute-bound finding says the peak is too low and, on
    a CPU, names no GPU feature."""
    server = default_server
    command = [sys.executable, "-m", "conveyor", "bench", "--no-progress", "--url", server.http, "--dataset",
               "random", "--input-len", "128", "--output-len", "32", "--ignore-eos", "--num-requests", "32",
               "--request-rate", "inf", "--warmup", "0"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as bench:
        try:
            server.wait_for(lambda: server.metric("conveyor_num_requests_running") >= 4, timeout=120,
                            what="the bench's requests to run")
            readings = [reading for _, reading in timed_readings(server.http, 3.0)]
        finally:
            _out, err = bench.communicate(timeout=600)
    assert bench.returncode == 0, err
    on_cpu = not torch.cuda.is_available()

    loaded = diagnose(readings, 3.0)
    w = loaded.window
    print("under bench load:", conveyor.bench.doctor.format_diagnosis(loaded))
    assert w["steps"] > 0 and 0 < w["mfu"] <= 1 and 0 < w["mbu"] <= 1, w
    assert w["flops_past_peak"] == 0 or w["mfu"] == 1
    for finding in loaded.findings:
        assert all(finding.evidence[k] <= 1 for k in ("mfu", "mbu") if k in finding.evidence), finding
    if on_cpu:
        assert w["on_cpu"] == 1.0 and w["integer_weights"] == 1.0, w

    # each peak lowered to half the rate the steps reached
    scale = {"conveyor_device_peak_flops": w["flops_per_second"] / 2 / w["peak_flops"],
             "conveyor_device_peak_bytes_per_second": w["bytes_per_second"] / 2 / w["peak_bytes_per_second"]}
    low = [{key: value * scale.get(key[0], 1.0) for key, value in r.items()} for r in readings]
    busy = diagnose(low, 3.0)
    w = busy.window
    print("peaks at half the steps' rates:", conveyor.bench.doctor.format_diagnosis(busy))
    assert w["mfu"] == 1.0 and w["mbu"] == 1.0, w
    assert w["flops_past_peak"] == pytest.approx(2.0) and w["bytes_past_peak"] == pytest.approx(2.0), w
    finding = next(f for f in busy.findings if f.regime == "compute_bound")
    assert "the peak of" in finding.summary and "too low" in finding.summary
    text = conveyor.bench.doctor.format_diagnosis(busy)
    assert "MFU 100.0%" in text and "MBU 100.0%" in text
    if on_cpu:
        assert "conveyor profile" in finding.summary
        assert not [word for word in GPU_WORDS if word in text], text
