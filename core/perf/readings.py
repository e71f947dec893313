"""The doctor's readings of a server's /metrics: each scrape as {(name, labels): value}, and what the
checklist looks at over an interval (``summarize``: rates, means, histogram quantiles between two readings)."""

from __future__ import annotations

import math
from collections.abc import Iterator

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from conveyor.perf.peaks import integer_share


def metric_samples(text: str) -> Iterator[Sample]:
    """Every sample of a Prometheus text exposition."""
    for family in text_string_to_metric_families(text):
        yield from family.samples


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
    peak_flops = _total(last, "conveyor_device_peak_flops")
    peak_bandwidth = _total(last, "conveyor_device_peak_bytes_per_second")
    running, waiting = gauge("conveyor_num_requests_running"), gauge("conveyor_num_requests_waiting")
    kv = fullest("conveyor_kv_cache_usage_ratio")
    prompt, generated = delta("conveyor_prompt_tokens_total"), delta("conveyor_generation_tokens_total")
    stages = {stage: max(0.0, last_stage - _by_label(first, "conveyor_step_stage_seconds_total", "stage").get(stage, 0))
              for stage, last_stage in _by_label(last, "conveyor_step_stage_seconds_total", "stage").items()}
    step_seconds = sum(stages.values())

    def stage_share(*names: str) -> float:
        return sum(stages.get(n, 0.0) for n in names) / step_seconds if step_seconds else 0.0

    flops_rate = delta("conveyor_model_flops_total") / forward if forward else 0.0
    bytes_rate = delta("conveyor_bytes_moved_total") / forward if forward else 0.0
    # (a rate past its peak means the peak is wrong, measured while the CPU was busy or of other arithmetic than
    # the kernels': the share is 1, and how far past it the steps ran is kept for the checklist to say so)
    mfu = flops_rate / peak_flops if peak_flops else 0.0
    mbu = bytes_rate / peak_bandwidth if peak_bandwidth else 0.0
    devices = [dict(labels).get("device", "") for (n, labels) in last if n == "conveyor_device_info"]
    weights = _by_label(last, "conveyor_weight_bytes", "format")
    return {
        "seconds": seconds,
        "steps": steps,
        "steps_per_second": steps / seconds if seconds else 0.0,
        "mfu": min(1.0, mfu),
        "mbu": min(1.0, mbu),
        # the steps' rates against the peaks /metrics gives, and by how much they passed them (0: they did not)
        "flops_per_second": flops_rate,
        "bytes_per_second": bytes_rate,
        "peak_flops": peak_flops,
        "peak_bytes_per_second": peak_bandwidth,
        "flops_past_peak": mfu if mfu > 1 else 0.0,
        "bytes_past_peak": mbu if mbu > 1 else 0.0,
        # 1 where the engine runs on a CPU (the advice then names no GPU feature), and there the share of the
        # weights its packed-block kernels multiply as int8
        "on_cpu": 1.0 if devices and all(d.startswith("cpu") for d in devices) else 0.0,
        "integer_weights": integer_share({f: int(n) for f, n in weights.items()}),
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
        "queue_time_mean_s": _mean(first, last, "conveyor_request_queue_time_seconds"),
        "ttft_mean_s": _mean(first, last, "conveyor_time_to_first_token_seconds"),
        "itl_count": delta("conveyor_inter_token_latency_seconds_count"),
        "itl_p50_s": quantile(first, last, "conveyor_inter_token_latency_seconds", 0.5),
        "itl_p99_s": quantile(first, last, "conveyor_inter_token_latency_seconds", 0.99),
        # the share of the steps' time outside the forward pass, and by stage
        "host_fraction": stage_share("schedule", "sample", "update"),
        "schedule_fraction": stage_share("schedule"),
        "sample_fraction": stage_share("sample"),
        "update_fraction": stage_share("update"),
        **_targets(first, last, seconds),
        **_parallel(first, last),
        **_replicas(readings),
    }


def _mean(first: Reading, last: Reading, histogram: str) -> float:
    """A histogram's mean over the interval (0 without samples)."""
    count = max(0.0, _total(last, f"{histogram}_count") - _total(first, f"{histogram}_count"))
    seconds = max(0.0, _total(last, f"{histogram}_sum") - _total(first, f"{histogram}_sum"))
    return seconds / count if count else 0.0


def _targets(first: Reading, last: Reading, seconds: float) -> dict[str, float]:
    """The latency targets ([scheduler] ttft_slo_ms, itl_slo_ms; 0: none) and the requests that met or missed
    them."""
    targets = _by_label(last, "conveyor_slo_target_seconds", "target")
    within = max(0.0, _total(last, "conveyor_requests_within_slo_total")
                 - _total(first, "conveyor_requests_within_slo_total"))
    return {
        "slo_ttft_s": targets.get("ttft", 0.0),
        "slo_itl_s": targets.get("itl", 0.0),
        "within_slo": within,
        "goodput": within / seconds if seconds else 0.0,
        "missed_ttft": _missed(first, last, "ttft"),
        "missed_itl": _missed(first, last, "itl"),
    }


def _missed(first: Reading, last: Reading, target: str) -> float:
    """Requests that missed one latency target between two readings."""
    name = "conveyor_requests_missed_slo_total"
    return max(0.0, _by_label(last, name, "target").get(target, 0.0) - _by_label(first, name, "target").get(target, 0.0))


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
