"""Server metrics: what users steer by, in Prometheus text at /metrics and in the status line.

Latencies are histograms (TTFT, inter-token latency, end-to-end, queue time,
engine step time); the engine's state is gauges (running, waiting, KV usage
and blocks); work done is counters (prompt and generation tokens, requests
by finish reason, preemptions, prefix-cache hits). Names follow Prometheus
conventions with the ``conveyor_`` prefix.

With data parallelism (several engine replicas), the gauges and counters
that describe one engine (running, waiting, KV usage and blocks, alive,
restarts) carry a ``replica`` label ("0", "1", ...), and
``conveyor_replica_requests_total`` counts the requests each replica's engine
ended; request latencies and token counters stay global. With one engine the
exposition has no ``replica`` label at all.

Engines with several workers (tensor/pipeline parallelism) add, from their steps
only: per-step histograms of the time in collectives and transfers vs compute and
of the pipeline's bubble fraction (global, like the engine step time), each
worker's step time and its seconds in communication and in pipeline waits
labelled by ``rank`` (and ``replica``), the collectives and their bytes, and a
smoothed bubble gauge per engine. A single-worker server exports these
families without samples (and its parallel sizes as 1).

Engines on CUDA add NVML's utilization and memory per GPU where nvidia-ml-py and the
driver are there (``conveyor.serving.nvml``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from conveyor.messages import EngineReady, StepStats
from conveyor.serving.dashboard import DashboardFeed
from conveyor.serving.metric_series import FRACTION_BUCKETS, LATENCY_BUCKETS, PARALLEL_BUCKETS, Series
from conveyor.serving.nvml import GpuGauges
from conveyor.serving.request_fields import UnknownFields
from conveyor.serving.status_line import StatusLine
from conveyor.serving.tier_metrics import TierMetrics

# seconds: time constant of the smoothed bubble gauge (a step's weight falls by e every this many seconds)
BUBBLE_SMOOTHING_S = 10.0


class ServerMetrics(StatusLine):
    """The metrics of one server; one registry, so several servers in one process stay apart.

    Args:
        model_name: the ``model_name`` label of every metric.
        num_replicas: engine replicas (data parallelism); above 1, per-engine metrics get a ``replica`` label.
        replica_alive: with several replicas, whether replica i is up now (read at each scrape).
        replica_in_flight: with several replicas, the requests the frontend routed to replica i that have not
            ended (read at each scrape).
    """

    def __init__(self, model_name: str, num_replicas: int = 1, replica_alive: Callable[[int], bool] | None = None,
                 replica_in_flight: Callable[[int], int] | None = None):
        self.registry = CollectorRegistry()
        self.num_replicas = num_replicas
        self._replica_alive = replica_alive
        self._replica_in_flight = replica_in_flight

        s = Series(self.registry, model_name, num_replicas)
        self._latencies(s)
        self._engine_state(s)
        self._utilization(s)
        self._targets(s)
        self._parallel(s)
        # per replica: (timestamp, smoothed bubble fraction) after its latest multi-worker step
        self._bubble_state: list[tuple[float, float] | None] = [None] * num_replicas
        self._model_name = model_name
        # per replica: cumulative engine counters last seen (preemptions, prefix hits, aborts, finished),
        # to turn them into increments
        self._engine_counts = [(0,) * 7] * num_replicas
        self._num_ready = [0] * num_replicas
        # for the status line: token totals, and their values at the last report
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._last_report = (time.monotonic(), 0, 0)
        # what /dashboard shows (and each replica's latest step stats)
        self.dashboard = DashboardFeed(num_replicas)
        # NVML's GPU utilization and memory, once an engine runs on CUDA (None: not started or not available)
        self.gpus: GpuGauges | None = None
        self._nvml_tried = False
        self.tiers = TierMetrics(self.registry, model_name, num_replicas)

    def _latencies(self, s: Series) -> None:
        """The request latencies, the step time and its stages."""

        def latency(name: str, doc: str) -> Histogram:
            return s.histogram(name, doc, LATENCY_BUCKETS)

        self.ttft = latency("conveyor_time_to_first_token_seconds", "Time from arrival to the first token.")
        self.itl = latency("conveyor_inter_token_latency_seconds", "Time between consecutive tokens of a request.")
        self.e2e = latency("conveyor_e2e_request_latency_seconds", "Time from arrival to the last token.")
        self.queue_time = latency("conveyor_request_queue_time_seconds", "Time from arrival to the first step.")
        self.step_time = latency("conveyor_engine_step_seconds", "Duration of one engine step.")
        self.stage_seconds = Counter(
            "conveyor_step_stage_seconds", "Seconds of the engine's steps by stage: schedule (choosing the batch), "
            "forward (building inputs and the forward pass), sample, update (recording the results).",
            ["model_name", "stage"], registry=s.registry,
        )
        self._stages = {stage: self.stage_seconds.labels(s.model_name, stage)
                        for stage in ("schedule", "forward", "sample", "update")}

    def _engine_state(self, s: Series) -> None:
        """Each engine's state and what it has done, and the requests by how they ended."""
        # per engine replica (one list entry each)
        self.steps = s.per_engine(Counter, "conveyor_engine_steps", "Steps the engine ran.")
        self.running = s.per_engine(Gauge, "conveyor_num_requests_running", "Requests in the running batch.")
        self.waiting = s.per_engine(Gauge, "conveyor_num_requests_waiting", "Requests waiting to run.")
        self.kv_usage = s.per_engine(Gauge, "conveyor_kv_cache_usage_ratio", "Fraction of the KV cache in use (0..1).")
        self.kv_blocks = s.per_engine(Gauge, "conveyor_kv_cache_blocks", "KV cache blocks in the pool.")
        self.kv_free_blocks = s.per_engine(
            Gauge, "conveyor_kv_cache_free_blocks", "KV cache blocks not held by any request."
        )
        self.max_concurrency = s.per_engine(
            Gauge, "conveyor_kv_cache_max_concurrency", "Requests of max_model_len tokens that fit in the KV cache."
        )
        self.in_flight = s.gauge(
            "conveyor_num_requests_in_flight", "Requests the frontend has submitted to the engine and not seen end."
        )
        self.engine_alive = s.per_engine(Gauge, "conveyor_engine_alive", "1 while the engine process is up and ready.")
        self.engine_restarts = s.per_engine(Counter, "conveyor_engine_restarts",
                                            "Times the engine process was restarted.")
        self.prompt_tokens = s.counter("conveyor_prompt_tokens", "Prompt tokens of requests that started running.")
        self.generation_tokens = s.counter("conveyor_generation_tokens", "Tokens generated.")
        self.preemptions = s.counter("conveyor_preemptions", "Running requests preempted to free KV blocks.")
        self.engine_aborts = s.counter(
            "conveyor_engine_aborted_requests", "Requests the engine ended before their end: aborted or failed."
        )
        self.prefix_hit_tokens = s.counter("conveyor_prefix_cache_hit_tokens", "Prompt tokens served from the cache.")
        self.rejected = s.counter(
            "conveyor_rejected_requests", "Requests the engine refused on arrival (429: its waiting queue was full)."
        )
        self.draft_tokens = s.counter("conveyor_spec_draft_tokens",
                                      "Speculative decoding: tokens proposed and checked.")
        self.accepted_tokens = s.counter(
            "conveyor_spec_accepted_tokens",
            "Speculative decoding: proposed tokens the model accepted (acceptance rate: this over draft tokens).",
        )
        self.requests = Counter(
            "conveyor_requests", "Finished requests by finish reason.", ["model_name", "finish_reason"],
            registry=s.registry,
        )
        self.unknown_fields = UnknownFields(s.registry, s.model_name)
        self.replica_requests = (
            s.per_engine(Counter, "conveyor_replica_requests", "Requests each engine replica ended, by its own count.")
            if s.num_replicas > 1 else []
        )
        self.replica_in_flight = (
            s.per_engine(Gauge, "conveyor_replica_requests_in_flight",
                       "Requests the frontend routed to each engine replica that have not ended.")
            if s.num_replicas > 1 and self._replica_in_flight is not None else []
        )

    def _utilization(self, s: Series) -> None:
        """What steps computed and moved, against the devices' peaks; the weights by format."""
        # what steps computed and moved, against the devices' peaks (conveyor.perf.roofline, .peaks)
        self.mfu = Histogram("conveyor_step_mfu", "Model FLOPs utilization of a step's forward pass (0..1).",
                             ["model_name"], registry=s.registry, buckets=FRACTION_BUCKETS).labels(s.model_name)
        self.mbu = Histogram("conveyor_step_mbu", "Memory-bandwidth utilization of a step's forward pass (0..1).",
                             ["model_name"], registry=s.registry, buckets=FRACTION_BUCKETS).labels(s.model_name)
        self.flops = s.counter("conveyor_model_flops", "FLOPs of the steps' forward passes (matmuls and attention).")
        self.bytes_moved = s.counter("conveyor_bytes_moved", "Bytes the steps' forward passes read and wrote.")
        self.forward_seconds = s.counter("conveyor_forward_seconds", "Seconds in the steps' forward passes.")
        self.peak_flops = s.per_engine(
            Gauge, "conveyor_device_peak_flops", "Dense FLOP/s the engine's devices reach at most in the arithmetic "
            "the weights are multiplied in (on a CPU, int8 dot products for packed blocks)."
        )
        self.peak_bandwidth = s.per_engine(
            Gauge, "conveyor_device_peak_bytes_per_second", "Memory bandwidth of the engine's devices, bytes/s."
        )
        # (labeled replica="i" as per_engine's are, where there are several)
        self._replica_label = s.num_replicas > 1
        # which device the peaks are of: the doctor's advice fits it (no GPU features on a CPU)
        self.device_info = Gauge(
            "conveyor_device_info", "1 for the device an engine runs on (device: cpu, cuda:0), whose peaks MFU and "
            "MBU are taken against.", ["model_name", *(["replica"] if self._replica_label else []), "device"],
            registry=s.registry,
        )
        self.weight_bytes = Gauge(
            "conveyor_weight_bytes", "Bytes of the linear layers, embedding and head by the format each is kept in "
            "(a GGUF block type, a dtype or a quant method; copies: second copies for decode steps).",
            ["model_name", *(["replica"] if self._replica_label else []), "format"], registry=s.registry,
        )

    def _targets(self, s: Series) -> None:
        """The latency targets and the requests within and past them."""
        # latency targets ([scheduler] ttft_slo_ms, itl_slo_ms): goodput is the rate of requests_within_slo
        self.within_slo = s.counter(
            "conveyor_requests_within_slo", "Requests that ended (stop or length) with their first token within the "
            "TTFT target and the P99 of their inter-token gaps within the ITL target (goodput: its rate).",
        )
        self.missed_slo = Counter(
            "conveyor_requests_missed_slo", "Requests that ended (stop or length) past a latency target, by target "
            "(ttft or itl; a request past both counts in each).", ["model_name", "target"], registry=s.registry,
        )
        self.slo_target = Gauge(
            "conveyor_slo_target_seconds", "The scheduler's latency targets (P99; 0: none), for requests of "
            "priority 0.", ["model_name", "target"], registry=s.registry,
        )

    def _parallel(self, s: Series) -> None:
        """Engines with several workers: communication, compute and the pipeline's bubbles."""
        # several workers: children appear with the first multi-worker step (see ``_parallel_step``)
        engine_labels = ["model_name", "replica"] if s.num_replicas > 1 else ["model_name"]
        self.comm_time = Histogram(
            "conveyor_step_comm_seconds",
            "Per multi-worker step: mean seconds a worker spent in collectives and transfers.",
            ["model_name"], registry=s.registry, buckets=PARALLEL_BUCKETS,
        )
        self.compute_time = Histogram(
            "conveyor_step_compute_seconds",
            "Per multi-worker step: mean seconds a worker computed (its step time less communication and "
            "pipeline waits).",
            ["model_name"], registry=s.registry, buckets=PARALLEL_BUCKETS,
        )
        self.worker_step_time = Histogram(
            "conveyor_worker_step_seconds",
            "Seconds each worker (rank = pp_stage * tp_size + tp_rank) spent on a step, communication and waits "
            "included.",
            [*engine_labels, "rank"], registry=s.registry, buckets=PARALLEL_BUCKETS,
        )
        self.worker_comm_seconds = Counter(
            "conveyor_worker_comm_seconds", "Seconds each worker spent in collectives and transfers.",
            [*engine_labels, "rank"], registry=s.registry,
        )
        self.worker_wait_seconds = Counter(
            "conveyor_worker_wait_seconds", "Seconds each worker spent waiting for the previous pipeline stage.",
            [*engine_labels, "rank"], registry=s.registry,
        )
        self.collectives = s.counter(
            "conveyor_collectives", "All-reduces and gathers within a tensor-parallel group (a worker's, the "
            "mean over workers, summed over steps).",
        )
        self.collective_bytes = s.counter(
            "conveyor_collective_bytes", "Bytes a worker sent in collectives (the mean over workers, summed over "
            "steps).",
        )
        self.tp_size = s.per_engine(Gauge, "conveyor_tensor_parallel_size", "Workers in each pipeline stage.")
        self.pp_size = s.per_engine(Gauge, "conveyor_pipeline_parallel_size", "Pipeline stages.")
        self.bubble = Histogram(
            "conveyor_step_bubble_fraction",
            "Per multi-worker step: share of the workers' time spent waiting for the previous pipeline stage.",
            ["model_name"], registry=s.registry, buckets=FRACTION_BUCKETS,
        )
        self.bubble_smoothed = Gauge(
            "conveyor_pipeline_bubble_fraction",
            f"Pipeline bubble fraction, exponentially smoothed over steps with a {BUBBLE_SMOOTHING_S:g} s time "
            "constant.",
            engine_labels, registry=s.registry,
        )

    def engine_ready(self, ready: EngineReady, replica: int = 0) -> None:
        """An engine (replica ``replica``) is ready: the first time, or after a restart."""
        self._num_ready[replica] += 1
        if self._num_ready[replica] > 1:
            self.engine_restarts[replica].inc()
        self._engine_counts[replica] = (0,) * 7  # a new engine counts from zero
        self.tiers.engine_ready(replica)
        self.dashboard.engine_ready(replica)
        for gauge in (self.running, self.waiting, self.kv_usage):  # (an engine that died left its last values)
            gauge[replica].set(0)
        self._bubble_state[replica] = None
        self.kv_blocks[replica].set(ready.num_kv_blocks)
        self.kv_free_blocks[replica].set(ready.num_kv_blocks)
        self.max_concurrency[replica].set(ready.max_concurrency)
        self.peak_flops[replica].set(ready.peak_flops)
        self.peak_bandwidth[replica].set(ready.peak_bytes_per_second)
        if ready.device:  # (an engine that names no device leaves the advice general)
            replica_label = {"replica": str(replica)} if self._replica_label else {}
            self.device_info.labels(model_name=self._model_name, device=ready.device, **replica_label).set(1)
        self.tp_size[replica].set(ready.tensor_parallel_size)
        self.pp_size[replica].set(ready.pipeline_parallel_size)
        for format, n in ready.weight_formats.items():
            replica_label = {"replica": str(replica)} if self._replica_label else {}
            self.weight_bytes.labels(model_name=self._model_name, format=format, **replica_label).set(n)
        if ready.device.startswith("cuda") and not self._nvml_tried:
            self._nvml_tried = True
            self.gpus = GpuGauges.start(self.registry, self._model_name)

    def engine_step(self, stats: StepStats, replica: int = 0) -> None:
        """A step's stats (or a snapshot between steps) from engine replica ``replica``."""
        self.dashboard.step(stats, replica)
        self.running[replica].set(stats.scheduler.num_running)
        self.waiting[replica].set(stats.scheduler.num_waiting)
        self.kv_usage[replica].set(stats.kv.usage)
        self.kv_blocks[replica].set(stats.kv.num_blocks)
        self.kv_free_blocks[replica].set(stats.kv.num_free_blocks)
        if stats.connector is not None:
            self.tiers.observe(stats.connector, replica)
        if stats.num_prefill_tokens or stats.num_decode_tokens:  # a step, not a snapshot after an abort
            self.step_time.observe(stats.schedule_time + stats.forward_time + stats.sample_time + stats.update_time)
            self.steps[replica].inc()
            for stage, seconds in (("schedule", stats.schedule_time), ("forward", stats.forward_time),
                                   ("sample", stats.sample_time), ("update", stats.update_time)):
                self._stages[stage].inc(seconds)
            self.flops.inc(stats.flops)
            self.bytes_moved.inc(stats.bytes_moved)
            self.forward_seconds.inc(stats.forward_time)
            if stats.mfu or stats.mbu:
                self.mfu.observe(stats.mfu)
                self.mbu.observe(stats.mbu)
            if stats.rank_times:
                self._parallel_step(stats, replica)
        scheduler = stats.scheduler
        counts = (scheduler.num_preemptions, stats.kv.num_prefix_hit_tokens, scheduler.num_aborted,
                  scheduler.num_draft_tokens, scheduler.num_accepted_tokens, scheduler.num_rejected,
                  scheduler.num_finished + scheduler.num_aborted)
        counters = [self.preemptions, self.prefix_hit_tokens, self.engine_aborts, self.draft_tokens, self.accepted_tokens,
                    self.rejected]
        if self.replica_requests:
            counters.append(self.replica_requests[replica])
        for counter, now, before in zip(counters, counts, self._engine_counts[replica]):
            counter.inc(max(0, now - before))
        self._engine_counts[replica] = counts

    def _parallel_step(self, stats: StepStats, replica: int) -> None:
        """The parallel metrics of one step of a multi-worker engine."""
        mean_rank_time = sum(stats.rank_times) / len(stats.rank_times)
        # NOTE: a rank's time holds its communication and its waits for the previous stage; compute is the rest
        # (the mean wait is bubble_fraction x the mean rank time, since the fraction is sum(wait) / sum(busy))
        compute = mean_rank_time * (1 - stats.bubble_fraction) - stats.comm_time
        self.comm_time.labels(self._model_name).observe(stats.comm_time)
        self.compute_time.labels(self._model_name).observe(max(0.0, compute))
        self.bubble.labels(self._model_name).observe(stats.bubble_fraction)
        engine = [self._model_name, str(replica)] if self.num_replicas > 1 else [self._model_name]
        for rank, seconds in enumerate(stats.rank_times):
            self.worker_step_time.labels(*engine, str(rank)).observe(seconds)
        for rank, (comm, wait) in enumerate(zip(stats.rank_comm, stats.rank_wait)):
            self.worker_comm_seconds.labels(*engine, str(rank)).inc(comm)
            self.worker_wait_seconds.labels(*engine, str(rank)).inc(wait)
        self.collectives.inc(stats.num_collectives)
        self.collective_bytes.inc(stats.collective_bytes)
        previous = self._bubble_state[replica]
        if previous is None:
            smoothed = stats.bubble_fraction
        else:
            then, value = previous
            weight = 1 - math.exp(-max(stats.timestamp - then, 0.0) / BUBBLE_SMOOTHING_S)
            smoothed = value + weight * (stats.bubble_fraction - value)
        self._bubble_state[replica] = (stats.timestamp, smoothed)
        self.bubble_smoothed.labels(*engine).set(smoothed)

    def first_token(self, ttft: float, queue_time: float, num_prompt_tokens: int, num_tokens: int = 1) -> None:
        """A request's first output: ``num_tokens`` tokens (more than one where drafts were accepted)."""
        self.ttft.observe(ttft)
        self.dashboard.first_token(ttft, num_tokens)
        self.queue_time.observe(queue_time)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_tokens)
        self._num_prompt_tokens += num_prompt_tokens
        self._num_generation_tokens += num_tokens

    def next_token(self, itl: float, num_tokens: int = 1) -> None:
        """A later output, ``itl`` seconds after the one before: one latency sample, ``num_tokens`` tokens."""
        self.itl.observe(itl)
        self.dashboard.next_token(itl, num_tokens)
        self.generation_tokens.inc(num_tokens)
        self._num_generation_tokens += num_tokens

    def request_done(self, finish_reason: str, e2e: float, num_output_tokens: int) -> None:
        self.requests.labels(self._model_name, finish_reason).inc()
        if num_output_tokens:
            self.e2e.observe(e2e)

    def set_targets(self, ttft_s: float, itl_s: float) -> None:
        self.slo_target.labels(self._model_name, "ttft").set(ttft_s)
        self.slo_target.labels(self._model_name, "itl").set(itl_s)

    def request_slo(self, met_ttft: bool, met_itl: bool) -> None:
        """A request that ended normally, judged against its targets (``conveyor.scheduling.slo.met_targets``)."""
        if met_ttft and met_itl:
            self.within_slo.inc()
            self.dashboard.within_slo()
        for target, met in (("ttft", met_ttft), ("itl", met_itl)):
            if not met:
                self.missed_slo.labels(self._model_name, target).inc()

    def render(self, engine_alive: bool, num_in_flight: int) -> bytes:
        """The Prometheus text exposition."""
        for replica, gauge in enumerate(self.engine_alive):
            alive = self._replica_alive(replica) if self._replica_alive is not None else engine_alive
            gauge.set(1 if alive else 0)
        self.in_flight.set(num_in_flight)
        for replica, gauge in enumerate(self.replica_in_flight):
            gauge.set(self._replica_in_flight(replica))
        if self.gpus is not None:
            self.gpus.update()
        return generate_latest(self.registry)
