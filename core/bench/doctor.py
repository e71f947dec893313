"""``conveyor doctor URL``: what limits a running server now, with the evidence, and the config key to change first.

It reads the server's ``/metrics`` every half second for an interval and
compares the first and the last reading (counters and histograms) and every
reading of the gauges. The checklist, in order (the first that holds is the
verdict; all that hold are listed):

- **Imbalanced data-parallel replicas**: a replica with requests ran
  almost no steps (stalled or slow), or the replicas' queues or KV usage
  lie far apart. ``server.engine_timeout``, or a more even mix.
- **KV capacity**: requests were preempted to free KV blocks, or the cache
  stayed full while requests waited. More KV memory, or fp8 KV.
- **Batch too small**: requests waited while the running batch stayed at a
  few requests, the KV cache had room and compute sat idle. A larger
  ``max_num_seqs``.
- **Communication-bound**: multi-worker steps spend 30% or more of their
  time in collectives and transfers. Fewer tensor-parallel ranks, or a
  faster interconnect.
- **Pipeline bubbles**: the stages wait 25% or more of their time for the
  stage before. More requests in flight, or fewer stages.
- **Host overhead**: 40% or more of the steps' time is outside the forward
  pass (scheduling, sampling, recording). Larger batches.
- **Queueing**: requests waited (or were refused) with the batch as large as
  the hardware allows, and nothing above explains it. More replicas (or a
  faster device).
- **Prefill interference**: prompt chunks in the steps of running decodes
  made inter-token latency spiky (P99 over 3x the P50). Smaller chunks.
- **Compute-bound** (MFU >= 0.5) or **bandwidth-bound** (MBU >= 0.6) steps:
  the hardware itself; tensor parallelism, or fewer bytes per token.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import httpx

from conveyor.bench.load import metric_samples

# seconds between readings of /metrics
SAMPLE_EVERY_S = 0.5
# ITL P99 over P50 above which decodes are called disturbed (the "ITL p99 <= 3x p50" target)
ITL_SPREAD = 3.0
# a running batch this small while requests wait leaves a CPU's or a GPU's matmuls mostly idle
SMALL_BATCH = 8
# share of a multi-worker step's time in collectives and transfers above which parallelism costs more than it
# splits (Megatron-LM keeps tensor parallelism inside a node for this reason)
COMM_SHARE = 0.3
# share of the workers' time spent waiting for the previous pipeline stage
BUBBLE_FRACTION = 0.25
# share of the steps' time outside the forward pass (scheduling, sampling, recording the results)
HOST_SHARE = 0.4
# a replica with requests that ran under this share of the busiest replica's steps lags (stalled or slow)
LAGGING_STEPS = 0.1
# KV usage apart, on average, between the fullest and the emptiest replica
KV_USAGE_GAP = 0.5


@dataclass
class Finding:
    """One resource that limits the server, and what to change first."""

    regime: str
    summary: str
    evidence: dict[str, float]
    change: str
    advice: str


@dataclass
class Diagnosis:
    seconds: float
    verdict: str
    findings: list[Finding] = field(default_factory=list)
    window: dict[str, float] = field(default_factory=dict)


Reading = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def read_metrics(text: str) -> Reading:
    """A Prometheus exposition as {(name, sorted labels): value}."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in metric_samples(text)}


def _total(reading: Reading, name: str) -> float:
    """The sum over labels (replicas, model names) of one sample name."""
    return sum(value for (n, _), value in reading.items() if n == name)


def _by_label(reading: Reading, name: str, label: str) -> dict[str, float]:
    """One sample name's values by one label's value (summed over the other labels)."""
    values: dict[str, float] = {}
    for (n, labels), value in reading.items():
        key = dict(labels).get(label)
        if n == name and key is not None:
            values[key] = values.get(key, 0.0) + value
    return values


def _buckets(reading: Reading, name: str) -> dict[float, float]:
    """A histogram's cumulative bucket counts by upper bound, summed over labels."""
    counts: dict[float, float] = {}
    for (n, labels), value in reading.items():
        if n == f"{name}_bucket":
            bound = float(dict(labels)["le"])
            counts[bound] = counts.get(bound, 0.0) + value
    return counts


