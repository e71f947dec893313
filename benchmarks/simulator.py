"""The simulator against the real engine, on this machine: calibrated by short real runs, its predicted output
tokens/s, TTFT P50 and ITL P50 against those `conveyor bench` measures on `conveyor serve`, at three request rates.

    python benchmarks/simulator.py [--num-requests 32] [--rates 1,2,4] [--set KEY=VALUE ...]
    python benchmarks/simulator.py --published

``--published`` instead simulates a published run and prints both: Llama-3-8B-Instruct in bfloat16 on one H100
SXM under vLLM 0.6.0, ten prompts at once (LambdaLabsML/vllm-benchmark on GitHub,
results/prompt_10/1xH100-80GB-SXM/Meta-Llama-3-8B-Instruct_tp1_len2048.json, 2024-09-07), with its prompt and
output lengths (random token ids: no prefix is shared).

Calibration, on workloads of their own (other seeds): the step cost model is fitted to the steps of an offline
run (``measure_steps``); then, through the server, four one-token requests one at a time give the frontend's
latency (measured TTFT less the simulated one), and 32 requests at once the server's time between steps (the
measured duration less the simulated one, per step). The validation then sends each rate's requests (the
`mixed` dataset, `ignore_eos`) to the server and simulates them arriving at the same times. Prints predicted,
measured and the error of each.
"""

from __future__ import annotations

import argparse
import tempfile
from functools import partial
from pathlib import Path

import anyio

from conveyor.config import paths
from conveyor.bench.arrivals import arrival_times
from conveyor.bench.costs import calibrate
from conveyor.bench.datasets import mixed
from conveyor.bench.load import BenchRequest, LoadOptions, run_load
from conveyor.bench.server import Server
from conveyor.bench.simulator import MODELS, SimRequest, measure_steps, simulate
from conveyor.bench.stats import summarize
from conveyor.config import ModelConfig, load_config, parse_override
from conveyor.model.tokenizer import load_tokenizer
from conveyor.perf.peaks import cpu_peaks

METRICS = [("output tok/s", lambda s: s["output_throughput"]), ("TTFT P50 (ms)", lambda s: s["ttft_ms"]["p50"]),
           ("ITL P50 (ms)", lambda s: s["itl_ms"]["p50"])]


# that run's prompt and output lengths, and what it measured
PUBLISHED_INPUTS = [13, 25, 27, 10, 329, 29, 399, 328, 4, 205]
PUBLISHED_OUTPUTS = [120, 429, 233, 194, 101, 741, 9, 3, 6, 31]
PUBLISHED = {"duration (s)": 5.367, "output tok/s": 347.9, "TPOT P50 (ms)": 7.558, "TTFT mean (ms)": 62.4}


