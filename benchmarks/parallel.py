"""One engine, split or replicated: TP=1, TP=3 (steps in turn and overlapped), PP=2, DP=2 and Ray, each serving the same mixed workload.

    python benchmarks/parallel.py [--setups tp1 tp3 tp3-async pp2 dp2 ray-tp3] [--num-requests 32]
                                  [--out bench-results/parallel]

For each setup it starts `conveyor serve` (SmolLM2, bf16) on a free port,
runs `conveyor bench` with the seeded mixed chat workload (all requests at
once, ignore_eos), and stops the server. Every worker process gets one
thread (`engine.num_threads=1`), so on a 2-core machine TP=3 puts three
workers on two cores. It prints, per setup: output tokens/s, TTFT and ITL
p50, and from the server's own metrics the mean step time split into
compute and communication (collectives and pipeline transfers), each rank's
step time, and the pipeline's bubble fraction; then the comm share's growth
with TP. Results (JSON per setup, table, plot) go under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from conveyor.bench.server import Server

CONFIG = '[server]\nstatus_interval = 0\n\n[[transport]]\nplugin = "http"\nport = 0\n'
# setup -> config keys (SmolLM2's 9 query and 3 KV heads split 3 ways, not 2)
SETUPS: dict[str, dict[str, object]] = {
    "tp1": {},
    "tp3": {"parallel.tensor_parallel_size": 3},
    "tp3-async": {"parallel.tensor_parallel_size": 3, "engine.async_scheduling": "on"},
    "pp2": {"parallel.pipeline_parallel_size": 2},
    "dp2": {"parallel.data_parallel_size": 2},
    "ray-tp3": {"parallel.tensor_parallel_size": 3, "parallel.executor": "ray"},
}


def run_setup(name: str, keys: dict[str, object], args: argparse.Namespace, out: Path) -> dict:
    overrides = ["engine.num_threads=1", "server.status_interval=0"]
    overrides += [f"{key}={value}" for key, value in keys.items()]
    print(f"== {name}: conveyor serve --set {' --set '.join(overrides)}", file=sys.stderr, flush=True)
    env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"} if keys.get("parallel.executor") == "ray" else {}
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(CONFIG, Path(tmp), overrides=overrides, env=env).start()
        try:
            result = out / f"{name}.json"
            subprocess.run(
                [sys.executable, "-m", "conveyor", "bench", "--url", server.http, "--dataset", "mixed",
                 "--num-requests", str(args.num_requests), "--request-rate", "inf", "--ignore-eos",
                 "--seed", str(args.seed), "--label", name, "--json", str(result)],
                check=True,
            )
        finally:
            server.stop()
    return json.loads(result.read_text())


def row(name: str, run: dict) -> dict:
    summary, server = run["summary"], run.get("server") or {}
    parallel = server.get("parallel") or {}
    return {
        "setup": name,
        "tok_s": summary["output_throughput"],
        "ttft_p50": summary["ttft_ms"]["p50"],
        "itl_p50": summary["itl_ms"]["p50"],
        "compute_ms": parallel.get("compute_ms"),
        "comm_ms": parallel.get("comm_ms"),
        "comm_share": parallel.get("comm_share"),
        "ranks": parallel.get("rank_step_ms", {}),
        "bubble": parallel.get("bubble_fraction"),
    }


def table(rows: list[dict]) -> str:
    def opt(value, fmt: str) -> str:
        return format(value, fmt) if value is not None else "-"

    lines = [(f"{'setup':<9}{'out tok/s':>10}{'TTFT p50':>10}{'ITL p50':>9}{'compute':>9}{'comm':>8}{'comm %':>8}"
             f"{'bubble':>8}  rank step ms"),
             f"{'':<9}{'':>10}{'ms':>10}{'ms':>9}{'ms/step':>9}{'ms/step':>8}{'':>8}{'':>8}"]
    for r in rows:
        ranks = " ".join(f"{v:.0f}" for v in r["ranks"].values()) or "-"
        share = opt(r["comm_share"] * 100 if r["comm_share"] is not None else None, ".0f")
        lines.append(f"{r['setup']:<9}{r['tok_s']:>10.1f}{r['ttft_p50']:>10.0f}{r['itl_p50']:>9.1f}"
                     f"{opt(r['compute_ms'], '.1f'):>9}{opt(r['comm_ms'], '.1f'):>8}{share:>8}"
                     f"{opt(r['bubble'], '.2f'):>8}  {ranks}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["setup"] for r in rows]
    left.bar(names, [r["tok_s"] for r in rows], color="tab:blue")
    left.set_ylabel("output tokens/s")
    left.set_title("throughput, mixed workload")
    compute = [r["compute_ms"] or 0 for r in rows]
    comm = [r["comm_ms"] or 0 for r in rows]
    right.bar(names, compute, label="compute", color="tab:green")
    right.bar(names, comm, bottom=compute, label="communication", color="tab:red")
    right.set_ylabel("ms per step (mean over workers)")
    right.set_title("where a multi-worker step goes")
    right.legend()
    fig.suptitle(f"Conveyor parallelism on {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    fig.tight_layout()
    fig.savefig(path)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench-results/parallel")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [row(name, run_setup(name, SETUPS[name], args, out)) for name in args.setups]
    text = table(rows)
    tp = [r for r in rows if r["setup"] in ("tp3", "ray-tp3") and r["comm_share"] is not None]
    if tp:
        text += "\n\ncommunication share of a step: " + ", ".join(
            f"{r['setup']} {r['comm_share'] * 100:.0f}%" for r in tp) + " (TP=1: none)"
    print("\n" + text)
    (out / "parallel.txt").write_text(text + "\n")
    print(f"plot: {plot(rows, out / 'parallel.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