def quantile(first: Reading, last: Reading, name: str, q: float) -> float:
    """The ``q`` quantile of a histogram's observations between two readings (linear within a bucket)."""
    before, after = _buckets(first, name), _buckets(last, name)
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return 0.0
    target, lower, below = q * total, 0.0, 0.0
    for bound, count in zip(bounds, counts):
        if count >= target:
            if math.isinf(bound):
                return lower
            inside = count - below
            return lower + (bound - lower) * ((target - below) / inside if inside else 1.0)
        lower, below = bound, count
    return lower


def summarize(readings: list[Reading], seconds: float) -> dict[str, float]:
    """The numbers the checklist looks at, over the readings' interval."""
    first, last = readings[0], readings[-1]

    def delta(name: str) -> float:
        return max(0.0, _total(last, name) - _total(first, name))

    def gauge(name: str) -> list[float]:
        return [_total(r, name) for r in readings]

    def fullest(name: str) -> list[float]:  # (a ratio per replica: the fullest one's)
        return [max((v for (n, _), v in r.items() if n == name), default=0.0) for r in readings]

    steps = delta("conveyor_engine_step_seconds_count")
    forward = delta("conveyor_forward_seconds_total")
    peak_flops, peak_bandwidth = _total(last, "conveyor_device_peak_flops"), _total(last, "conveyor_device_peak_bytes_per_second")
    running, waiting = gauge("conveyor_num_requests_running"), gauge("conveyor_num_requests_waiting")
    kv = fullest("conveyor_kv_cache_usage_ratio")
    prompt, generated = delta("conveyor_prompt_tokens_total"), delta("conveyor_generation_tokens_total")
    queued = delta("conveyor_request_queue_time_seconds_count")
    first_tokens = delta("conveyor_time_to_first_token_seconds_count")
    stages = {stage: max(0.0, last_stage - _by_label(first, "conveyor_step_stage_seconds_total", "stage").get(stage, 0))
              for stage, last_stage in _by_label(last, "conveyor_step_stage_seconds_total", "stage").items()}
    step_seconds = sum(stages.values())

    def stage_share(*names: str) -> float:
        return sum(stages.get(n, 0.0) for n in names) / step_seconds if step_seconds else 0.0

    return {
        "seconds": seconds,
        "steps": steps,
        "steps_per_second": steps / seconds if seconds else 0.0,
        "mfu": delta("conveyor_model_flops_total") / forward / peak_flops if forward and peak_flops else 0.0,
        "mbu": delta("conveyor_bytes_moved_total") / forward / peak_bandwidth if forward and peak_bandwidth else 0.0,
        # (the steps' own timings, published a step late, can sum to a little over the wall time)
        "busy_fraction": min(1.0, forward / seconds) if seconds else 0.0,
        "running_mean": sum(running) / len(running),
        "running_max": max(running),
        "waiting_mean": sum(waiting) / len(waiting),
        "waiting_max": max(waiting),
        "kv_usage_mean": sum(kv) / len(kv),
        "kv_usage_max": max(kv),
        "preemptions": delta("conveyor_preemptions_total"),
        "rejected": delta("conveyor_rejected_requests_total"),
        "prompt_tokens": prompt,
        "generated_tokens": generated,
        "tokens_per_step": (prompt + generated) / steps if steps else 0.0,
        "queue_time_mean_s": delta("conveyor_request_queue_time_seconds_sum") / queued if queued else 0.0,
        "ttft_mean_s": delta("conveyor_time_to_first_token_seconds_sum") / first_tokens if first_tokens else 0.0,
        "itl_count": delta("conveyor_inter_token_latency_seconds_count"),
        "itl_p50_s": quantile(first, last, "conveyor_inter_token_latency_seconds", 0.5),
        "itl_p99_s": quantile(first, last, "conveyor_inter_token_latency_seconds", 0.99),
        # the share of the steps' time outside the forward pass, and by stage
        "host_fraction": stage_share("schedule", "sample", "update"),
        "schedule_fraction": stage_share("schedule"),
        "sample_fraction": stage_share("sample"),
        "update_fraction": stage_share("update"),
        **_parallel(first, last),
        **_replicas(readings),
    }


