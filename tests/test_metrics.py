"""Every metric the server exports moves as the traffic that feeds it says (read back from the Prometheus text)."""

from __future__ import annotations

import math
import time
from contextlib import aclosing

import anyio
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conveyor.engine.client import EngineUnavailable
from conveyor.messages import EngineReady, KVCacheStats, RequestOutput, SchedulerStats, StepStats
from conveyor.sampling import SamplingParams
from conveyor.serving.dashboard import DashboardFeed
from conveyor.serving.metrics import ServerMetrics
from conveyor.transport import RequestError

MODEL = "tiny"


class Exposition:
    """The metrics as a scraper sees them, and which families a test has looked at."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.read: set[str] = set()

    def __call__(self, name: str, alive: bool = True, in_flight: int = 0, **labels: str) -> float:
        """The sample's value; a sample that is not exported is a KeyError (so "exported as 0" is not "absent")."""
        text = self.metrics.render(alive, in_flight).decode()
        exported = []
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and sample.labels == {"model_name": MODEL, **labels}:
                    self.read.add(family.name)
                    return sample.value
                if sample.name == name:
                    exported.append(sample.labels)
        raise KeyError(f"no sample {name} with labels {labels}; exported: {exported}")

    def families(self, with_samples: bool = True) -> set[str]:
        """Every metric exported (not the ``_created`` timestamps prometheus_client adds beside counters); by
        default only those with samples (the parallel ones have none until a multi-worker step)."""
        text = self.metrics.render(True, 0).decode()
        return {
            f.name for f in text_string_to_metric_families(text)
            if not f.name.endswith("_created") and (f.samples or not with_samples)
        }


def stats(step: int, tokens: int, preemptions: int = 0, aborted: int = 0, hits: int = 0, free: int = 30,
          drafted: int = 0, accepted: int = 0, rejected: int = 0) -> StepStats:
    return StepStats(
        step, 0.0, SchedulerStats(num_running=3, num_waiting=2, num_preemptions=preemptions, num_aborted=aborted,
                                  num_draft_tokens=drafted, num_accepted_tokens=accepted, num_rejected=rejected),
        KVCacheStats(usage=1 - free / 50, num_blocks=50, num_free_blocks=free, num_prefix_hit_tokens=hits),
        num_prefill_tokens=tokens, schedule_time=0.001, forward_time=0.02, sample_time=0.003, update_time=0.001,
        flops=1e9 * tokens, bytes_moved=5e8, mfu=0.25, mbu=0.5,
    )


