"""Conveyor and llama.cpp's server side by side on one GGUF file, in one run: a burst of mixed chats, then one stream.

    python benchmarks/compare.py --llama-server PATH [--model llama-3.2-1b:Q4_0] [--burst 32] [--slots 16]
                                 [--context 32768] [--stream-requests 4] [--tokens 128] [--out bench-results/compare]

Each server in turn (Conveyor with configs/default.toml, then ``llama-server -np SLOTS -t THREADS -c CONTEXT``)
serves, through its OpenAI API, streaming and greedy with ``ignore_eos``:

- the burst: ``--burst`` requests of the seeded mixed chat workload at once (`conveyor bench --dataset mixed`,
  prompts of about 70-640 tokens, outputs of 16-256, counted in the model's tokenizer): output tokens/s, TTFT and
  ITL P50 and P99;
- one stream: ``--stream-requests`` long answers one after another (benchmarks/latency.py's requests): ITL and
  TTFT P50.

Then a table with both and Conveyor's ratio to llama-server (throughput: higher is better; latencies: lower), the
CPU named, and each burst's JSON (every request's timings) under ``--out``. ``--model``: a shape of
benchmarks/models.py (written on first use), a .gguf file, or the default model (its GGUF) when left out.
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
from latency import llama_server, measure_itl
from models import resolve_model

from conveyor.bench.report import load_result
from conveyor.bench.server import Server
from conveyor.model.checkpoint import resolve_model_path
from conveyor.native import ggml_linear_path, load

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def burst(url: str, name: str, model: Path, args: argparse.Namespace) -> dict:
    """``--burst`` mixed chats at once through `conveyor bench`; the run's summary."""
    result = Path(args.out) / f"{name}-burst.json"
    command = [sys.executable, "-m", "conveyor", "bench", "--url", url, "--dataset", "mixed", "--num-requests",
               str(args.burst), "--ignore-eos", "--seed", str(args.seed), "--label", name, "--tokenizer", str(model),
               "--json", str(result)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return load_result(result)["summary"]


def measure(url: str, name: str, model: Path, args: argparse.Namespace) -> dict[str, float]:
    print(f"[{name}] the burst: {args.burst} mixed chats at once ...", file=sys.stderr, flush=True)
    summary = burst(url, name, model, args)
    if summary["failed"]:
        raise RuntimeError(f"{name}: {summary['failed']} requests of the burst failed: {summary['errors'][:1]}")
    print(f"[{name}] one stream: {args.stream_requests} requests of {args.tokens} tokens ...", file=sys.stderr,
          flush=True)
    stream = measure_itl(url, argparse.Namespace(requests=args.stream_requests, tokens=args.tokens))
    return {"burst_tok_s": summary["output_throughput"], "ttft_p50": summary["ttft_ms"]["p50"] / 1e3,
            "itl_p50": summary["itl_ms"]["p50"], "itl_p99": summary["itl_ms"]["p99"],
            "stream_itl_p50": stream["itl_p50"] * 1e3, "stream_ttft_p50": stream["ttft_p50"]}


ROWS = (("burst output tok/s", "burst_tok_s", "{:,.1f}"), ("burst TTFT p50 (s)", "ttft_p50", "{:,.1f}"),
        ("burst ITL p50 (ms)", "itl_p50", "{:,.0f}"), ("burst ITL p99 (ms)", "itl_p99", "{:,.0f}"),
        ("one stream ITL p50 (ms)", "stream_itl_p50", "{:,.1f}"), ("one stream TTFT p50 (s)", "stream_ttft_p50",
                                                                    "{:,.2f}"))


def table(ours: dict[str, float], theirs: dict[str, float]) -> str:
    lines = ["| | Conveyor | llama-server | ratio |", "|---|---|---|---|"]
    for title, key, form in ROWS:
        lines.append(f"| {title} | {form.format(ours[key])} | {form.format(theirs[key])} | "
                     f"{ours[key] / theirs[key]:.2f}x |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", required=True, metavar="PATH", help="llama.cpp's llama-server binary")
    parser.add_argument("--model", help="a shape of benchmarks/models.py (llama-3.2-1b:Q4_0) or a .gguf file "
                                        "(default: the default model's GGUF)")
    parser.add_argument("--burst", type=int, default=64, help="chats sent at once (default: 64)")
    parser.add_argument("--slots", type=int, default=16, help="llama-server's -np (default: 16)")
    parser.add_argument("--context", type=int, default=32768, help="llama-server's -c, for all slots (default: 32768)")
    parser.add_argument("--stream-requests", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128, help="tokens each one-stream request generates")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench-results/compare")
    args = parser.parse_args()
    model = Path(resolve_model(args.model) if args.model else resolve_model_path("smollm2-135m-instruct"))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        server = Server((CONFIGS / "default.toml").read_text(), Path(tmp),
                        overrides=["transport.0.port=0", "server.status_interval=0", f"model.path={model}"]).start()
        try:
            ours = measure(server.http, "conveyor", model, args)
        finally:
            server.stop()
    with llama_server(args.llama_server, model, args.slots, args.context) as url:
        theirs = measure(url, "llama-server", model, args)
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    path = ggml_linear_path() if load() else "torch ops"
    print(f"\n{model.name}, {cpu}, {torch.get_num_threads()} threads, kernels {path}, {time.strftime('%Y-%m-%d')}; "
          f"burst of {args.burst} mixed chats, llama-server -np {args.slots} -c {args.context}\n")
    print(table(ours, theirs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