def _parallel(first: Reading, last: Reading) -> dict[str, float]:
    """Multi-worker steps: communication against compute (overall, and in the TP group where it is largest),
    the collectives per step, the pipeline's bubbles and how unequal its stages' compute is."""
    def delta(name: str) -> float:
        return max(0.0, _total(last, name) - _total(first, name))

    def by_rank(name: str) -> dict[str, float]:
        before = _by_label(first, name, "rank")
        return {rank: value - before.get(rank, 0.0) for rank, value in _by_label(last, name, "rank").items()}

    tp = max(1.0, max((v for (n, _), v in last.items() if n == "conveyor_tensor_parallel_size"), default=1.0))
    pp = max(1.0, max((v for (n, _), v in last.items() if n == "conveyor_pipeline_parallel_size"), default=1.0))
    steps = delta("conveyor_step_comm_seconds_count")
    comm, compute = delta("conveyor_step_comm_seconds_sum"), delta("conveyor_step_compute_seconds_sum")
    busy, comms, waits = (by_rank(f"conveyor_worker_{kind}") for kind in
                          ("step_seconds_sum", "comm_seconds_total", "wait_seconds_total"))
    # per pipeline stage (a TP group: ranks stage * tp ... stage * tp + tp - 1): communication over its time
    # less its waits, and its compute
    stage_comm_share, stage_compute = [], []
    for stage in range(int(pp)):
        ranks = [str(stage * int(tp) + i) for i in range(int(tp))]
        working = sum(busy.get(r, 0.0) - waits.get(r, 0.0) for r in ranks)
        talking = sum(comms.get(r, 0.0) for r in ranks)
        if working > 0:
            stage_comm_share.append(talking / working)
            stage_compute.append(max(0.0, working - talking))
    return {
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "parallel_steps": steps,
        "comm_ms": 1e3 * comm / steps if steps else 0.0,
        "compute_ms": 1e3 * compute / steps if steps else 0.0,
        "comm_share": comm / (comm + compute) if comm + compute > 0 else 0.0,
        "comm_share_max_group": max(stage_comm_share, default=0.0),
        "collectives_per_step": delta("conveyor_collectives_total") / steps if steps else 0.0,
        "collective_mb_per_step": delta("conveyor_collective_bytes_total") / steps / 1e6 if steps else 0.0,
        "bubble_fraction": delta("conveyor_step_bubble_fraction_sum") / steps if steps else 0.0,
        # the slowest stage's compute over the fastest's (1: balanced, or one stage)
        "stage_imbalance": (max(stage_compute) / min(stage_compute)
                            if len(stage_compute) > 1 and min(stage_compute) > 0 else 1.0),
    }


def _replicas(readings: list[Reading]) -> dict[str, float]:
    """Data-parallel replicas (``replica`` labels) compared: the most and fewest requests held on average (routed
    by the frontend and not ended; else running + waiting), the fullest and emptiest KV cache on average, and the
    steps of the replica with requests that ran fewest against the most any ran."""
    first, last = readings[0], readings[-1]
    names = sorted(_by_label(last, "conveyor_num_requests_running", "replica"), key=int)
    if len(names) < 2:
        return {"replicas": float(len(names) or 1), "replica_requests_max": 0.0, "replica_requests_min": 0.0,
                "replica_kv_usage_max": 0.0, "replica_kv_usage_min": 0.0, "replica_steps_max": 0.0,
                "replica_steps_min": 0.0, "lagging_replica": -1.0}

    def mean(*metric_names: str) -> dict[str, float]:
        return {i: sum(_by_label(r, name, "replica").get(i, 0.0) for r in readings for name in metric_names)
                / len(readings) for i in names}

    routed = any(n == "conveyor_replica_requests_in_flight" for n, _ in last)
    held = mean("conveyor_replica_requests_in_flight") if routed else mean("conveyor_num_requests_running",
                                                                             "conveyor_num_requests_waiting")
    kv = mean("conveyor_kv_cache_usage_ratio")
    before, after = (_by_label(r, "conveyor_engine_steps_total", "replica") for r in (first, last))
    steps = {i: after.get(i, 0.0) - before.get(i, 0.0) for i in names}
    slowest = min((i for i in names if held[i] >= 1), key=lambda i: steps[i], default=None)
    return {
        "replicas": float(len(names)),
        "replica_requests_max": max(held.values()),
        "replica_requests_min": min(held.values()),
        "replica_kv_usage_max": max(kv.values()),
        "replica_kv_usage_min": min(kv.values()),
        "replica_steps_max": max(steps.values()),
        "replica_steps_min": steps[slowest] if slowest is not None else 0.0,
        "lagging_replica": float(slowest) if slowest is not None else -1.0,
    }


