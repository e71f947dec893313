"""``conveyor simulate``: the real engine core, scheduler and KV cache on a virtual clock, with a cost model; its
numbers respect the hardware's physical limits, and a calibration recovers a known cost."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from conveyor.bench.costs import INTERCONNECTS, CostModel, calibrate, weight_bytes
from conveyor.bench.sim_workload import multiturn
from conveyor.bench.simulator import MODELS, SimRequest, comm_share, simulate
from conveyor.config import load_config
from conveyor.messages import KVCacheStats, SchedulerStats, StepStats
from conveyor.perf.peaks import gpu_peaks

H100 = gpu_peaks("H100 SXM")
LLAMA = MODELS["llama-3-8b"]
# the datasheet cost model's stated assumptions (conveyor.bench.costs): 60% of the peak FLOP/s, 80% of the
# bandwidth, 2 ms a step; NVLink 4 between devices by default, 450 GB/s one way and 1 us a hop
FLOP_EFFICIENCY, BYTE_EFFICIENCY, STEP_OVERHEAD_S = 0.6, 0.8, 0.002
LINK_BYTES_PER_S, LINK_LATENCY_S = 450e9, 1e-6


def prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 100000) for _ in range(length)] for _ in range(count)]


def run(spec, requests, arrivals, peaks=H100, **overrides):
    config = load_config(None, {"model.max_model_len": 4096, **overrides})
    cost = CostModel.datasheet(peaks, "bfloat16", spec, config.parallel.tensor_parallel_size)
    return simulate(config, spec, requests, arrivals, cost, peaks)


def kv_bytes_per_token(spec, dtype_bytes: int = 2) -> int:
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * dtype_bytes


def test_llama_3_8b_on_an_h100_stays_within_its_physical_limits():
    """One request alone: every decode step reads the 16 GB of weights, so no token comes faster than weights /
    HBM bandwidth (4.8 ms), and a 2,000-token prompt takes at least its FLOPs at the peak rate. 64 requests at
    once: output tokens never outpace the peak FLOP/s over 2 x parameters per token.

    Nor slower than the datasheet model's own assumptions allow (80% of the bandwidth, 60% of the FLOP/s, 2 ms
    a step): a decode alone within 1% of its bytes (the weights and the KV cache) at 80% of the bandwidth plus
    2 ms; a prompt chunk, a step, no slower than its FLOPs and its bytes at those rates added (no overlap at
    all) plus 2 ms. A cost model several times too slow, or one that ignores the KV cache, fails these."""
    weights = weight_bytes(LLAMA, 2)
    assert weights == pytest.approx(16.06e9, rel=0.01)  # (8.03 B parameters in bfloat16)
    flops, bandwidth = H100.flops_for("bfloat16"), H100.bytes_per_second
    slowest_flops, slowest_bandwidth = FLOP_EFFICIENCY * flops, BYTE_EFFICIENCY * bandwidth
    [alone], _, _ = run(LLAMA, [SimRequest(prompts(1, 2000)[0], 64)], [0.0])
    assert min(alone.itl) >= weights / bandwidth
    longest = weights + (2000 + 64) * kv_bytes_per_token(LLAMA)
    assert max(alone.itl) <= 1.01 * (STEP_OVERHEAD_S + longest / slowest_bandwidth)
    assert min(alone.itl) >= 0.99 * (STEP_OVERHEAD_S + (weights + 2000 * kv_bytes_per_token(LLAMA))
                                     / slowest_bandwidth)
    prompt_flops = 2 * 2000 * (weights / 2)  # (2 x parameters per token overcounts the embedding: room for attention)
    assert alone.ttft >= prompt_flops / flops
    chunks = -(-2000 // load_config(None).scheduler.options.max_num_batched_tokens)
    assert alone.ttft <= chunks * (STEP_OVERHEAD_S + longest / slowest_bandwidth) + prompt_flops / slowest_flops
    many = [SimRequest(p, 256) for p in prompts(64, 500, seed=1)]
    records, duration, steps = run(LLAMA, many, [0.0] * 64)
    assert all(r.output_tokens == 256 and r.error is None for r in records)
    assert sum(r.output_tokens for r in records) / duration <= flops / weights
    # every step the scheduler ran at most reads the weights and the whole cache, plus the run's FLOPs
    whole_cache = weights + 64 * (500 + 256) * kv_bytes_per_token(LLAMA)
    all_flops = 2 * 64 * (500 + 256) * (weights / 2)
    assert duration <= len(steps) * (STEP_OVERHEAD_S + whole_cache / slowest_bandwidth) + all_flops / slowest_flops


def test_the_simulator_runs_the_real_scheduler_and_kv_cache():
    """A KV cache of 40 blocks and max_num_seqs = 4 on SmolLM2: no step runs more than 4 requests, requests are
    preempted, and every one still gets exactly its tokens, at the times its steps ended."""
    spec = MODELS["smollm2-135m"]
    requests = [SimRequest(p, 100) for p in prompts(12, 120, seed=2)]
    records, _, steps = run(spec, requests, [0.001 * i for i in range(12)], **{
        "kvcache.num_blocks": 40, "scheduler.max_num_seqs": 4, "scheduler.max_num_batched_tokens": 64})
    assert max(s.scheduler.num_running for s in steps) <= 4
    assert steps[-1].scheduler.num_preemptions > 0
    for record in records:
        assert record.error is None and record.output_tokens == 100 and len(record.itl) == 99
        assert record.ttft > 0 and all(gap > 0 for gap in record.itl)
        assert record.e2e == pytest.approx(record.ttft + sum(record.itl))


def test_weights_that_do_not_fit_are_refused_and_tensor_parallelism_splits_them():
    llama_70b = MODELS["llama-3-70b"]
    requests = [SimRequest(prompts(1, 100)[0], 8)]
    with pytest.raises(ValueError, match=r"141\.\d GB of weights per device do not fit in the 80 GB of H100 SXM"):
        run(llama_70b, requests, [0.0])
    [two], _, _ = run(llama_70b, requests, [0.0], **{"parallel.tensor_parallel_size": 2})
    [four], _, _ = run(llama_70b, requests, [0.0], **{"parallel.tensor_parallel_size": 4})
    # each device reads a quarter of the weights instead of a half: faster, but at most twice as fast
    assert min(two.itl) / 2 <= min(four.itl) < min(two.itl)


def ring_all_reduces(spec, tp: int, tokens: int, link) -> float:
    """Seconds of a step's collectives: two ring all-reduces of the hidden states per layer, each 2 (tp - 1)
    hops of the link's latency carrying 2 (tp - 1) / tp of the bytes at its bandwidth."""
    hops = 2 * (tp - 1)
    return 2 * spec.num_layers * (hops * link.latency_s
                                  + hops / tp * tokens * spec.hidden_size * 2 / link.bytes_per_second)


