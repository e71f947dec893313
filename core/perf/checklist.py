"""The doctor's checklist: what limits a running server, with the evidence and the config key to change first.

The server's dashboard and ``conveyor doctor`` (``conveyor.bench.doctor``, which samples a server's
/metrics) both diagnose with it. The checklist, in order (the first that holds is the verdict; all that
hold are listed):

- **Latency targets missed** (with ``[scheduler] ttft_slo_ms`` or ``itl_slo_ms``
  set): requests ended past a target; the finding names the binding one (the
  target missed more often) and the goodput, and the findings after it say
  why. TTFT: more capacity or a looser target; ITL: a smaller decode batch.
- **Imbalanced data-parallel replicas**: a replica with requests ran
  no step while another ran a few (stalled), or under a tenth of the
  busiest one's (slow), or the replicas' queues or KV usage
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
  pass (scheduling, sampling, recording). Async scheduling, larger batches.
- **Queueing**: requests waited (or were refused) with the batch as large as
  the hardware allows, and nothing above explains it. More replicas (or a
  faster device).
- **Prefill interference**: prompt chunks in the steps of running decodes
  made inter-token latency spiky (P99 over 3x the P50). Smaller chunks.
- **Compute-bound** (MFU >= 0.5) or **bandwidth-bound** (MBU >= 0.6) steps:
  the hardware itself; tensor parallelism, or fewer bytes per token. MFU is
  taken against the peak of the arithmetic the weights are multiplied in (on
  a CPU, int8 dot products for packed blocks), and neither share passes 1:
  steps faster than a peak say that the peak was measured low, and the
  finding says so.

The advice fits the device: on a CPU (``conveyor_device_info``) it names no
GPU feature, and it knows whether the weights are already packed blocks
(``conveyor_weight_bytes`` by format).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.perf.readings import Reading, summarize

# ITL P99 over P50 above which decodes are called disturbed (the "ITL p99 <= 3x p50" target)
ITL_SPREAD = 3.0
# a running batch this small while requests wait leaves a CPU's or a GPU's matmuls mostly idle
SMALL_BATCH = 8
# MFU from which steps are compute-bound; below it a capped batch leaves compute to spare (a 2-core CPU
# whose matmul peak is low already shows 0.2-0.3 at a batch of 2 decodes, where a larger batch still pays)
COMPUTE_BOUND = 0.5
# share of a multi-worker step's time in collectives and transfers above which parallelism costs more than it
# splits (Megatron-LM keeps tensor parallelism inside a node for this reason)
COMM_SHARE = 0.3
# share of the workers' time spent waiting for the previous pipeline stage
BUBBLE_FRACTION = 0.25
# share of the steps' time outside the forward pass (scheduling, sampling, recording the results)
HOST_SHARE = 0.4
# a replica with requests that ran under this share of the busiest replica's steps lags (stalled or slow)
LAGGING_STEPS = 0.1
# a replica with requests that ran no step while another ran this many is stalled, however short the window
STALLED_STEPS = 3
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


def _pick(window: dict[str, float], *names: str) -> dict[str, float]:
    return {name: round(window[name], 4) for name in names}


def checklist(w: dict[str, float]) -> list[Finding]:
    """Every regime of the checklist that holds over the window ``w`` (``summarize``), most pressing first."""
    regimes = (_slo_missed, _dp_imbalance, _kv_capacity, _batch_too_small, _communication_bound, _pipeline_bubbles,
               _host_overhead)
    findings = [finding for regime in regimes if (finding := regime(w)) is not None]
    if _waiting(w) and not _small_batch(w) and all(f.regime == "slo_missed" for f in findings):
        findings.append(_queueing(w))
    if (finding := _prefill_interference(w)) is not None:
        findings.append(finding)
    if w["mfu"] >= COMPUTE_BOUND:
        findings.append(_compute_bound(w))
    elif w["mbu"] >= 0.6:
        findings.append(_bandwidth_bound(w))
    return findings


def _waiting(w: dict[str, float]) -> bool:
    """Requests wait, or were refused."""
    return w["waiting_mean"] >= 0.5 or w["rejected"] > 0


def _small_batch(w: dict[str, float]) -> bool:
    """Requests wait while the batch stays small, held at its cap (full nearly all the time, a reading between a
    request's end and the next's start aside), with memory and compute to spare."""
    held = w["running_mean"] >= 0.75 * w["running_max"]
    return (_waiting(w) and held and w["running_max"] <= SMALL_BATCH and w["kv_usage_max"] < 0.8
            and w["mfu"] < COMPUTE_BOUND)


def _slo_missed(w: dict[str, float]) -> Finding | None:
    """Requests past a latency target: which target binds, and what loosens it."""
    finished = w["within_slo"] + max(w["missed_ttft"], w["missed_itl"])  # (a request past both counts in each)
    if (w["slo_ttft_s"] or w["slo_itl_s"]) and (w["missed_ttft"] or w["missed_itl"]):
        itl_binds = w["missed_itl"] > w["missed_ttft"]
        target, missed = ("ITL", w["missed_itl"]) if itl_binds else ("TTFT", w["missed_ttft"])
        limit = w["slo_itl_s"] if itl_binds else w["slo_ttft_s"]
        return Finding(
            "slo_missed",
            f"the binding latency target is {target} ({limit * 1e3:.0f} ms): {missed:.0f} of at least "
            f"{finished:.0f} requests ended past it ({w['missed_ttft']:.0f} past TTFT, {w['missed_itl']:.0f} past "
            f"ITL); goodput {w['goodput']:.2f} requests/s, {w['rejected']:.0f} refused",
            _pick(w, "slo_ttft_s", "slo_itl_s", "missed_ttft", "missed_itl", "within_slo", "goodput", "rejected",
                  "itl_p99_s", "ttft_mean_s", "running_mean", "waiting_mean"),
            "scheduler.max_num_seqs" if itl_binds else "parallel.data_parallel_size",
            ("steps with every running request's decode take longer than the ITL target even with the fewest "
             "prompt tokens: fewer requests at once (scheduler.max_num_seqs), a faster device or fewer bytes per "
             "token (quant.plugin), or a looser scheduler.itl_slo_ms" if itl_binds else
             "prompts wait longer than the TTFT target at this load: more capacity (parallel.data_parallel_size, "
             "more servers), slo_admission = \"reject\" to refuse the requests that would miss it early, or a "
             "looser scheduler.ttft_slo_ms (the findings below say what limits capacity)"),
        )
    return None


def _dp_imbalance(w: dict[str, float]) -> Finding | None:
    """Data-parallel replicas unequal: one stalled or slow, or their queues or KV usage apart."""
    stalled = w["replica_steps_min"] == 0 and w["replica_steps_max"] >= STALLED_STEPS
    slow = w["replica_steps_max"] >= 10 and w["replica_steps_min"] < LAGGING_STEPS * w["replica_steps_max"]
    lagging = w["lagging_replica"] >= 0 and (stalled or slow)
    queue_apart = w["replica_requests_max"] >= 4 and w["replica_requests_max"] >= 3 * w["replica_requests_min"] + 1
    kv_apart = w["replica_kv_usage_max"] - w["replica_kv_usage_min"] >= KV_USAGE_GAP
    if w["replicas"] > 1 and (lagging or queue_apart or kv_apart):
        lag = (f"replica {w['lagging_replica']:.0f} ran {w['replica_steps_min']:.0f} steps to the busiest one's "
               f"{w['replica_steps_max']:.0f} with requests of its own; " if lagging else "")
        return Finding(
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
        )
    return None


def _kv_capacity(w: dict[str, float]) -> Finding | None:
    """The KV cache full: preemptions, or requests waiting at full usage."""
    waiting = _waiting(w)
    if w["preemptions"] > 0 or (w["kv_usage_max"] >= 0.95 and waiting):
        return Finding(
            "kv_capacity",
            f"the KV cache is full: {w['preemptions']:.0f} preemptions in {w['seconds']:.0f} s (running requests "
            f"evicted and recomputed), usage up to {w['kv_usage_max']:.0%}",
            _pick(w, "preemptions", "kv_usage_max", "kv_usage_mean", "running_mean", "waiting_mean"),
            "kvcache.memory_gb",
            "give the KV cache more memory (kvcache.memory_gb" + ("" if w["on_cpu"] else ", or memory_fraction on "
                                                                  "a GPU") + "); kvcache.dtype = "
            "\"fp8\" holds twice the tokens; a shorter model.max_model_len or fewer scheduler.max_num_seqs "
            "admit fewer at once",
        )
    return None


def _batch_too_small(w: dict[str, float]) -> Finding | None:
    """Requests waiting while a small batch, not the hardware, limits throughput."""
    if _small_batch(w):
        return Finding(
            "batch_too_small",
            f"requests wait ({w['waiting_mean']:.1f} on average) while the batch stays at "
            f"{w['running_max']:.0f} running, the KV cache {w['kv_usage_max']:.0%} used and compute "
            f"{w['mfu']:.1%} used: a cap on the batch, not the hardware, limits throughput",
            _pick(w, "running_max", "waiting_mean", "kv_usage_max", "mfu", "mbu", "tokens_per_step"),
            "scheduler.max_num_seqs",
            "raise scheduler.max_num_seqs (and scheduler.max_num_batched_tokens if steps fill their token budget): "
            "a decode step costs nearly the same for one request as for dozens",
        )
    return None


def _communication_bound(w: dict[str, float]) -> Finding | None:
    """Workers spending much of each step in collectives and transfers."""
    if w["parallel_steps"] >= 10 and max(w["comm_share"], w["comm_share_max_group"]) >= COMM_SHARE:
        return Finding(
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
        )
    return None


def _pipeline_bubbles(w: dict[str, float]) -> Finding | None:
    """Pipeline stages waiting for the stage before."""
    if w["pipeline_parallel_size"] > 1 and w["parallel_steps"] >= 10 and w["bubble_fraction"] >= BUBBLE_FRACTION:
        return Finding(
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
        )
    return None


def _host_overhead(w: dict[str, float]) -> Finding | None:
    """Much of each step spent outside the forward pass."""
    if w["steps"] >= 20 and w["host_fraction"] >= HOST_SHARE:
        return Finding(
            "host_overhead",
            f"{w['host_fraction']:.0%} of each step is spent outside the forward pass: scheduling "
            f"{w['schedule_fraction']:.0%}, sampling {w['sample_fraction']:.0%}, recording the results "
            f"{w['update_fraction']:.0%}, at {w['tokens_per_step']:.1f} tokens a step",
            _pick(w, "host_fraction", "schedule_fraction", "sample_fraction", "update_fraction", "tokens_per_step",
                  "running_mean", "steps_per_second"),
            "scheduler.max_num_seqs",
            ("" if w["on_cpu"] else "the device waits for the host between forward passes: "
             "engine.async_scheduling = \"on\" schedules the next step while the device runs this one; ") +
            "larger batches share each step's fixed host work "
            "among more tokens (scheduler.max_num_seqs, more concurrent requests); fewer per-token extras "
            "(logprobs, stop strings, penalties) shorten sampling and recording",
        )
    return None


def _queueing(w: dict[str, float]) -> Finding:
    """The server at its capacity: requests queue with nothing else to blame (``checklist`` decides when)."""
    return Finding(
        "queueing",
        f"requests queue: {w['waiting_mean']:.1f} waiting on average (up to {w['waiting_max']:.0f}), "
        f"{w['rejected']:.0f} refused, {w['queue_time_mean_s']:.2f} s in the queue on average, with "
        f"{w['running_mean']:.0f} running and the device busy {w['busy_fraction']:.0%} of the time",
        _pick(w, "waiting_mean", "waiting_max", "rejected", "queue_time_mean_s", "ttft_mean_s", "running_mean",
              "busy_fraction", "mfu", "mbu"),
        "parallel.data_parallel_size",
        "the server is at its capacity: more replicas (parallel.data_parallel_size, or more servers behind a "
        "balancer) or a faster device" + ("" if w["integer_weights"] >= 0.5 else
                                          "; quant.plugin = \"int8\" makes each decode step read half the bytes"),
    )


def _prefill_interference(w: dict[str, float]) -> Finding | None:
    """Decodes stalling behind prompt chunks."""
    prompts_among_decodes = w["prompt_tokens"] > 0 and w["itl_count"] >= 20
    if prompts_among_decodes and w["itl_p50_s"] > 0 and w["itl_p99_s"] > ITL_SPREAD * w["itl_p50_s"]:
        return Finding(
            "prefill_interference",
            f"decodes stall behind prompt chunks: ITL P99 {w['itl_p99_s'] * 1e3:.0f} ms is "
            f"{w['itl_p99_s'] / w['itl_p50_s']:.1f}x the P50 {w['itl_p50_s'] * 1e3:.0f} ms while "
            f"{w['prompt_tokens']:.0f} prompt tokens ran in the same steps",
            _pick(w, "itl_p50_s", "itl_p99_s", "prompt_tokens", "generated_tokens", "tokens_per_step"),
            "scheduler.max_num_batched_tokens",
            "lower scheduler.max_num_batched_tokens: prompts go in smaller chunks, so each step that carries "
            "one delays the running decodes less (time to first token grows a little)",
        )
    return None


def giga(value: float) -> str:
    """``value`` in units of 1e9, to three figures below 100 (a peak mistaken by far is still readable)."""
    return f"{value / 1e9:,.0f}" if value >= 1e11 else f"{value / 1e9:.3g}"


def _past_peak(w: dict[str, float], kind: str, why: bool = True) -> str:
    """What the summary adds where the steps ran faster than the peak /metrics gives for ``kind`` ("flops" or
    "bytes"): the share is 1, and the peak was wrong (``why``: and how it came to be)."""
    ratio = w[f"{kind}_past_peak"]
    if not ratio:
        return ""
    rate, peak, unit = ((w["flops_per_second"], w["peak_flops"], "GFLOP/s") if kind == "flops" else
                        (w["bytes_per_second"], w["peak_bytes_per_second"], "GB/s"))
    text = f" (they ran at {giga(rate)} {unit}, {ratio:.2f}x the peak of {giga(peak)} {unit} the server takes"
    if not why:
        return text + ": counted as 100%)"
    cause = ("measured while the CPU was busy" + (", or of other arithmetic than the kernels'" if kind == "flops"
                                                  else "") + ": `conveyor profile` on a quiet machine measures it again"
             if w["on_cpu"] else "the device's table entry is below what it does")
    return text + f", so that peak is too low: {cause}; counted as 100%)"


def _compute_bound(w: dict[str, float]) -> Finding:
    """Steps near the peak of their arithmetic: on a GPU, more devices or fp8; on a CPU, integer weights where
    they are float, else more cores."""
    packed = w["on_cpu"] and w["integer_weights"] >= 0.5
    arithmetic = ("" if not w["on_cpu"] else ", in the int8 dot products of the packed-block kernels" if packed
                  else ", multiplying float weights")
    summary = f"steps run at {w['mfu']:.0%} of the device's FLOP/s{arithmetic}{_past_peak(w, 'flops')}"
    if w["bytes_past_peak"]:  # (no bandwidth-bound finding follows a compute-bound one to say it)
        summary += f"; memory at {w['mbu']:.0%} of its bandwidth{_past_peak(w, 'bytes', why=False)}"
    evidence = _pick(w, "mfu", "mbu", "tokens_per_step", "busy_fraction", "flops_per_second", "peak_flops")
    if not w["on_cpu"]:
        return Finding("compute_bound", summary, evidence, "parallel.tensor_parallel_size",
                       "the matmuls are near the device's peak: split them over devices "
                       "(parallel.tensor_parallel_size) or use faster arithmetic (quant.plugin = \"fp8\" on GPUs "
                       "with fp8 units)")
    evidence |= _pick(w, "integer_weights")
    more_cores = ("this CPU's cores are the limit: keep other processes off them ([engine] num_threads = 0 takes "
                  "one per core), add cores on other machines (pipeline stages over Ray: parallel.executor = "
                  "\"ray\", parallel.pipeline_parallel_size; or servers behind a balancer), or serve a smaller model")
    if packed:
        return Finding("compute_bound", summary, evidence, "parallel.pipeline_parallel_size", more_cores)
    return Finding("compute_bound", summary, evidence, "quant.plugin",
                   "where `conveyor profile` shows this CPU's int8 peak above its float ones (AVX2, AVX-512 VNNI), "
                   "packed integer weights multiply faster: a quantized GGUF (Q4_K_M, Q4_0, Q8_0), or quant.plugin = "
                   "\"int8\" (Q8_0 blocks) or \"int4\" for a float checkpoint; beyond that, " + more_cores)


def _bandwidth_bound(w: dict[str, float]) -> Finding:
    """Steps near the memory's bandwidth: fewer bytes a token (float weights packed; an fp8 cache) or a batch
    that shares each read among more tokens."""
    packed = w["integer_weights"] >= 0.5
    return Finding(
        "bandwidth_bound",
        f"steps read memory at {w['mbu']:.0%} of the device's bandwidth{_past_peak(w, 'bytes')}",
        _pick(w, "mbu", "mfu", "tokens_per_step", "running_mean", "bytes_per_second", "peak_bytes_per_second"),
        "kvcache.dtype" if packed else "quant.plugin",
        ("each step is bound by reading the weights and the KV cache: " + (
            "the weights are packed blocks already; " if packed else
            "quant.plugin = \"int8\" halves the weights' bytes (\"int4\": under a third), ") +
         "kvcache.dtype = \"fp8\" halves the cache's; a larger batch shares each read among more tokens"),
    )


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