def _pick(window: dict[str, float], *names: str) -> dict[str, float]:
    return {name: round(window[name], 4) for name in names}


def checklist(w: dict[str, float]) -> list[Finding]:
    """Every regime of the checklist that holds over the window ``w`` (``summarize``), most pressing first."""
    findings = []
    waiting = w["waiting_mean"] >= 0.5 or w["rejected"] > 0
    lagging = (w["lagging_replica"] >= 0 and w["replica_steps_max"] >= 10
               and w["replica_steps_min"] < LAGGING_STEPS * w["replica_steps_max"])
    queue_apart = w["replica_requests_max"] >= 4 and w["replica_requests_max"] >= 3 * w["replica_requests_min"] + 1
    kv_apart = w["replica_kv_usage_max"] - w["replica_kv_usage_min"] >= KV_USAGE_GAP
    if w["replicas"] > 1 and (lagging or queue_apart or kv_apart):
        lag = (f"replica {w['lagging_replica']:.0f} ran {w['replica_steps_min']:.0f} steps to the busiest one's "
               f"{w['replica_steps_max']:.0f} with requests of its own; " if lagging else "")
        findings.append(Finding(
            "dp_imbalance",
            f"the data-parallel replicas are unequal: {lag}{w['replica_requests_min']:.1f} to "
            f"{w['replica_requests_max']:.1f} requests each on average, KV usage {w['replica_kv_usage_min']:.0%} to "
            f"{w['replica_kv_usage_max']:.0%}",
            _pick(w, "replicas", "lagging_replica", "replica_steps_min", "replica_steps_max", "replica_requests_min",
                  "replica_requests_max", "replica_kv_usage_min", "replica_kv_usage_max"),
            "server.engine_timeout" if lagging else "parallel.data_parallel_size",
            ("a replica with requests that runs no steps is stalled or far slower than the others: the frontend "
             "restarts a stalled one after server.engine_timeout seconds (lower it to fail over sooner); look at "
             "its device and its log" if lagging else
             "requests that share a prefix follow it to the replica holding it (the router's affinity gives way "
             "past 8 requests and 1.5x the least loaded one's), and a replica on a slower device falls behind: a "
             "more even mix of prompts or more replicas (parallel.data_parallel_size) balance them"),
        ))
    if w["preemptions"] > 0 or (w["kv_usage_max"] >= 0.95 and waiting):
        findings.append(Finding(
            "kv_capacity",
            f"the KV cache is full: {w['preemptions']:.0f} preemptions in {w['seconds']:.0f} s (running requests "
            f"evicted and recomputed), usage up to {w['kv_usage_max']:.0%}",
            _pick(w, "preemptions", "kv_usage_max", "kv_usage_mean", "running_mean", "waiting_mean"),
            "kvcache.memory_gb",
            "give the KV cache more memory (kvcache.memory_gb, or memory_fraction on a GPU); kvcache.dtype = "
            "\"fp8\" holds twice the tokens; a shorter model.max_model_len or fewer scheduler.max_num_seqs "
            "admit fewer at once",
        ))
    # (the batch held at its cap: full nearly all the time, a reading between a request's end and the next's
    # start aside)
    held = w["running_mean"] >= 0.75 * w["running_max"]
    small = waiting and held and w["running_max"] <= SMALL_BATCH and w["kv_usage_max"] < 0.8 and w["mfu"] < 0.2
    if small:
        findings.append(Finding(
            "batch_too_small",
            f"requests wait ({w['waiting_mean']:.1f} on average) while the batch stays at "
            f"{w['running_max']:.0f} running, the KV cache {w['kv_usage_max']:.0%} used and compute "
            f"{w['mfu']:.1%} used: a cap on the batch, not the hardware, limits throughput",
            _pick(w, "running_max", "waiting_mean", "kv_usage_max", "mfu", "mbu", "tokens_per_step"),
            "scheduler.max_num_seqs",
            "raise scheduler.max_num_seqs (and scheduler.max_num_batched_tokens if steps fill their token budget): "
            "a decode step costs nearly the same for one request as for dozens",
        ))
    if w["parallel_steps"] >= 10 and max(w["comm_share"], w["comm_share_max_group"]) >= COMM_SHARE:
        findings.append(Finding(
            "communication_bound",
            f"the workers spend {w['comm_share']:.0%} of each step in collectives and transfers "
            f"({w['comm_ms']:.1f} ms to {w['compute_ms']:.1f} ms of compute; {w['comm_share_max_group']:.0%} in the "
            f"busiest TP group of {w['tensor_parallel_size']:.0f}), {w['collectives_per_step']:.0f} collectives "
            f"of {w['collective_mb_per_step']:.2f} MB a step",
            _pick(w, "comm_share", "comm_share_max_group", "comm_ms", "compute_ms", "collectives_per_step",
                  "collective_mb_per_step", "tensor_parallel_size", "pipeline_parallel_size", "parallel_steps"),
            "parallel.tensor_parallel_size",
            "fewer tensor-parallel ranks (use the devices as data-parallel replicas or pipeline stages instead: "
            "parallel.data_parallel_size, parallel.pipeline_parallel_size) or a faster interconnect; "
            "`conveyor simulate --interconnect` estimates each",
        ))
    if w["pipeline_parallel_size"] > 1 and w["parallel_steps"] >= 10 and w["bubble_fraction"] >= BUBBLE_FRACTION:
        findings.append(Finding(
            "pipeline_bubbles",
            f"the pipeline's {w['pipeline_parallel_size']:.0f} stages wait {w['bubble_fraction']:.0%} of their time "
            f"for the stage before (the slowest stage computes {w['stage_imbalance']:.2f}x the fastest) with "
            f"{w['running_mean']:.1f} requests running",
            _pick(w, "bubble_fraction", "stage_imbalance", "pipeline_parallel_size", "running_mean", "waiting_mean",
                  "parallel_steps"),
            "parallel.pipeline_parallel_size",
            "more requests in flight fill the stages (each stage works on its own batch: too few requests leave "
            "stages idle), fewer stages (parallel.pipeline_parallel_size), or, with stages unequal, layers "
            "rebalanced among them",
        ))
    if w["steps"] >= 20 and w["host_fraction"] >= HOST_SHARE:
        findings.append(Finding(
            "host_overhead",
            f"{w['host_fraction']:.0%} of each step is spent outside the forward pass: scheduling "
            f"{w['schedule_fraction']:.0%}, sampling {w['sample_fraction']:.0%}, recording the results "
            f"{w['update_fraction']:.0%}, at {w['tokens_per_step']:.1f} tokens a step",
            _pick(w, "host_fraction", "schedule_fraction", "sample_fraction", "update_fraction", "tokens_per_step",
                  "running_mean", "steps_per_second"),
            "scheduler.max_num_seqs",
            "the device waits for the host between forward passes: larger batches share each step's fixed host "
            "work among more tokens (scheduler.max_num_seqs, more concurrent requests); fewer per-token extras "
            "(logprobs, stop strings, penalties) shorten sampling and recording",
        ))
    if waiting and not small and not findings:
        findings.append(Finding(
            "queueing",
            f"requests queue: {w['waiting_mean']:.1f} waiting on average (up to {w['waiting_max']:.0f}), "
            f"{w['rejected']:.0f} refused, {w['queue_time_mean_s']:.2f} s in the queue on average, with "
            f"{w['running_mean']:.0f} running and the device busy {w['busy_fraction']:.0%} of the time",
            _pick(w, "waiting_mean", "waiting_max", "rejected", "queue_time_mean_s", "ttft_mean_s", "running_mean",
                  "busy_fraction", "mfu", "mbu"),
            "parallel.data_parallel_size",
            "the server is at its capacity: more replicas (parallel.data_parallel_size, or more servers behind a "
            "balancer) or a faster device; quant.plugin = \"int8\" makes each decode step read half the bytes",
        ))
    prompts_among_decodes = w["prompt_tokens"] > 0 and w["itl_count"] >= 20
    if prompts_among_decodes and w["itl_p50_s"] > 0 and w["itl_p99_s"] > ITL_SPREAD * w["itl_p50_s"]:
        findings.append(Finding(
            "prefill_interference",
            f"decodes stall behind prompt chunks: ITL P99 {w['itl_p99_s'] * 1e3:.0f} ms is "
            f"{w['itl_p99_s'] / w['itl_p50_s']:.1f}x the P50 {w['itl_p50_s'] * 1e3:.0f} ms while "
            f"{w['prompt_tokens']:.0f} prompt tokens ran in the same steps",
            _pick(w, "itl_p50_s", "itl_p99_s", "prompt_tokens", "generated_tokens", "tokens_per_step"),
            "scheduler.max_num_batched_tokens",
            "lower scheduler.max_num_batched_tokens: prompts go in smaller chunks, so each step that carries "
            "one delays the running decodes less (time to first token grows a little)",
        ))
    if w["mfu"] >= 0.5:
        findings.append(Finding(
            "compute_bound",
            f"steps run at {w['mfu']:.0%} of the device's FLOP/s",
            _pick(w, "mfu", "mbu", "tokens_per_step", "busy_fraction"),
            "parallel.tensor_parallel_size",
            "the matmuls are near the device's peak: split them over devices (parallel.tensor_parallel_size) or "
            "use faster arithmetic (quant.plugin = \"fp8\" on GPUs with fp8 units)",
        ))
    elif w["mbu"] >= 0.6:
        findings.append(Finding(
            "bandwidth_bound",
            f"steps read memory at {w['mbu']:.0%} of the device's bandwidth",
            _pick(w, "mbu", "mfu", "tokens_per_step", "running_mean"),
            "quant.plugin",
            "each step is bound by reading the weights and the KV cache: quant.plugin = \"int8\" halves the "
            "weights' bytes, kvcache.dtype = \"fp8\" the cache's; a larger batch shares each read among more tokens",
        ))
    return findings