def published() -> None:
    import random

    from conveyor.bench.costs import CostModel
    from conveyor.perf.peaks import gpu_peaks

    rng = random.Random(0)
    requests = [SimRequest([rng.randrange(1000, 100000) for _ in range(n)], m)
                for n, m in zip(PUBLISHED_INPUTS, PUBLISHED_OUTPUTS)]
    peaks, spec = gpu_peaks("H100 SXM"), MODELS["llama-3-8b"]
    config = load_config(None, {"model.max_model_len": 2048})
    records, duration, _ = simulate(config, spec, requests, [0.0] * len(requests),
                                    CostModel.datasheet(peaks, "bfloat16", spec), peaks)
    s = summarize(records, duration)
    ours = {"duration (s)": duration, "output tok/s": s["output_throughput"], "TPOT P50 (ms)": s["tpot_ms"]["p50"],
            "TTFT mean (ms)": s["ttft_ms"]["mean"]}
    print("| Llama-3-8B bf16, 1x H100 SXM, 10 prompts at once | simulated | published (vLLM 0.6.0) | error |")
    print("|---|---|---|---|")
    for name, value in PUBLISHED.items():
        print(f"| {name} | {ours[name]:.2f} | {value:.2f} | {(ours[name] - value) / value:+.1%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--published", action="store_true", help="compare with a published H100 run instead")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--rates", type=lambda s: [float(r) for r in s.split(",")], default=[1.0, 2.0, 4.0])
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    if args.published:
        return published()
    overrides = dict(parse_override(o) for o in args.set)
    config = load_config(None, overrides)
    print("calibrating: a short real run through the offline engine ...", flush=True)
    cost = calibrate(*measure_steps(config))
    print(f"  {cost.overhead_s * 1e3:.2f} ms + {cost.per_flop * 1e12:.3f} ms/TFLOP + {cost.per_byte * 1e9:.3f} "
          f"ms/GB + {cost.per_sequence * 1e6:.1f} us/sequence a step", flush=True)
    tokenizer = load_tokenizer(ModelConfig())
    peaks = cpu_peaks(paths.cache_root())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        settings = "".join(f"--set {k}={v} " for k, v in overrides.items())
        server = Server('[[transport]]\nplugin = "http"\nport = 0\n', Path(tmp), overrides=[
            f"{k}={v}" for k, v in overrides.items()]).start()
        print(f"serving {settings or 'the default config'} at {server.http}", flush=True)
        spec = MODELS["smollm2-135m"]

        def through_server(chats, rate: float, seed: int):
            requests = [BenchRequest(c.messages, None, len(tokenizer.encode_chat(c.messages)), c.max_tokens)
                        for c in chats]
            options = LoadOptions(rate=rate, seed=seed, ignore_eos=True)
            return anyio.run(partial(run_load, server.http, "smollm2-135m-instruct", requests, options))

        def simulated(chats, arrivals, latency: float = 0.0):
            requests = [SimRequest(tokenizer.encode_chat(c.messages), c.max_tokens) for c in chats]
            return simulate(config, spec, requests, arrivals, cost, peaks, latency)

        try:
            count = lambda m: len(tokenizer.encode_chat(m))
            singles = mixed(4, 100, count, output_len=(1, 1))
            measured_ttft = [through_server([chat], float("inf"), 0)[0][0].ttft for chat in singles]
            simulated_ttft = [simulated([chat], [0.0])[0][0].ttft for chat in singles]
            latency = max(0.0, sum(measured_ttft) / 4 - sum(simulated_ttft) / 4)
            burst = mixed(32, 101, count)
            _, measured_duration = through_server(burst, float("inf"), 0)
            _, simulated_duration, steps = simulated(burst, [0.0] * 32, latency)
            cost.overhead_s += max(0.0, (measured_duration - simulated_duration) / len(steps))
            print(f"  frontend latency {latency * 1e3:.1f} ms; server step overhead {cost.overhead_s * 1e3:.2f} ms",
                  flush=True)
            for index, rate in enumerate(args.rates):
                chats = mixed(args.num_requests, 10 + index, count)
                print(f"rate {rate:g}/s: {len(chats)} requests through the server ...", flush=True)
                measured = summarize(*through_server(chats, rate, index))
                arrivals = [float(t) for t in arrival_times(len(chats), rate, 1.0, index)]
                sim_records, sim_duration, _ = simulated(chats, arrivals, latency)
                predicted = summarize(sim_records, sim_duration)
                for name, get in METRICS:
                    p, m = get(predicted), get(measured)
                    rows.append((rate, name, p, m, (p - m) / m if m else float("nan")))
                    print(f"  {name:<14} predicted {p:9.1f}  measured {m:9.1f}  error {rows[-1][4]:+.1%}", flush=True)
        finally:
            server.stop()
    print("\n| rate (req/s) | metric | predicted | measured | error |\n|---|---|---|---|---|")
    for rate, name, p, m, error in rows:
        print(f"| {rate:g} | {name} | {p:.1f} | {m:.1f} | {error:+.1%} |")


if __name__ == "__main__":
    main()
