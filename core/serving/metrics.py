"""Server metrics: what users steer by, in Prometheus text at /metrics and in the status line.

Latencies are histograms (TTFT, inter-token latency, end-to-end, queue time,
engine step time); the engine's state is gauges (running, waiting, KV usage
and blocks); work done is counters (prompt and generation tokens, requests
by finish reason, preemptions, prefix-cache hits). Names follow Prometheus
conventions with the ``conveyor_`` prefix.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from conveyor.messages import EngineReady, StepStats

# seconds; fine at the low end where CPU decode steps live, up to minutes for long requests
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class ServerMetrics:
    """The metrics of one server; one registry, so several servers in one process stay apart."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r = self.registry
        labels = {"model_name": model_name}

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, ["model_name"], registry=r, buckets=LATENCY_BUCKETS).labels(**labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["model_name"], registry=r).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["model_name"], registry=r).labels(**labels)

        self.ttft = histogram("conveyor_time_to_first_token_seconds", "Time from arrival to the first token.")
        self.itl = histogram("conveyor_inter_token_latency_seconds", "Time between consecutive tokens of a request.")
        self.e2e = histogram("conveyor_e2e_request_latency_seconds", "Time from arrival to the last token.")
        self.queue_time = histogram("conveyor_request_queue_time_seconds", "Time from arrival to the first step.")
        self.step_time = histogram("conveyor_engine_step_seconds", "Duration of one engine step.")
        self.running = gauge("conveyor_num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("conveyor_num_requests_waiting", "Requests waiting to run.")
        self.kv_usage = gauge("conveyor_kv_cache_usage_ratio", "Fraction of the KV cache in use (0..1).")
        self.kv_blocks = gauge("conveyor_kv_cache_blocks", "KV cache blocks in the pool.")
        self.kv_free_blocks = gauge("conveyor_kv_cache_free_blocks", "KV cache blocks not held by any request.")
        self.max_concurrency = gauge(
            "conveyor_kv_cache_max_concurrency", "Requests of max_model_len tokens that fit in the KV cache."
        )
        self.in_flight = gauge(
            "conveyor_num_requests_in_flight", "Requests the frontend has submitted to the engine and not seen end."
        )
        self.engine_alive = gauge("conveyor_engine_alive", "1 while the engine process is up and ready.")
        self.engine_restarts = counter("conveyor_engine_restarts", "Times the engine process was restarted.")
        self.prompt_tokens = counter("conveyor_prompt_tokens", "Prompt tokens of requests that started running.")
        self.generation_tokens = counter("conveyor_generation_tokens", "Tokens generated.")
        self.preemptions = counter("conveyor_preemptions", "Running requests preempted to free KV blocks.")
        self.engine_aborts = counter(
            "conveyor_engine_aborted_requests", "Requests the engine ended before their end: aborted or failed."
        )
        self.prefix_hit_tokens = counter("conveyor_prefix_cache_hit_tokens", "Prompt tokens served from the cache.")
        self.requests = Counter(
            "conveyor_requests", "Finished requests by finish reason.", ["model_name", "finish_reason"], registry=r
        )
        self._model_name = model_name
        # cumulative engine counters last seen (preemptions, prefix hits, aborts), to turn them into increments
        self._engine_counts = (0, 0, 0)
        self._num_ready = 0
        # for the status line: token totals, and their values at the last report
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._last_report = (time.monotonic(), 0, 0)
        self.last_stats: StepStats | None = None

    def engine_ready(self, ready: EngineReady) -> None:
        self._num_ready += 1
        if self._num_ready > 1:
            self.engine_restarts.inc()
        self._engine_counts = (0, 0, 0)  # a new engine counts from zero
        self.kv_blocks.set(ready.num_kv_blocks)
        self.kv_free_blocks.set(ready.num_kv_blocks)
        self.max_concurrency.set(ready.max_concurrency)

    def engine_step(self, stats: StepStats) -> None:
        self.last_stats = stats
        self.running.set(stats.scheduler.num_running)
        self.waiting.set(stats.scheduler.num_waiting)
        self.kv_usage.set(stats.kv.usage)
        self.kv_blocks.set(stats.kv.num_blocks)
        self.kv_free_blocks.set(stats.kv.num_free_blocks)
        if stats.num_prefill_tokens or stats.num_decode_tokens:  # a step, not a snapshot after an abort
            self.step_time.observe(stats.schedule_time + stats.forward_time + stats.sample_time + stats.update_time)
        counts = (stats.scheduler.num_preemptions, stats.kv.num_prefix_hit_tokens, stats.scheduler.num_aborted)
        for counter, now, before in zip((self.preemptions, self.prefix_hit_tokens, self.engine_aborts), counts,
                                        self._engine_counts):
            counter.inc(max(0, now - before))
        self._engine_counts = counts

    def first_token(self, ttft: float, queue_time: float, num_prompt_tokens: int) -> None:
        self.ttft.observe(ttft)
        self.queue_time.observe(queue_time)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc()
        self._num_prompt_tokens += num_prompt_tokens
        self._num_generation_tokens += 1

    def next_token(self, itl: float) -> None:
        self.itl.observe(itl)
        self.generation_tokens.inc()
        self._num_generation_tokens += 1

    def request_done(self, finish_reason: str, e2e: float, num_output_tokens: int) -> None:
        self.requests.labels(self._model_name, finish_reason).inc()
        if num_output_tokens:
            self.e2e.observe(e2e)

    def render(self, engine_alive: bool, num_in_flight: int) -> bytes:
        """The Prometheus text exposition."""
        self.engine_alive.set(1 if engine_alive else 0)
        self.in_flight.set(num_in_flight)
        return generate_latest(self.registry)

    @property
    def active_since_status_line(self) -> bool:
        """Whether tokens came since the last status line."""
        _, prompt, generation = self._last_report
        return (prompt, generation) != (self._num_prompt_tokens, self._num_generation_tokens)

    def status_line(self) -> str:
        """One line: running, waiting, KV usage, and token rates since the last call."""
        now = time.monotonic()
        prompt, generation = self._num_prompt_tokens, self._num_generation_tokens
        then, last_prompt, last_generation = self._last_report
        self._last_report = (now, prompt, generation)
        elapsed = max(now - then, 1e-9)
        stats = self.last_stats
        running, waiting, usage = (
            (stats.scheduler.num_running, stats.scheduler.num_waiting, stats.kv.usage) if stats else (0, 0, 0.0)
        )
        return (
            f"running {running}, waiting {waiting}, KV {usage:.1%}, "
            f"prompt {(prompt - last_prompt) / elapsed:.1f} tok/s, generation {(generation - last_generation) / elapsed:.1f} tok/s"
        )