def sample(url: str, seconds: float, progress: Callable[[str], None] | None = None) -> list[Reading]:
    """Readings of ``url``'s /metrics every half second for ``seconds`` (at least two)."""
    readings = []
    deadline = time.monotonic() + seconds
    with httpx.Client(timeout=10) as client:
        while True:
            response = client.get(f"{url.rstrip('/')}/metrics")
            response.raise_for_status()
            readings.append(read_metrics(response.text))
            if len(readings) >= 2 and time.monotonic() >= deadline:
                return readings
            if progress is not None and len(readings) % 10 == 0:
                progress(f"{len(readings)} readings")
            time.sleep(SAMPLE_EVERY_S)


def diagnose(readings: list[Reading], seconds: float) -> Diagnosis:
    window = summarize(readings, seconds)
    findings = checklist(window)
    if findings:
        verdict = findings[0].regime
    elif window["steps"] == 0:
        verdict = "idle"
    else:
        verdict = "healthy"
    return Diagnosis(seconds, verdict, findings, window)


def format_diagnosis(diagnosis: Diagnosis) -> str:
    w = diagnosis.window
    head = (f"over {diagnosis.seconds:.0f} s: {w['steps']:.0f} steps, {w['generated_tokens']:.0f} tokens generated, "
            f"MFU {w['mfu']:.1%}, MBU {w['mbu']:.1%}, busy {w['busy_fraction']:.0%}, "
            f"{w['running_mean']:.1f} running, {w['waiting_mean']:.1f} waiting, KV up to {w['kv_usage_max']:.0%}")
    lines = [head]
    if not diagnosis.findings:
        lines.append("verdict: idle (no steps ran)" if diagnosis.verdict == "idle" else
                     "verdict: healthy (nothing on the checklist limits the server now)")
    for i, finding in enumerate(diagnosis.findings):
        head = "verdict" if i == 0 else "also"
        lines.append(f"{head}: {finding.regime}: {finding.summary}")
        lines.append("  evidence: " + ", ".join(f"{k} = {v:g}" for k, v in finding.evidence.items()))
        lines.append(f"  change first: {finding.change}: {finding.advice}")
    return "\n".join(lines)


def to_json(diagnosis: Diagnosis) -> str:
    return json.dumps(asdict(diagnosis), indent=2)
