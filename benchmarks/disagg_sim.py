"""Prefill/decode disaggregation against colocated replicas on the same GPUs, predicted by the simulator.

    python benchmarks/disagg_sim.py [--model llama-3-8b] [--hardware "H100 SXM"] [--num-requests 400]
                                    [--out bench-results/disagg]

Two GPUs either way: two colocated replicas (``data_parallel_size = 2``: each prefills and decodes, chunked
prefill under a 2,048-token budget, or a 512-token one that keeps decodes' steps shorter at some cost in
throughput) against one prefill and one decode engine (``prefill_engines = 1``,
``decode_engines = 1``; the prompt's KV crosses NVLink 4 at its datasheet bandwidth). Two workloads of the
kinds DistServe (OSDI'24) evaluates, as seeded random token ids: chat (prompts of 256-768 tokens, replies of
128-384) and summarization (prompts of 1,536-2,560 tokens, summaries of 64-192), each request arriving as a
Poisson process, each with latency targets a user would set: TTFT P99 and each request's own ITL P99 (40 ms,
a reading pace with room to spare; summarization again with a loose 100 ms and a tight 12 ms). Printed per
scenario and rate: the share of requests that meet both targets (SLO attainment, DistServe's measure),
goodput (requests/s that meet both) and the TTFT and ITL P99 of each setup; then, per workload, the highest
rate at which each setup keeps 90% attainment, as DistServe compares them; a plot of attainment against rate
(--out/attainment.png) and the runs as JSON.

The simulator's GPU model is the datasheet's (``conveyor.bench.costs``: assumed efficiencies, not
measurements on an H100), and its fleet model deals requests to the engines of a role in turn
(``conveyor.bench.sim_fleet``).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import msgspec

from conveyor.bench.arrivals import arrival_times
from conveyor.bench.costs import DEFAULT_INTERCONNECT, INTERCONNECTS
from conveyor.bench.sim_fleet import simulate_fleet
from conveyor.bench.sim_workload import SimRequest
from conveyor.bench.simulator import hardware_costs, resolve_model
from conveyor.bench.stats import meets_slos, summarize
from conveyor.config import load_config

# scenario -> (prompt tokens, output tokens, each a [low, high] range; targets: TTFT P99 and ITL P99, ms; the
# request rates swept)
WORKLOADS = {
    "chat": ((256, 768), (128, 384), {"ttft": 1000.0, "itl": 40.0}, (10, 20, 30, 40, 50, 60, 70, 80)),
    "summarization": ((1536, 2560), (64, 192), {"ttft": 4000.0, "itl": 40.0}, (4, 8, 12, 16, 20, 24, 28, 32)),
    "summarization, ITL 100 ms": ((1536, 2560), (64, 192), {"ttft": 4000.0, "itl": 100.0},
                                  (4, 8, 12, 16, 20, 24, 28, 32)),
    "summarization, ITL 12 ms": ((1536, 2560), (64, 192), {"ttft": 4000.0, "itl": 12.0},
                                 (4, 8, 12, 16, 20, 24, 28, 32)),
}
SETUPS = {
    "2 colocated replicas": {"parallel.data_parallel_size": 2},
    "2 colocated, 512-token chunks": {"parallel.data_parallel_size": 2, "scheduler.max_num_batched_tokens": 512},
    "1 prefill + 1 decode": {"parallel.prefill_engines": 1, "parallel.decode_engines": 1},
}
ENGINE = {"model.dtype": "bfloat16", "quant.plugin": "none", "model.max_model_len": 8192,
          "scheduler.max_num_batched_tokens": 2048, "scheduler.max_num_seqs": 256}


def requests(workload: str, n: int, seed: int, vocab: int) -> list[SimRequest]:
    (lo_in, hi_in), (lo_out, hi_out), _, _ = WORKLOADS[workload]
    rng = random.Random(seed)
    return [SimRequest([rng.randrange(2, vocab) for _ in range(rng.randint(lo_in, hi_in))],
                       rng.randint(lo_out, hi_out)) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--hardware", default="H100 SXM")
    parser.add_argument("--num-requests", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench-results/disagg")
    args = parser.parse_args()
    spec = resolve_model(args.model)
    link = INTERCONNECTS[DEFAULT_INTERCONNECT].bytes_per_second
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"# {args.model} on 2x {args.hardware} ({DEFAULT_INTERCONNECT}), simulated; {args.num_requests} requests "
          "per run", flush=True)
    runs = []
    simulated = {}  # (lengths, rate, setup) -> records and duration (scenarios that differ in targets alone share)
    for workload, (inputs, outputs, slos, rates) in WORKLOADS.items():
        print(f"\n## {workload}: targets TTFT P99 {slos['ttft']:.0f} ms, ITL P99 {slos['itl']:.0f} ms", flush=True)
        print("| rate (req/s) | setup | SLO attainment | goodput (req/s) | TTFT p99 (ms) | ITL p99 (ms) |")
        print("|---|---|---|---|---|---|")
        load = requests(workload, args.num_requests, args.seed, spec.vocab_size)
        for rate in rates:
            arrivals = [float(t) for t in arrival_times(len(load), rate, 1.0, args.seed)]
            for setup, keys in SETUPS.items():
                key = (inputs, outputs, rate, setup)
                if key not in simulated:
                    config = load_config(None, {**ENGINE, **keys})
                    peaks, cost = hardware_costs(args.hardware, config, spec)
                    simulated[key] = simulate_fleet(config, spec, load, arrivals, cost, peaks, link)[:2]
                records, duration = simulated[key]
                summary = summarize(records, duration, slos)
                attainment = sum(meets_slos(r, slos) for r in records) / len(records)
                runs.append({"workload": workload, "setup": setup, "rate": rate, "attainment": attainment,
                             "summary": summary})
                print(f"| {rate:g} | {setup} | {attainment:.0%} | {summary['goodput']:.2f} | "
                      f"{summary['ttft_ms']['p99']:.0f} | {summary['itl_ms']['p99']:.1f} |", flush=True)
    print("\nHighest rate with at least 90% of requests within both targets:")
    for workload in WORKLOADS:
        best = {setup: max((r["rate"] for r in runs if r["workload"] == workload and r["setup"] == setup
                            and r["attainment"] >= 0.9), default=0.0) for setup in SETUPS}
        print(f"  {workload}: " + ", ".join(f"{setup} {rate:g} req/s" for setup, rate in best.items()))
    (out / "runs.json").write_text(json.dumps(msgspec.to_builtins(runs), indent=1))
    plot(runs, out / "attainment.png")


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(WORKLOADS), figsize=(4.6 * len(WORKLOADS), 3.6), squeeze=False)
    for ax, workload in zip(axes[0], WORKLOADS):
        for setup in SETUPS:
            mine = [r for r in runs if r["workload"] == workload and r["setup"] == setup]
            ax.plot([r["rate"] for r in mine], [100 * r["attainment"] for r in mine], marker="o", label=setup)
        ax.axhline(90, color="grey", linewidth=0.8, linestyle="--")
        ax.set(title=workload, xlabel="requests/s", ylabel="% within TTFT and ITL targets", ylim=(0, 102))
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
