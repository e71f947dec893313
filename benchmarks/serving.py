"""Static vs dynamic vs continuous batching as a server: the same request-rate sweep against each config.

    python benchmarks/serving.py [--configs static dynamic default] [--sweep 0.25,0.5,1,inf]
                                 [--num-requests 32] [--out bench-results] [--reuse]

For each config in configs/, it starts `conveyor serve` on a free port, runs
`conveyor bench --sweep` with the seeded mixed chat workload (prompts ~30-600
tokens, outputs 16-256, ignore_eos), and stops the server. Then it writes
the comparison table (comparison.txt) and plot (comparison.png) under --out,
next to each run's JSON (every request's timings) and its own plot.
`make bench` runs this with the defaults.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from conveyor.bench.server import Server

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["static", "dynamic", "default"])
    parser.add_argument("--sweep", default="0.25,0.5,1,inf")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench-results")
    parser.add_argument("--reuse", action="store_true", help="keep a config's results already in --out")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.configs:
        config = CONFIGS / f"{name}.toml"
        if args.reuse and (out / f"{name}.json").exists():
            results.append(str(out / f"{name}.json"))
            continue
        print(f"== {name}: starting conveyor serve {config.relative_to(CONFIGS.parent)}", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            server = Server(config.read_text(), Path(tmp), overrides=["transport.0.port=0", "server.status_interval=0"])
            server.start()
            try:
                result = out / f"{name}.json"
                command = [sys.executable, "-m", "conveyor", "bench", "--url", server.http, "--dataset", "mixed",
                           "--num-requests", str(args.num_requests), "--sweep", args.sweep, "--ignore-eos",
                           "--seed", str(args.seed), "--label", name, "--json", str(result),
                           "--plot", str(out / f"{name}.png")]
                subprocess.run(command, check=True)
                results.append(str(result))
            finally:
                server.stop()
    comparison = subprocess.run(
        [sys.executable, "-m", "conveyor", "bench", "compare", *results, "--plot", str(out / "comparison.png")],
        check=True, capture_output=True, text=True,
    ).stdout
    machine = (f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
               f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    text = f"{machine}\n{args.num_requests} mixed chat requests per rate, ignore_eos\n\n{comparison}"
    (out / "comparison.txt").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