def test_every_metric_moves_with_its_traffic():
    metrics = ServerMetrics(MODEL)
    value = Exposition(metrics)

    metrics.engine_ready(EngineReady(pid=1, max_model_len=256, num_kv_blocks=50, block_size=16,
                                     max_concurrency=3.125, load_time=1.0, peak_flops=2e12, peak_bytes_per_second=2.5e10,
                                     quant="auto", weight_formats={"Q4_1": 66_355_200, "Q8_0": 30_081_024},
                                     device="cpu"))
    assert value("conveyor_kv_cache_blocks") == 50 and value("conveyor_kv_cache_free_blocks") == 50
    assert value("conveyor_weight_bytes", format="Q4_1") == 66_355_200
    assert value("conveyor_weight_bytes", format="Q8_0") == 30_081_024
    with pytest.raises(KeyError):  # a format the weights are not kept in has no sample (not a zero)
        value("conveyor_weight_bytes", format="F16")
    assert value("conveyor_device_peak_flops") == 2e12 and value("conveyor_device_peak_bytes_per_second") == 2.5e10
    assert value("conveyor_device_info", device="cpu") == 1
    assert value("conveyor_kv_cache_max_concurrency") == 3.125
    assert value("conveyor_engine_restarts_total") == 0
    assert value("conveyor_tensor_parallel_size") == 1 and value("conveyor_pipeline_parallel_size") == 1

    # a step: the engine's gauges follow it, its cumulative counts become increments
    metrics.engine_step(stats(1, tokens=40, preemptions=1, aborted=1, hits=32, free=30, drafted=10, accepted=7,
                              rejected=2))
    assert value("conveyor_num_requests_running") == 3 and value("conveyor_num_requests_waiting") == 2
    assert value("conveyor_kv_cache_usage_ratio") == 0.4 and value("conveyor_kv_cache_free_blocks") == 30
    assert value("conveyor_engine_step_seconds_count") == 1 and value("conveyor_engine_steps_total") == 1
    assert abs(value("conveyor_engine_step_seconds_sum") - 0.025) < 1e-9
    for stage, seconds in {"schedule": 0.001, "forward": 0.02, "sample": 0.003, "update": 0.001}.items():
        assert value("conveyor_step_stage_seconds_total", stage=stage) == seconds
    assert value("conveyor_preemptions_total") == 1 and value("conveyor_rejected_requests_total") == 2
    assert value("conveyor_engine_aborted_requests_total") == 1
    assert value("conveyor_prefix_cache_hit_tokens_total") == 32
    assert value("conveyor_spec_draft_tokens_total") == 10 and value("conveyor_spec_accepted_tokens_total") == 7
    assert value("conveyor_model_flops_total") == 4e10 and value("conveyor_bytes_moved_total") == 5e8
    assert value("conveyor_forward_seconds_total") == 0.02
    assert value("conveyor_step_mfu_count") == 1 and value("conveyor_step_mfu_sum") == 0.25
    assert value("conveyor_step_mfu_bucket", le="0.2") == 0 and value("conveyor_step_mfu_bucket", le="0.3") == 1
    assert value("conveyor_step_mbu_sum") == 0.5
    assert value("conveyor_collectives_total") == 0 and value("conveyor_collective_bytes_total") == 0  # (one worker)
    # a snapshot between steps (after an abort): gauges move, no step is counted, counters add only what is new
    metrics.engine_step(stats(1, tokens=0, preemptions=3, aborted=2, hits=32, free=50, rejected=5))
    assert value("conveyor_kv_cache_free_blocks") == 50 and value("conveyor_rejected_requests_total") == 5
    assert value("conveyor_engine_step_seconds_count") == 1 and value("conveyor_step_mfu_count") == 1
    assert value("conveyor_model_flops_total") == 4e10
    assert value("conveyor_preemptions_total") == 3 and value("conveyor_engine_aborted_requests_total") == 2
    assert value("conveyor_prefix_cache_hit_tokens_total") == 32
    # a restarted engine counts from zero again; the server's totals keep going
    metrics.engine_ready(EngineReady(pid=2, max_model_len=256, num_kv_blocks=50, block_size=16,
                                     max_concurrency=3.125, load_time=1.0, tensor_parallel_size=2,
                                     pipeline_parallel_size=3))
    assert value("conveyor_engine_restarts_total") == 1
    assert value("conveyor_tensor_parallel_size") == 2 and value("conveyor_pipeline_parallel_size") == 3
    # nothing runs on the new engine yet (the old one's last gauges are gone, from the status line too)
    assert value("conveyor_num_requests_running") == 0 and value("conveyor_num_requests_waiting") == 0
    assert value("conveyor_kv_cache_usage_ratio") == 0
    assert metrics.status_line().startswith("running 0, waiting 0, KV 0.0%")
    metrics.engine_step(stats(1, tokens=8, preemptions=1, hits=16, drafted=4, accepted=1))
    assert value("conveyor_preemptions_total") == 4 and value("conveyor_prefix_cache_hit_tokens_total") == 48
    assert value("conveyor_spec_draft_tokens_total") == 14 and value("conveyor_spec_accepted_tokens_total") == 8

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

    # latency targets: shown, and the requests that ended judged against them (a request past both counts in each)
    metrics.set_targets(2.0, 0.15)
    assert value("conveyor_slo_target_seconds", target="ttft") == 2.0
    assert value("conveyor_slo_target_seconds", target="itl") == 0.15
    metrics.request_slo(True, True)
    metrics.request_slo(True, False)
    metrics.request_slo(False, False)
    assert value("conveyor_requests_within_slo_total") == 1
    assert value("conveyor_requests_missed_slo_total", target="ttft") == 1
    assert value("conveyor_requests_missed_slo_total", target="itl") == 2

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