def test_tensor_parallelism_over_nvlink_and_over_pcie():
    """Llama-3-70B at TP=8 on H100s: a decode step alone pays its all-reduces on top of an eighth of the
    weights' reads, at each link's latency and bandwidth; over PCIe Gen5 they take a larger share of the steps
    and a flood runs slower than over NVLink 4."""
    llama_70b = MODELS["llama-3-70b"]
    parallel = {"parallel.tensor_parallel_size": 8}
    flood = [SimRequest(p, 64) for p in prompts(64, 400, seed=5)]
    result = {}
    for name in ("nvlink4", "pcie5"):
        config = load_config(None, {"model.dtype": "bfloat16", **parallel})
        cost = CostModel.datasheet(H100, "bfloat16", llama_70b, 8, name)
        [alone], _, alone_steps = simulate(config, llama_70b, [SimRequest(prompts(1, 200)[0], 16)], [0.0], cost,
                                           H100)
        decode = alone_steps[-1]
        assert decode.comm_time == pytest.approx(ring_all_reduces(llama_70b, 8, 1, INTERCONNECTS[name]))
        records, duration, steps = simulate(config, llama_70b, flood, [0.0] * len(flood), cost, H100)
        assert all(r.error is None and r.output_tokens == 64 for r in records)
        result[name] = (comm_share(steps), sum(r.output_tokens for r in records) / duration, min(alone.itl))
    (nvlink_share, nvlink_rate, nvlink_itl), (pcie_share, pcie_rate, pcie_itl) = result["nvlink4"], result["pcie5"]
    assert 0 < nvlink_share < pcie_share < 1
    assert pcie_rate < nvlink_rate and nvlink_itl < pcie_itl
    # the step's time is the weights' reads, the overhead and the collectives
    eighth = weight_bytes(llama_70b, 2) / 8
    assert nvlink_itl == pytest.approx(STEP_OVERHEAD_S + eighth / (BYTE_EFFICIENCY * H100.bytes_per_second)
                                       + ring_all_reduces(llama_70b, 8, 1, INTERCONNECTS["nvlink4"]), rel=0.02)


