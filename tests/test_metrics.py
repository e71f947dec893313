"""Every metric the server exports moves as the traffic that feeds it says (read back from the Prometheus text)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from conveyor.messages import EngineReady, KVCacheStats, SchedulerStats, StepStats
from conveyor.serving.metrics import ServerMetrics

MODEL = "tiny"


class Exposition:
    """The metrics as a scraper sees them, and which families a test has looked at."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.read: set[str] = set()

    def __call__(self, name: str, alive: bool = True, in_flight: int = 0, **labels: str) -> float:
        text = self.metrics.render(alive, in_flight).decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and sample.labels == {"model_name": MODEL, **labels}:
                    self.read.add(family.name)
                    return sample.value
        return 0.0

    def families(self) -> set[str]:
        """Every metric exported (not the ``_created`` timestamps prometheus_client adds beside counters)."""
        text = self.metrics.render(True, 0).decode()
        return {f.name for f in text_string_to_metric_families(text) if not f.name.endswith("_created")}


def stats(step: int, tokens: int, preemptions: int = 0, aborted: int = 0, hits: int = 0, free: int = 30) -> StepStats:
    return StepStats(
        step, 0.0, SchedulerStats(num_running=3, num_waiting=2, num_preemptions=preemptions, num_aborted=aborted),
        KVCacheStats(usage=1 - free / 50, num_blocks=50, num_free_blocks=free, num_prefix_hit_tokens=hits),
        num_prefill_tokens=tokens, schedule_time=0.001, forward_time=0.02, sample_time=0.003, update_time=0.001,
    )


def test_every_metric_moves_with_its_traffic():
    metrics = ServerMetrics(MODEL)
    value = Exposition(metrics)

    metrics.engine_ready(EngineReady(pid=1, max_model_len=256, num_kv_blocks=50, block_size=16,
                                     max_concurrency=3.125, load_time=1.0))
    assert value("conveyor_kv_cache_blocks") == 50 and value("conveyor_kv_cache_free_blocks") == 50
    assert value("conveyor_kv_cache_max_concurrency") == 3.125
    assert value("conveyor_engine_restarts_total") == 0

    # a step: the engine's gauges follow it, its cumulative counts become increments
    metrics.engine_step(stats(1, tokens=40, preemptions=1, aborted=1, hits=32, free=30))
    assert value("conveyor_num_requests_running") == 3 and value("conveyor_num_requests_waiting") == 2
    assert value("conveyor_kv_cache_usage_ratio") == 0.4 and value("conveyor_kv_cache_free_blocks") == 30
    assert value("conveyor_engine_step_seconds_count") == 1
    assert abs(value("conveyor_engine_step_seconds_sum") - 0.025) < 1e-9
    assert value("conveyor_preemptions_total") == 1
    assert value("conveyor_engine_aborted_requests_total") == 1
    assert value("conveyor_prefix_cache_hit_tokens_total") == 32
    # a snapshot between steps (after an abort): gauges move, no step is counted, counters add only what is new
    metrics.engine_step(stats(1, tokens=0, preemptions=3, aborted=2, hits=32, free=50))
    assert value("conveyor_kv_cache_free_blocks") == 50
    assert value("conveyor_engine_step_seconds_count") == 1
    assert value("conveyor_preemptions_total") == 3 and value("conveyor_engine_aborted_requests_total") == 2
    assert value("conveyor_prefix_cache_hit_tokens_total") == 32
    # a restarted engine counts from zero again; the server's totals keep going
    metrics.engine_ready(EngineReady(pid=2, max_model_len=256, num_kv_blocks=50, block_size=16,
                                     max_concurrency=3.125, load_time=1.0))
    assert value("conveyor_engine_restarts_total") == 1
    metrics.engine_step(stats(1, tokens=8, preemptions=1, hits=16))
    assert value("conveyor_preemptions_total") == 4 and value("conveyor_prefix_cache_hit_tokens_total") == 48

    # one request: its first token, a second, and its end
    metrics.first_token(ttft=0.5, queue_time=0.125, num_prompt_tokens=20)
    assert value("conveyor_time_to_first_token_seconds_count") == 1
    assert value("conveyor_time_to_first_token_seconds_sum") == 0.5
    assert value("conveyor_request_queue_time_seconds_sum") == 0.125
    assert value("conveyor_prompt_tokens_total") == 20 and value("conveyor_generation_tokens_total") == 1
    metrics.next_token(itl=0.04)
    assert value("conveyor_inter_token_latency_seconds_count") == 1
    assert value("conveyor_inter_token_latency_seconds_sum") == 0.04
    assert value("conveyor_generation_tokens_total") == 2
    metrics.request_done("length", e2e=2.0, num_output_tokens=2)
    metrics.request_done("abort", e2e=1.0, num_output_tokens=0)  # never produced a token: no latency to record
    assert value("conveyor_requests_total", finish_reason="length") == 1
    assert value("conveyor_requests_total", finish_reason="abort") == 1
    assert value("conveyor_e2e_request_latency_seconds_count") == 1
    assert value("conveyor_e2e_request_latency_seconds_sum") == 2.0

    # what the frontend knows at scrape time
    assert value("conveyor_engine_alive", alive=True) == 1 and value("conveyor_engine_alive", alive=False) == 0
    assert value("conveyor_num_requests_in_flight", in_flight=4) == 4

    assert value.read == value.families(), f"metrics without a check: {value.families() - value.read}"


def test_the_status_line_reports_rates_since_the_last_line():
    metrics = ServerMetrics(MODEL)
    metrics.engine_step(stats(1, tokens=40))
    metrics.first_token(ttft=0.1, queue_time=0.0, num_prompt_tokens=100)
    assert metrics.active_since_status_line
    line = metrics.status_line()
    assert not metrics.active_since_status_line
    assert line.startswith("running 3, waiting 2, KV 40.0%, prompt ")
    rate = float(line.split("prompt ")[1].split(" tok/s")[0])
    assert rate > 0
    # nothing new since: the rates fall to zero
    assert "prompt 0.0 tok/s, generation 0.0 tok/s" in metrics.status_line()