class ScriptedEngine:
    """An engine client that answers every request with the outputs given (or raises ``refusal``)."""

    alive = True
    max_model_len = 256

    def __init__(self, outputs: list[RequestOutput], refusal: Exception | None = None):
        self.outputs = outputs
        self.refusal = refusal

    async def generate(self, request):
        if self.refusal is not None:
            raise self.refusal
        for output in self.outputs:
            yield msgspec.structs.replace(output, request_id=request.request_id)

    def abort(self, request_id: str) -> None:
        pass

    def end_at_stop_string(self, request_id: str) -> None:
        pass


def served(engine: ScriptedEngine, tokenizer, clock=time.time) -> tuple[ServerMetrics, list, Exception | None]:
    """One request through the frontend (its dashboard on ``clock``): the metrics, its chunks, and the error it
    ended with."""
    from conveyor.serving.frontend import EngineFrontend

    metrics = ServerMetrics(MODEL)
    metrics.dashboard = DashboardFeed(clock=clock)
    frontend = EngineFrontend(engine, tokenizer, MODEL, metrics)

    async def run():
        chunks = []
        try:
            async with aclosing(frontend.generate([1, 2, 3], SamplingParams(max_tokens=6), request_id="r")) as it:
                async for chunk in it:
                    chunks.append(chunk)
        except RequestError as e:
            return chunks, e
        return chunks, None

    return metrics, *anyio.run(run)


def test_outputs_of_several_tokens_count_every_token(tokenizer):
    """Speculative decoding: a step's output carries the accepted drafts and the sampled token. Every token is
    a generated one; each output after the first is one inter-token latency sample."""
    engine = ScriptedEngine([RequestOutput("", [5]), RequestOutput("", [6, 7, 8]),
                             RequestOutput("", [9, 10], finish_reason="length")])
    clock = [1000.5]
    metrics, chunks, error = served(engine, tokenizer, lambda: clock[0])
    value = Exposition(metrics)
    assert error is None and chunks[-1].num_output_tokens == 6
    assert value("conveyor_generation_tokens_total") == 6 and value("conveyor_prompt_tokens_total") == 3
    assert value("conveyor_inter_token_latency_seconds_count") == 2
    assert value("conveyor_requests_total", finish_reason="length") == 1
    # the dashboard's output tok/s too, once the second they came in has passed
    clock[0] += 1
    assert metrics.dashboard.snapshot()["series"]["output_tokens_per_s"] == [6]


def test_a_request_the_engine_never_took_is_no_finished_request(tokenizer):
    """Refused at submission (the engine restarting: 503): not counted as an aborted request."""
    metrics, chunks, error = served(ScriptedEngine([], EngineUnavailable("the engine is not running")), tokenizer)
    assert chunks == [] and error.status == 503
    with pytest.raises(KeyError):
        Exposition(metrics)("conveyor_requests_total", finish_reason="abort")


# ---------------------------------------------------------------- several workers (tensor/pipeline parallelism)

PARALLEL = {"conveyor_step_comm_seconds", "conveyor_step_compute_seconds", "conveyor_worker_step_seconds",
            "conveyor_step_bubble_fraction", "conveyor_pipeline_bubble_fraction", "conveyor_worker_comm_seconds",
            "conveyor_worker_wait_seconds"}


def parallel_stats(timestamp: float, rank_times: list[float], comm: float, bubble: float,
                   tokens: int = 4) -> StepStats:
    """A step of workers that each spent ``comm`` in collectives (one all-reduce of 1 KB per worker) and waited
    what a ``bubble`` share of their time says, all in the last stage's ranks."""
    step = stats(1, tokens)
    step.timestamp, step.rank_times, step.comm_time, step.bubble_fraction = timestamp, rank_times, comm, bubble
    step.rank_comm = [comm] * len(rank_times)
    last = len(rank_times) // 2
    step.rank_wait = [0.0] * last + [bubble * sum(rank_times) / (len(rank_times) - last)] * (len(rank_times) - last)
    step.num_collectives, step.collective_bytes = 1.0, 1024.0
    return step


