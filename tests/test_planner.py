"""``conveyor plan``: SLO parsing, and the configs it prints checked by simulating them again, apart from the
planner."""

from __future__ import annotations

import logging
import random
import subprocess
import sys

import pytest

from conveyor.bench.arrivals import arrival_times
from conveyor.bench.costs import CostModel
from conveyor.bench.planner import Candidate, Planner, Slo, format_plan, parse_slos
from conveyor.bench.sim_fleet import simulate_fleet
from conveyor.bench.simulator import MODELS, SimRequest, kv_link_bytes_per_s, simulate
from conveyor.bench.stats import summarize
from conveyor.config import load_config
from conveyor.perf.peaks import DevicePeaks, gpu_peaks

SLOS = "ttft_p99=400ms,itl_p99=40ms"
# a small search: two budgets and two batch sizes, block sizes 16 and 32
GRID = {"seqs": (32, 128), "tokens": (512, 4096)}


def test_slos_parse_with_units_and_refuse_unknown_names():
    assert parse_slos("ttft_p99=0.5s, itl_p50=40") == [Slo("ttft", "p99", 500.0), Slo("itl", "p50", 40.0)]
    for bad in ("ttft=500ms", "ttfb_p99=5ms", "itl_p99=fast", "", "ttft_p99=0", "itl_p50=0.0ms", "ttft_p99=."):
        with pytest.raises(ValueError, match="--slo"):
            parse_slos(bad)


def workload(n: int = 32, seed: int = 0) -> tuple[list[SimRequest], list[float]]:
    rng = random.Random(seed)
    requests = [SimRequest([rng.randrange(100, 30000) for _ in range(rng.randint(200, 1800))], rng.randint(32, 160))
                for _ in range(n)]
    return requests, [float(t) for t in arrival_times(n, 1.0, 1.0, seed)]


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    logging.getLogger("conveyor").setLevel(logging.WARNING)
    requests, arrivals = workload()
    planner = Planner(None, {"model.max_model_len": 4096}, MODELS["llama-3-8b"], "h100", requests, arrivals,
                      parse_slos(SLOS), gpus=2)
    return planner, planner.rounds(grid=GRID)


def test_the_best_config_printed_meets_the_slos_when_simulated_again(plan, tmp_path):
    planner, candidates = plan
    best = candidates[0]
    assert best.capacity > 0
    # the TOML as printed, loaded as a config file
    text = format_plan(planner, candidates, 1, "plan")
    path = tmp_path / "best.toml"
    path.write_text(text.split("\n", 3)[3])
    config = load_config(path)
    assert config.parallel.tensor_parallel_size * config.parallel.data_parallel_size == 2
    assert config.parallel.prefill_engines == 0  # (the best here colocates; a split is checked below)
    assert config.scheduler.options.max_num_batched_tokens == best.keys.get("scheduler.max_num_batched_tokens",
                                                                            config.scheduler.options.max_num_batched_tokens)
    # each replica takes every other request at half the rate, simulated here on its own
    replicas = config.parallel.data_parallel_size
    requests, arrivals = workload()
    mine = requests[::replicas]
    share = best.capacity / replicas
    peaks = gpu_peaks("h100")
    cost = CostModel.datasheet(peaks, config.model.dtype, MODELS["llama-3-8b"], config.parallel.tensor_parallel_size)
    records, duration, _ = simulate(config, MODELS["llama-3-8b"], mine, [t / share for t in arrivals[::replicas]],
                                    cost, peaks)
    summary = summarize(records, duration)
    assert summary["failed"] == 0
    assert summary["ttft_ms"]["p99"] <= 400 and summary["itl_ms"]["p99"] <= 40, summary