def test_pipeline_stages_hold_more_kv_and_raise_throughput_but_not_one_token_latency():
    """Llama-3-70B on H100s at TP=2, then with two pipeline stages of TP=2: each device holds half the layers,
    so the cache has room for more blocks; a token alone still passes every stage in turn (no faster than all
    the weights read by two devices at once), and a flood runs faster with two batches in flight, but at most
    twice as fast."""
    llama_70b = MODELS["llama-3-70b"]
    alone_request = [SimRequest(prompts(1, 200)[0], 16)]
    flood = [SimRequest(p, 64) for p in prompts(32, 400, seed=4)]
    result = {}
    for pp in (1, 2):
        parallel = {"parallel.tensor_parallel_size": 2, "parallel.pipeline_parallel_size": pp}
        [alone], _, _ = run(llama_70b, alone_request, [0.0], **parallel)
        records, duration, steps = run(llama_70b, flood, [0.0] * len(flood), **parallel)
        assert all(r.error is None and r.output_tokens == 64 for r in records)
        result[pp] = (min(alone.itl), sum(r.output_tokens for r in records) / duration, steps[-1].kv.num_blocks)
    (itl_1, rate_1, blocks_1), (itl_2, rate_2, blocks_2) = result[1], result[2]
    assert blocks_2 > 2 * blocks_1
    # each device's share of the memory its weights (and 2 GB for activations) leave, at the config's
    # memory_fraction, in blocks of its layers' and KV heads' share of the cache
    kvcache = load_config(None).kvcache.options
    for pp, blocks in ((1, blocks_1), (2, blocks_2)):
        free = H100.memory_bytes - weight_bytes(llama_70b, 2) / (2 * pp) - 2e9
        block_bytes = kvcache.block_size * kv_bytes_per_token(llama_70b) / (2 * pp)
        assert blocks == pytest.approx(kvcache.memory_fraction * free / block_bytes, rel=0.01)
    half = weight_bytes(llama_70b, 2) / 2  # (TP=2: what each device reads)
    assert itl_1 >= half / H100.bytes_per_second
    assert itl_1 <= 1.01 * (STEP_OVERHEAD_S + half / (BYTE_EFFICIENCY * H100.bytes_per_second)
                            + ring_all_reduces(llama_70b, 2, 1, INTERCONNECTS["nvlink4"]))
    # a lone token passes the two stages in turn: the same reads, plus its hidden state sent between them
    assert itl_2 - itl_1 == pytest.approx(LINK_LATENCY_S + llama_70b.hidden_size * 2 / LINK_BYTES_PER_S, rel=0.05)
    assert rate_1 < rate_2 <= 2 * rate_1


def test_calibration_recovers_a_known_cost():
    """Steps whose times are exactly 3 ms + 1 ns per MFLOP + 40 ps per byte + 20 us per sequence."""
    rng = random.Random(3)
    steps = []
    for i in range(50):
        flops, moved, seqs = rng.uniform(1e8, 1e12), rng.uniform(2e8, 5e8), rng.randint(1, 64)
        seconds = 0.003 + 1e-15 * flops + 4e-11 * moved + 2e-5 * seqs
        steps.append(StepStats(i, 0.0, SchedulerStats(num_running=seqs), KVCacheStats(), forward_time=seconds,
                               flops=flops, bytes_moved=moved))
    cost = calibrate(steps)
    assert (cost.overhead_s, cost.per_flop, cost.per_byte, cost.per_sequence) == pytest.approx(
        (0.003, 1e-15, 4e-11, 2e-5), rel=1e-6)
    assert cost.jitter == pytest.approx([1.0] * 50, rel=1e-6)  # (no step off the fit)