def test_one_worker_leaves_the_parallel_metrics_without_samples():
    metrics = ServerMetrics(MODEL)
    metrics.engine_step(stats(1, tokens=40))
    metrics.engine_step(stats(2, tokens=8))
    value = Exposition(metrics)
    assert PARALLEL <= value.families(with_samples=False)  # described, so a dashboard can find them
    assert not PARALLEL & value.families()


def test_multi_worker_steps_export_comm_compute_ranks_and_bubbles():
    metrics = ServerMetrics(MODEL)
    value = Exposition(metrics)
    # TP 2 x PP 2; ranks 2 and 3 (the second stage) wait for the first. Compute is the mean rank time less the
    # comm and the mean wait (bubble x mean rank time): 16 ms x 0.75 - 2 ms = 10 ms, then 5 ms x 0.5 - 0.5 ms = 2 ms
    metrics.engine_step(parallel_stats(100.0, [0.010, 0.012, 0.020, 0.022], comm=0.002, bubble=0.25))
    assert value("conveyor_pipeline_bubble_fraction") == 0.25  # the first step sets the smoothed value
    metrics.engine_step(parallel_stats(110.0, [0.004, 0.004, 0.006, 0.006], comm=0.0005, bubble=0.5))
    # a snapshot between steps (no tokens) is no step, even if it carried worker times
    metrics.engine_step(parallel_stats(111.0, [1.0, 1.0, 1.0, 1.0], comm=1.0, bubble=1.0, tokens=0))

    assert value("conveyor_step_comm_seconds_count") == 2
    assert value("conveyor_step_comm_seconds_sum") == pytest.approx(0.0025)
    assert value("conveyor_step_comm_seconds_bucket", le="0.0002") == 0
    assert value("conveyor_step_comm_seconds_bucket", le="0.0005") == 1
    assert value("conveyor_step_comm_seconds_bucket", le="0.002") == 2
    assert value("conveyor_step_compute_seconds_count") == 2
    assert value("conveyor_step_compute_seconds_sum") == pytest.approx(0.012)
    assert value("conveyor_step_compute_seconds_bucket", le="0.005") == 1
    assert value("conveyor_step_compute_seconds_bucket", le="0.01") == 2
    assert value("conveyor_step_bubble_fraction_count") == 2
    assert value("conveyor_step_bubble_fraction_sum") == 0.75
    assert value("conveyor_step_bubble_fraction_bucket", le="0.2") == 0
    assert value("conveyor_step_bubble_fraction_bucket", le="0.5") == 2
    for rank, total in {"0": 0.014, "1": 0.016, "2": 0.026, "3": 0.028}.items():
        assert value("conveyor_worker_step_seconds_count", rank=rank) == 2
        assert value("conveyor_worker_step_seconds_sum", rank=rank) == pytest.approx(total)
    assert value("conveyor_worker_step_seconds_bucket", rank="3", le="0.02") == 1
    assert value("conveyor_worker_step_seconds_bucket", rank="3", le="0.05") == 2
    for rank in "0123":
        assert value("conveyor_worker_comm_seconds_total", rank=rank) == pytest.approx(0.0025)
    assert value("conveyor_worker_wait_seconds_total", rank="0") == 0
    assert value("conveyor_worker_wait_seconds_total", rank="3") == pytest.approx(0.25 * 0.064 / 2 + 0.5 * 0.02 / 2)
    assert value("conveyor_collectives_total") == 2 and value("conveyor_collective_bytes_total") == 2048
    # ten seconds (one time constant) later the old value keeps a weight of 1/e
    assert value("conveyor_pipeline_bubble_fraction") == pytest.approx(0.25 / math.e + 0.5 * (1 - 1 / math.e))
    # the engine's own step histogram counts the same two steps
    assert value("conveyor_engine_step_seconds_count") == 2
    assert PARALLEL <= value.read

    # comm above the mean rank time (clocks of different workers): compute floors at zero
    metrics.engine_step(parallel_stats(120.0, [0.001, 0.001], comm=0.003, bubble=0.0))
    assert value("conveyor_step_compute_seconds_bucket", le="0.0001") == 1
    assert value("conveyor_step_compute_seconds_sum") == pytest.approx(0.012)