def test_the_search_covers_the_grid_and_ranks_by_capacity(plan):
    _, candidates = plan
    capacities = [c.capacity for c in candidates]
    assert capacities == sorted(capacities, reverse=True)
    keys = [c.keys for c in candidates]
    # round 1: TP 1 and 2 x three weight formats x two KV dtypes (an H100 has fp8 matmuls)
    assert {(k["parallel.tensor_parallel_size"], k["quant.plugin"], k["kvcache.dtype"]) for k in keys} == {
        (tp, q, kv) for tp in (1, 2) for q in ("none", "int8", "fp8") for kv in ("auto", "fp8")}
    assert {k.get("scheduler.max_num_batched_tokens") for k in keys} == {None, 512, 4096}
    assert {k.get("kvcache.block_size") for k in keys} == {None, 16, 32}


def test_prefill_decode_splits_are_searched_and_meet_the_slos_when_simulated_again(tmp_path):
    """With four GPUs, the best config of round 1 at TP=1 (four engines) is tried split 1+3, 2+2 and 3+1 into
    prefill and decode engines, and at TP=2 (two engines) split 1+1; TP=4 runs one engine and is not split. A
    split's capacity is the whole deployment's: its printed TOML, loaded as a config and all its engines
    simulated at that rate, meets the SLOs."""
    requests, arrivals = workload(24, seed=3)
    spec = MODELS["llama-3-8b"]
    grid = {"quant": ("none",), "kv": ("auto",), "seqs": (64,), "tokens": (512,), "block": (16,)}
    planner = Planner(None, {"model.max_model_len": 4096}, spec, "h100", requests, arrivals,
                      parse_slos("ttft_p99=1s,itl_p99=30ms"), gpus=4)
    candidates = planner.rounds(grid=grid)
    splits = {(c.keys["parallel.tensor_parallel_size"], c.keys["parallel.prefill_engines"],
               c.keys["parallel.decode_engines"]) for c in candidates if c.keys.get("parallel.prefill_engines")}
    assert splits == {(1, 1, 3), (1, 2, 2), (1, 3, 1), (2, 1, 1)}
    split = max((c for c in candidates if c.keys.get("parallel.prefill_engines")), key=lambda c: c.capacity)
    assert split.capacity > 0 and split.replicas == 1
    path = tmp_path / "split.toml"
    path.write_text(format_plan(planner, [split], 1, "plan").split("\n", 3)[3])
    config = load_config(path)
    parallel = config.parallel
    assert (parallel.tensor_parallel_size, parallel.prefill_engines, parallel.decode_engines) == (
        split.keys["parallel.tensor_parallel_size"], split.keys["parallel.prefill_engines"],
        split.keys["parallel.decode_engines"])
    assert parallel.data_parallel_size == 1
    peaks = gpu_peaks("h100")
    cost = CostModel.datasheet(peaks, config.model.dtype, spec, parallel.tensor_parallel_size)
    records, duration, _ = simulate_fleet(config, spec, requests, [t / split.capacity for t in arrivals], cost, peaks,
                                          kv_link_bytes_per_s("h100", None))
    summary = summarize(records, duration)
    assert summary["failed"] == 0 and summary["completed"] == len(requests)
    assert summary["ttft_ms"]["p99"] <= 1000 and summary["itl_ms"]["p99"] <= 30, summary


def test_on_a_cpu_each_weight_format_and_kv_dtype_is_calibrated_by_its_own_run(monkeypatch):
    """A CPU's step cost is fitted to a real run of the config, whose weight format and KV dtype decide how fast
    its kernels go: each (format, KV dtype) of the search gets a calibration of its own, used for its candidates
    only, and ``auto`` (the checkpoint's own format: the default model's packed GGUF blocks) is among them; never
    one calibration standing for all of them."""
    from conveyor.bench import planner as planner_module

    speed = {"auto": 4.0, "int8": 2.0, "none": 1.0}  # (how fast each format's fake calibration says it runs)
    calibrated = []

    def fake_calibration(hardware, config, spec, interconnect=None):
        assert hardware == "cpu"
        calibrated.append((config.quant.plugin, config.kvcache.options.dtype))
        cost = CostModel(0.002, 0.0, 2e-9 / speed[config.quant.plugin], weight_bytes=10**8)
        return DevicePeaks("a CPU", {"float32": 1e11}, 3e10, "fake"), cost

    monkeypatch.setattr(planner_module, "hardware_costs", fake_calibration)
    requests, arrivals = workload(16, seed=2)
    grid = {"tp": (1,), "kv": ("auto", "fp8"), "seqs": (32,), "tokens": (512,), "block": (16,)}
    planner = Planner(None, {}, MODELS["smollm2-135m"], "cpu", requests, arrivals, parse_slos("itl_p99=1s"))
    candidates = planner.rounds(grid=grid)
    assert sorted(calibrated) == sorted((q, kv) for q in speed for kv in ("auto", "fp8"))  # (fp8 weights: GPUs)
    assert candidates[0].keys["quant.plugin"] == "auto"
    by_format = {q: max(c.capacity for c in candidates if c.keys["quant.plugin"] == q) for q in speed}
    assert by_format["auto"] > by_format["int8"] > by_format["none"] > 0