def test_a_calibrated_jitter_lengthens_the_simulated_steps_it_draws():
    """One calibration step in ten took twice the fit's time: about one simulated step in ten takes twice as
    long, seeded (the same run twice gives the same records)."""
    spec, config = MODELS["smollm2-135m"], load_config(None)
    requests = [SimRequest(p, 64) for p in prompts(8, 100)]
    steady = CostModel(0.01, 0.0, 0.0)
    jittery = CostModel(0.01, 0.0, 0.0, jitter=(1.0,) * 9 + (2.0,))
    peaks = gpu_peaks("H100")
    gaps = {}
    for label, cost in (("steady", steady), ("jittery", jittery), ("again", jittery)):
        records, _, _ = simulate(config, spec, requests, [0.0] * len(requests), cost, peaks)
        gaps[label] = sorted(g for r in records for g in r.itl)
    assert gaps["steady"] == pytest.approx([0.01] * len(gaps["steady"]))
    doubled = sum(1 for g in gaps["jittery"] if g == pytest.approx(0.02)) / len(gaps["jittery"])
    assert 0.05 < doubled < 0.15 and gaps["jittery"] == gaps["again"]


def test_the_command_prints_bench_reports_and_writes_json(tmp_path):
    out = tmp_path / "sim.json"
    done = subprocess.run([sys.executable, "-m", "conveyor", "--log-level", "WARNING", "simulate", "--model",
                           "qwen2.5-7b", "--hardware", "L40S", "--num-requests", "16", "--request-rate", "2,inf",
                           "--json", str(out)], capture_output=True, text=True, timeout=120, check=True)
    assert "qwen2.5-7b on L40S (simulated), inf requests/s" in done.stdout and "Output token throughput" in done.stdout
    runs = json.loads(out.read_text())["runs"]
    assert [r["config"]["rate"] for r in runs] == [2.0, float("inf")]
    assert all(r["summary"]["completed"] == 16 for r in runs)


def test_a_split_the_model_does_not_allow_is_refused_as_the_real_engine_refuses_it():
    """SmolLM2-135M's 9 attention heads do not split 2 ways: the command refuses tensor_parallel_size = 2 in one
    line, the real engine's refusal of the real model word for word (naming the sizes that work); 3 runs."""
    from conveyor import LLM
    from conveyor.config import ConfigError

    with pytest.raises(ConfigError) as real:
        LLM(None, {"parallel.tensor_parallel_size": 2})
    done = subprocess.run([sys.executable, "-m", "conveyor", "--log-level", "WARNING", "simulate", "--model",
                           "smollm2-135m", "--hardware", "H100", "--num-requests", "4", "--set",
                           "parallel.tensor_parallel_size=2"], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr.splitlines()) == (2, "", [f"error: {real.value}"]), done
    requests = [SimRequest(p, 8) for p in prompts(4, 64)]
    records, _, _ = run(MODELS["smollm2-135m"], requests, [0.0] * 4, **{"parallel.tensor_parallel_size": 3})
    assert all(r.ok and r.output_tokens for r in records)


def test_kv_tiers_serve_the_histories_a_small_pool_evicts_and_their_copies_take_time():
    """Six conversations, three turns each (``--dataset multiturn:3``), on a pool of 40 blocks: with the host tier
    the later turns load their histories (the tier's hits) and their first tokens come sooner; at a host
    bandwidth a thousand times lower, the copies cost the later turns more than computing the histories again."""
    spec = MODELS["smollm2-135m"]
    requests = multiturn(18, 3, 300, 8, seed=3, vocab_size=spec.vocab_size)
    assert [len(r.prompt_token_ids) for r in requests[::6]] == [332, 372, 412]  # (+ question + reply a turn)
    assert requests[6].prompt_token_ids[:332] == requests[0].prompt_token_ids  # (each turn resends the last)
    arrivals = [turn * 10.0 + c * 0.01 for turn in range(3) for c in range(6)]

    def later_ttft(tier_bytes_per_s: dict | None, **overrides) -> tuple[float, int]:
        config = load_config(None, {"kvcache.num_blocks": 40, **overrides})
        cost = CostModel.datasheet(H100, "bfloat16", spec)
        if tier_bytes_per_s is not None:
            cost.tier_bytes_per_s = tier_bytes_per_s
        records, _, steps = simulate(config, spec, requests, arrivals, cost, H100)
        hits = steps[-1].connector.hit_tokens["host"] if steps[-1].connector else 0
        return sum(r.ttft for r in records[6:]), hits

    plain, no_hits = later_ttft(None)
    tiered, hits = later_ttft(None, **{"connector.plugin": "tiers", "connector.host_gb": 1.0})
    slow, slow_hits = later_ttft({"host": 25e6}, **{"connector.plugin": "tiers", "connector.host_gb": 1.0})
    assert no_hits == 0 and hits == slow_hits > 12 * 256  # (most of each later turn's history)
    assert tiered < plain < slow