def test_parallel_metrics_carry_the_replica_label_with_several_replicas():
    metrics = ServerMetrics(MODEL, 2)
    metrics.engine_step(parallel_stats(5.0, [0.01, 0.03], comm=0.001, bubble=0.1), 1)
    metrics.engine_step(parallel_stats(5.0, [0.02, 0.04], comm=0.001, bubble=0.3), 0)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render(True, 0).decode())}

    def label_sets(name: str) -> set[tuple[tuple[str, str], ...]]:
        return {tuple(sorted(s.labels.items())) for s in families[name].samples if s.name.endswith("_count")}

    assert label_sets("conveyor_worker_step_seconds") == {
        (("model_name", MODEL), ("rank", rank), ("replica", replica)) for replica in ("0", "1") for rank in ("0", "1")
    }
    assert {s.labels["replica"]: s.value for s in families["conveyor_pipeline_bubble_fraction"].samples} == {
        "0": 0.3, "1": 0.1}
    # per-step histograms are global, as the engine step time is
    for name in ("conveyor_step_comm_seconds", "conveyor_step_compute_seconds", "conveyor_step_bubble_fraction"):
        assert label_sets(name) == {(("model_name", MODEL),)}
    comm = families["conveyor_step_comm_seconds"].samples
    assert next(s.value for s in comm if s.name == "conveyor_step_comm_seconds_count") == 2  # both replicas' steps


class FakeNvml:
    """NVML (its names) for two GPUs whose readings the test sets (no GPU or driver here)."""

    NVMLError = RuntimeError

    def __init__(self):
        from types import SimpleNamespace

        self.readings = {0: (37, 30e9, 80e9), 1: (100, 79e9, 80e9)}
        self.namespace = SimpleNamespace
        self.inits = 0

    def nvmlInit(self):
        self.inits += 1

    def nvmlDeviceGetCount(self):
        return len(self.readings)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUtilizationRates(self, handle):
        return self.namespace(gpu=self.readings[handle][0], memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle):
        _, used, total = self.readings[handle]
        return self.namespace(used=used, total=total, free=total - used)


def ready(device: str) -> EngineReady:
    return EngineReady(1, 256, 50, 16, 3.0, 1.0, device)


def test_gpu_utilization_and_memory_come_from_nvml_at_each_scrape(monkeypatch):
    nvml = FakeNvml()
    monkeypatch.setitem(__import__("sys").modules, "pynvml", nvml)
    metrics = ServerMetrics(MODEL)
    metric = Exposition(metrics)
    metrics.engine_ready(ready("cuda:0"))
    metrics.engine_ready(ready("cuda:0"))  # a restart starts NVML no second time
    assert nvml.inits == 1
    assert metric("conveyor_gpu_utilization_ratio", gpu="0") == 0.37
    assert metric("conveyor_gpu_memory_used_bytes", gpu="1") == 79e9
    assert metric("conveyor_gpu_memory_total_bytes", gpu="1") == 80e9
    nvml.readings[0] = (5, 31e9, 80e9)  # read again at the next scrape
    assert metric("conveyor_gpu_utilization_ratio", gpu="0") == 0.05
    assert metric("conveyor_gpu_memory_used_bytes", gpu="0") == 31e9


def test_without_a_gpu_or_its_driver_there_are_no_gpu_metrics():
    cpu = ServerMetrics(MODEL)
    cpu.engine_ready(ready("cpu"))
    assert cpu.gpus is None
    # the real NVML package, on a machine without the driver (or with no GPU): it cannot start, nothing breaks
    cuda = ServerMetrics(MODEL)
    cuda.engine_ready(ready("cuda:0"))
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
        pytest.skip("this machine has NVML")
    except pynvml.NVMLError:
        pass
    assert cuda.gpus is None
    assert not any(name.startswith("conveyor_gpu_") for name in Exposition(cuda).families(with_samples=False))
