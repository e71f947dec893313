"""Latency targets against fixed budgets: one seeded Poisson mix of short chats and long documents through
`conveyor serve`, each setup in turn, in one run.

    python benchmarks/slo.py [--rates 0.5,1,1.5] [--num-requests 60] [--budgets 128 256 512 1024 2048]
                             [--ttft-ms 2000] [--itl-ms 150] [--simulate] [--out bench-results/slo]
                             [--model MODEL] [--busy-core]

Setups: the default config with ``[scheduler] max_num_batched_tokens`` fixed at each of ``--budgets``, and
the same config with latency targets (``ttft_slo_ms``, ``itl_slo_ms``; budget at most the largest of
``--budgets``). The workload: 80% chats (prompts of 30-200 tokens, 64-160 tokens out) and 20% documents
(1,200-1,800 tokens in, 16-48 out), arriving as a Poisson process at each rate of ``--rates`` (a seeded draw
of the mix per rate, the same for every setup: no rate finds the last one's prompts in the prefix cache),
greedy, ignore_eos. Printed per setup and rate: ITL p99 and TTFT p99 over the run, output tokens/s, requests refused
(429, or 400 for a prompt too long for the TTFT target alone), requests served and how many of them missed a
target, and goodput: requests per second that got their first token within the TTFT target and whose own ITL
P99 stayed within the ITL target (a refused request counts as missed). Then goodput against the request rate
for every setup, as a table and a plot (--out/goodput.png), and the run's records as JSON.

``--simulate``: the same workload, arrivals and setups through ``conveyor simulate``'s engine on a virtual
clock (the real scheduler, a cost model calibrated by a short real run here), its goodput printed beside the
measured one.

``--model``: a benchmark shape of benchmarks/models.py (``llama-3.2-1b:Q4_0``, written on first use), a .gguf
file or a Hugging Face directory served by every setup (and simulated) in place of the default model; the
workload's token counts are its tokenizer's.

``--busy-core``: every setup run a second time with a neighbour on the machine: a process that keeps one core
busy (a Python loop that never sleeps), started when the measured requests start (the server was warmed up on a quiet
machine, so its step-time model must follow the change while serving); labelled "+ busy core".

The targets are what a user would set, not what the benchmark tunes: pick rates near this machine's capacity
(the first rate at which the fixed budgets start missing).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import random
import sys
import tempfile
from pathlib import Path

import msgspec
from models import resolve_model as resolve_benchmark_model
from neighbour import busy_core

from conveyor.bench.command import _tokenizer
from conveyor.bench.datasets import mixed
from conveyor.bench.load import BenchRequest, LoadOptions, run_load, served_model
from conveyor.bench.server import Server
from conveyor.bench.stats import meets_slos, summarize

DEFAULT = Path(__file__).resolve().parent.parent / "configs" / "default.toml"


def workload(num_requests: int, seed: int, tokenizer_path: str | None = None) -> list[BenchRequest]:
    """Chats and documents, in a seeded order (lengths in the tokens of ``tokenizer_path``'s tokenizer, a .gguf
    or a directory; default: the default model's)."""
    tokenizer = _tokenizer(tokenizer_path)

    def count(messages):
        return len(tokenizer.encode_chat(messages))

    documents = num_requests // 5
    chats = mixed(num_requests - documents, seed, count, input_len=(30, 200), output_len=(64, 160))
    docs = mixed(documents, seed + 1, count, input_len=(1200, 1800), output_len=(16, 48))
    requests = [BenchRequest(c.messages, None, count(c.messages), c.max_tokens) for c in chats + docs]
    random.Random(seed).shuffle(requests)
    return requests


def run_setup(label: str, overrides: list[str], workloads: list[list[BenchRequest]], rates: list[float], seed: int,
              slos_ms: dict[str, float], tokenizer_path: str | None = None, busy: bool = False) -> list[dict]:
    runs = []
    # (a prompt of its own: it leaves nothing in the prefix cache for the runs)
    warm_up = workload(1, seed + 1000, tokenizer_path)
    with tempfile.TemporaryDirectory() as tmp:
        print(f"== {label}: starting conveyor serve ({' '.join(overrides) or 'default config'})", flush=True)
        server = Server(DEFAULT.read_text().replace("port = 8000", "port = 0"), Path(tmp),
                        overrides=["server.status_interval=0", *overrides]).start()
        try:
            for rate, requests in zip(rates, workloads):
                print(f"   {label}: {len(requests)} requests at {rate} requests/s ...", flush=True)

                async def run():
                    import httpx

                    async with httpx.AsyncClient() as client:
                        model = await served_model(client, server.http)
                    options = LoadOptions(rate=rate, seed=seed, ignore_eos=True)
                    await run_load(server.http, model, warm_up, LoadOptions(ignore_eos=True))
                    with busy_core() if busy else contextlib.nullcontext():
                        return await run_load(server.http, model, requests, options)

                records, duration = asyncio.run(run())
                summary = summarize(records, duration, slos_ms)
                # (429: the queue would make it late; 400 naming the target: its prompt alone would be)
                refused = sum(1 for r in records if r.error is not None and (
                    r.error.startswith("HTTP 429") or r.error.startswith("HTTP 400") and "TTFT target" in r.error))
                late = sum(1 for r in records if r.ok and not meets_slos(r, slos_ms))
                runs.append({"label": label, "rate": rate, "summary": summary, "refused": refused, "late": late,
                             "records": msgspec.to_builtins(records)})
                print(f"   {label} @ {rate}/s: ITL p99 {summary['itl_ms']['p99']:.0f} ms, "
                      f"TTFT p99 {summary['ttft_ms']['p99']:.0f} ms, "
                      f"{summary['output_throughput']:.1f} tok/s, {refused} refused, {late} of {summary['completed']} "
                      f"served missed a target, goodput "
                      f"{summary['goodput']:.2f} req/s", flush=True)
        finally:
            server.stop()
    return runs


def simulate_setups(setups, workloads: list[list[BenchRequest]], rates: list[float], seed: int,
                    slos_ms: dict[str, float], model: str | None = None,
                    tokenizer_path: str | None = None) -> dict[tuple[str, float], float]:
    """Goodput of each (setup, rate) as ``conveyor simulate`` predicts it (``model``: a ``model.path`` in place
    of the default model's)."""
    from conveyor.bench.arrivals import arrival_times
    from conveyor.bench.simulator import SimRequest, hardware_costs, resolve_model, simulate
    from conveyor.config import load_config, parse_override

    tokenizer = _tokenizer(tokenizer_path)
    sim_workloads = [[SimRequest(tokenizer.encode_chat(r.messages), r.max_tokens) for r in requests]
                     for requests in workloads]
    model_overrides = {"model.path": model} if model else {}
    if model:
        from conveyor.model.checkpoint import open_checkpoint

        spec = open_checkpoint(model).spec
    else:
        spec = resolve_model("smollm2-135m")
    peaks, cost = hardware_costs("cpu", load_config(DEFAULT, model_overrides), spec)
    goodput = {}
    for label, overrides in setups:
        config = load_config(DEFAULT, {**model_overrides, **dict(parse_override(o) for o in overrides)})
        for rate, sim_requests in zip(rates, sim_workloads):
            arrivals = [float(t) for t in arrival_times(len(sim_requests), rate, 1.0, seed)]
            records, duration, _ = simulate(config, spec, sim_requests, arrivals, cost, peaks)
            goodput[label, rate] = summarize(records, duration, slos_ms)["goodput"]
    return goodput


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label in dict.fromkeys(r["label"] for r in runs):
        mine = [r for r in runs if r["label"] == label]
        ax.plot([r["rate"] for r in mine], [r["summary"]["goodput"] for r in mine], marker="o", label=label,
                linewidth=2.5 if label.startswith("targets") else 1.2)
    ax.set_xlabel("offered requests/s")
    ax.set_ylabel("goodput (requests/s within both targets)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="0.5,1,1.5", help="requests/s, comma-separated")
    parser.add_argument("--num-requests", type=int, default=60)
    parser.add_argument("--budgets", nargs="+", type=int, default=[128, 256, 512, 1024, 2048])
    parser.add_argument("--ttft-ms", type=float, default=2000)
    parser.add_argument("--itl-ms", type=float, default=150)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--simulate", action="store_true", help="also predict each goodput with conveyor simulate")
    parser.add_argument("--out", default="bench-results/slo")
    parser.add_argument("--busy-core", action="store_true",
                        help="run every setup again beside a process that keeps one core busy")
    parser.add_argument("--model", help="a shape of benchmarks/models.py (llama-3.2-1b:Q4_0), a .gguf file or a "
                                        "Hugging Face directory (default: the default model)")
    args = parser.parse_args()
    model = resolve_benchmark_model(args.model) if args.model else None
    # (an alias names no file: its tokenizer is the default one)
    tokenizer_path = model if model and Path(model).exists() else None
    rates = [float(r) for r in args.rates.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"# {platform.processor() or platform.machine()}; targets: TTFT {args.ttft_ms:.0f} ms, "
          f"ITL {args.itl_ms:.0f} ms (P99)", flush=True)
    # the same mix at every rate, a draw of its own each (a rate's prompts are not in the cache from the last)
    workloads = [workload(args.num_requests, args.seed + i, tokenizer_path) for i in range(len(rates))]
    slos_ms = {"ttft": args.ttft_ms, "itl": args.itl_ms}
    setups = [(f"fixed {b}", [f"scheduler.max_num_batched_tokens={b}"]) for b in args.budgets]
    setups.append(("targets", [f"scheduler.max_num_batched_tokens={max(args.budgets)}",
                               f"scheduler.ttft_slo_ms={args.ttft_ms}", f"scheduler.itl_slo_ms={args.itl_ms}"]))
    runs = []
    served = [f"model.path={model}"] if model else []
    for label, overrides in setups:
        runs += run_setup(label, [*served, *overrides], workloads, rates, args.seed, slos_ms, tokenizer_path)
        if args.busy_core:  # (a server of its own: nothing of the quiet run's in its prefix cache)
            runs += run_setup(f"{label} + busy core", [*served, *overrides], workloads, rates, args.seed, slos_ms,
                              tokenizer_path, busy=True)
    predicted = (simulate_setups(setups, workloads, rates, args.seed, slos_ms, model, tokenizer_path)
                 if args.simulate else {})
    print("\n| setup | req/s | ITL p99 ms | TTFT p99 ms | output tok/s | refused | served, late | goodput req/s |"
          + (" simulated goodput |" if predicted else ""))
    print("|---|---|---|---|---|---|---|---|" + ("---|" if predicted else ""))
    for run in runs:
        s = run["summary"]
        simulated = predicted.get((run["label"], run["rate"]))
        print(f"| {run['label']} | {run['rate']} | {s['itl_ms']['p99']:.0f} | {s['ttft_ms']['p99']:.0f} | "
              f"{s['output_throughput']:.1f} | {run['refused']} | {s['completed']}, {run['late']} | "
              f"{s['goodput']:.2f} |"
              + (f" {simulated:.2f} |" if simulated is not None else ""))
    (out / "slo.json").write_text(json.dumps(runs, indent=1, default=float))
    plot(runs, out / "goodput.png")
    print(f"\nwrote {out / 'slo.json'} and {out / 'goodput.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