def fleet(requests, arrivals, link_bytes_per_s=LINK_BYTES_PER_S, **overrides):
    from conveyor.bench.sim_fleet import simulate_fleet

    config = load_config(None, {"model.max_model_len": 4096, "scheduler.max_num_batched_tokens": 2048,
                                "scheduler.max_num_seqs": 256, **overrides})
    cost = CostModel.datasheet(H100, "bfloat16", LLAMA, 1)
    return simulate_fleet(config, LLAMA, requests, arrivals, cost, H100, link_bytes_per_s)


PD = {"parallel.prefill_engines": 1, "parallel.decode_engines": 1}


def test_a_prefill_engine_hands_the_prompt_to_a_decode_engine_over_the_link():
    """One request alone: its TTFT grows by exactly its KV's bytes over a slower link; the decode engine computes
    only the prompt's last, partial block (its full blocks came over), the prefill engine the whole prompt."""
    (prompt,) = prompts(1, 1000)
    fast, _, steps = fleet([SimRequest(prompt, 8)], [0.0], 1e12, **PD)
    slow, _, _ = fleet([SimRequest(prompt, 8)], [0.0], 1e9, **PD)
    transfer = 1000 * kv_bytes_per_token(LLAMA)
    assert slow[0].ttft - fast[0].ttft == pytest.approx(transfer / 1e9 - transfer / 1e12, rel=1e-6)
    assert slow[0].e2e - fast[0].e2e == pytest.approx(transfer / 1e9 - transfer / 1e12, rel=1e-6)
    assert fast[0].output_tokens == 8 and len(fast[0].itl) == 7
    computed = [s.num_prefill_tokens for s in steps if s.num_prefill_tokens]
    assert sum(computed) == 1000 + 1000 % 16 and 1000 % 16 in computed  # (block size 16: 8 tokens on decode)


def test_data_parallel_replicas_share_the_requests_and_disaggregation_keeps_long_prompts_off_the_decodes():
    """Long prompts arriving steadily: two colocated replicas (each half the requests, in order) against one
    prefill and one decode engine on the same two devices. The decode engine runs no prompt chunk beside its
    decodes, so its ITL P99 stays near a decode step's, where the replicas' decodes share steps with 2,048-token
    chunks; and each request's TTFT includes its transfer."""
    rng = random.Random(3)
    requests = [SimRequest(p, rng.randint(64, 192)) for p in prompts(60, 2000)]
    arrivals = [i / 4 for i in range(len(requests))]
    replicas, _, _ = fleet(requests, arrivals, **{"parallel.data_parallel_size": 2})
    assert [r.index for r in replicas] == list(range(len(requests))) and all(r.ok for r in replicas)
    halves = [run(LLAMA, requests[k::2], arrivals[k::2], **{"scheduler.max_num_batched_tokens": 2048,
                                                             "scheduler.max_num_seqs": 256})[0] for k in (0, 1)]
    assert [r.ttft for r in replicas[0::2]] == [r.ttft for r in halves[0]]
    assert [r.ttft for r in replicas[1::2]] == [r.ttft for r in halves[1]]
    split, _, _ = fleet(requests, arrivals, **PD)
    assert all(r.ok for r in split) and [r.output_tokens for r in split] == [r.max_tokens for r in requests]

    def itl_p99(records) -> float:
        gaps = sorted(gap for r in records for gap in r.itl)
        return gaps[int(0.99 * (len(gaps) - 1))]

    assert itl_p99(split) < 0.7 * itl_p99(replicas)
    assert min(r.ttft for r in split) > 2000 * kv_bytes_per_token(LLAMA) / LINK_BYTES_PER_S
