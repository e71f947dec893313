"""Static vs dynamic vs continuous batching as a server: the same request-rate sweep against each config.

    python benchmarks/serving.py [--configs static dynamic default] [--sweep 0.25,0.5,1,inf]
                                 [--num-requests 32] [--out bench-results] [--reuse] [--model MODEL]

For each config in configs/, it starts `conveyor serve` on a free port, runs
`conveyor bench --sweep` with the seeded mixed chat workload (prompts ~30-600
tokens, outputs 16-256, ignore_eos), and stops the server. Then it writes
the comparison table (comparison.txt) and plot (comparison.png) under --out,
next to each run's JSON (every request's timings) and its own plot.
`make bench` runs this with the defaults. ``--model``: a benchmark shape of
benchmarks/models.py (``llama-3.2-1b:Q4_0``, written on first use), a .gguf
file or a Hugging Face directory served by every config in place of the
default model.
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
from models import resolve_model

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
    parser.add_argument("--model", help="a shape of benchmarks/models.py (llama-3.2-1b:Q4_0), a .gguf file or a "
                                        "Hugging Face directory (default: the configs' model)")
    args = parser.parse_args()
    path = resolve_model(args.model) if args.model else None
    model = [f"model.path={path}"] if path else []
    # (the workload's prompt lengths counted in the served model's tokens)
    tokenizer = ["--tokenizer", path] if path and Path(path).exists() else []
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
            server = Server(config.read_text(), Path(tmp),
                            overrides=["transport.0.port=0", "server.status_interval=0", *model])
            server.start()
            try:
                result = out / f"{name}.json"
                command = [sys.executable, "-m", "conveyor", "bench", "--url", server.http, "--dataset", "mixed",
                           "--num-requests", str(args.num_requests), "--sweep", args.sweep, "--ignore-eos",
                           "--seed", str(args.seed), "--label", name, "--json", str(result),
                           "--plot", str(out / f"{name}.png"), *tokenizer]
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
    text = (f"{machine}\n{args.model or 'default model'}: {args.num_requests} mixed chat requests per rate, "
            f"ignore_eos\n\n{comparison}")
    (out / "comparison.txt").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