def test_a_tighter_slo_carries_no_more_and_an_impossible_one_nothing():
    requests, arrivals = workload(32, seed=1)
    spec = MODELS["llama-3-8b"]
    grid = {"tp": (1,), "quant": ("none",), "kv": ("auto",), "seqs": (64,), "tokens": (512,), "block": (16,)}
    capacity = {}
    for slo in ("ttft_p99=2s,itl_p99=200ms", "ttft_p99=300ms,itl_p99=30ms", "ttft_p99=1ms"):
        planner = Planner(None, {"model.max_model_len": 4096}, spec, "h100", requests, arrivals, parse_slos(slo))
        capacity[slo] = planner.rounds(grid=grid)[0].capacity
    loose, tight, impossible = capacity.values()
    assert loose >= tight > 0
    assert impossible == 0  # a 1 ms TTFT is below one step's overhead


def test_a_model_too_large_for_the_gpus_is_refused_with_the_reason():
    requests, arrivals = workload(8)
    planner = Planner(None, {}, MODELS["llama-3-70b"], "h100", requests, arrivals, parse_slos("ttft_p99=5s"))
    grid = {"quant": ("none",), "kv": ("auto",), "seqs": (64,), "tokens": (512,), "block": (16,)}
    assert planner.rounds(grid=grid) == []
    candidate = planner.evaluate(Candidate({}))
    assert candidate.capacity is None and "do not fit" in candidate.error


def test_the_command_line_exits_1_when_no_config_meets_the_slos():
    result = subprocess.run([sys.executable, "-m", "conveyor", "plan", "--model", "llama-3-8b", "--hardware", "h100",
                             "--slo", "ttft_p99=1ms", "--num-requests", "2", "--dataset", "random", "--input-len", "16",
                             "--output-len", "2"],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "meets the SLOs at no rate tried" in result.stdout


def test_the_plan_says_what_tensor_parallelism_spends_on_its_link():
    """Two GPUs as one TP=2 engine: the plan names the share of each step its all-reduces take over the link,
    larger over PCIe Gen5 than over NVLink 4; one GPU has no such line."""
    requests, arrivals = workload(8)
    shares = {}
    for link in ("nvlink4", "pcie5"):
        planner = Planner(None, {"model.max_model_len": 4096}, MODELS["llama-3-8b"], "h100", requests, arrivals,
                          parse_slos("ttft_p99=5s"), gpus=2, interconnect=link)
        candidate = planner.evaluate(Candidate({"parallel.tensor_parallel_size": 2}))
        shares[link] = candidate.summary["comm_share"]
        assert f"of each step in all-reduces ({link})" in format_plan(planner, [candidate], 1, "plan")
    assert 0 < shares["nvlink4"] < shares["pcie5"] < 1
    planner = Planner(None, {"model.max_model_len": 4096}, MODELS["llama-3-8b"], "h100", requests, arrivals,
                      parse_slos("ttft_p99=5s"))
    alone = planner.evaluate(Candidate({}))
    assert alone.summary["comm_share"] == 0 and "all-reduces" not in format_plan(planner, [alone], 1, "plan")
