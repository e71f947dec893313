"""One stream at a time: inter-token latency through `conveyor serve`, next to two floors measured in the same run.

    python benchmarks/latency.py [--configs default bf16] [--requests 6] [--tokens 128] [--set KEY=VALUE ...]
                                 [--async-scheduling off on] [--llama-server PATH] [--rounds N] [--model MODEL]

For each config of configs/ (default: the GGUF's blocks kept packed; bf16: every weight expanded to bf16;
int8: W8A16) it starts
`conveyor serve` on a free port and sends chat requests one after
another (greedy, ignore_eos, ``--tokens`` each) through the streaming OpenAI
API, then prints ITL p50/p90/p99 and TTFT p50. The floors, measured in this
process while no server runs:

- bandwidth floor: the bytes of every weight read for one token (the model
  as that config's quant method stores it) over this machine's read bandwidth
  (summing a 1 GiB tensor, best of several);
- ``--async-scheduling off on``: each config served once per mode of
  ``[engine] async_scheduling``, in turn, in this run;
- linear floor: the model's linear layers and output head alone at one
  token (each layer's weights in turn, as a forward pass reads them).

A step can beat neither; the gap between ITL and the linear floor is the
engine's own per-token cost (attention, norms, sampling, the engine loop,
detokenizing, HTTP). Where the bf16 config runs too, each ITL is also given
against its bandwidth floor (what reading the model at bf16 would cost).

``--model``: a benchmark shape of benchmarks/models.py (``llama-3.2-1b:Q4_0``,
written on first use) or a .gguf file or Hugging Face directory, in place of
the default model, for every config.

``--llama-server PATH``: llama.cpp's server (any build of ``llama-server``)
serves the same GGUF file (the default model's, or ``--model``'s) in the same run, one slot and as many
threads as torch has (``-np 1 -t N``), and gets the same requests, after the
configs in each round. ``--rounds N`` serves every config (and llama-server)
N times in turn, so that a machine whose speed drifts during the run drifts
for all of them alike; the floors are measured once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import platform
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from models import resolve_model

from conveyor.bench.load import BenchRequest, LoadOptions, run_load, served_model
from conveyor.bench.server import Server
from conveyor.bench.stats import percentiles
from conveyor.config import load_config
from conveyor.executor.mp import free_port
from conveyor.model.checkpoint import resolve_model_path
from conveyor.perf.floors import linear_seconds, read_bandwidth
from conveyor.registry import PluginRegistry
from conveyor.worker.worker import Worker

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
QUESTIONS = [
    "Write a long story about a lighthouse keeper and the sea.",
    "Explain in detail how a steam engine works.",
    "Describe the history of the printing press.",
    "List everything you know about volcanoes.",
]


def linear_floor(path: Path, overrides: dict[str, str]) -> tuple[float, int]:
    """Seconds for every linear layer and the output head at one token, and the model's weight bytes."""
    config = load_config(path, overrides)
    worker = Worker(config, PluginRegistry.of(config))
    worker.load_model()
    seconds = linear_seconds(worker.model, 1, repeat=20)
    weight_bytes = worker.model.num_weight_bytes()
    worker.shutdown()
    return seconds, weight_bytes


def serve_itl(path: Path, args: argparse.Namespace, extra: list[str]) -> dict[str, float]:
    overrides = args.set + extra
    with tempfile.TemporaryDirectory() as tmp:
        text = path.read_text().replace("port = 8000", "port = 0")
        server = Server(text, Path(tmp), overrides=overrides, echo=args.verbose).start()
        try:
            return measure_itl(server.http, args)
        finally:
            server.stop()


def llama_server_itl(binary: str, args: argparse.Namespace) -> dict[str, float]:
    """The same requests through llama.cpp's server on the GGUF file the configs serve."""
    overrides = dict(item.split("=", 1) for item in args.set)
    model = resolve_model_path(load_config(CONFIGS / "default.toml", overrides).model.path)
    with llama_server(binary, model, slots=1, verbose=args.verbose) as url:
        return measure_itl(url, args)


@contextlib.contextmanager
def llama_server(binary: str, model: Path, slots: int, context: int = 0, verbose: bool = False) -> Iterator[str]:
    """llama.cpp's server on ``model``, ``slots`` requests at once (``-np``; ``context``: tokens of KV cache for
    them all, ``-c``; 0: the model's context for each slot) and as many threads as torch has; yields its URL once
    /health answers."""
    import httpx

    port = free_port()
    command = [binary, "-m", str(model), "-np", str(slots), "-t", str(torch.get_num_threads()), "--host",
               "127.0.0.1", "--port", str(port), *(["-c", str(context)] if context else [])]
    server = subprocess.Popen(command, stdout=None if verbose else subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"{binary} exited with {server.returncode} before serving")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{binary} did not serve within 300 s")
            time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


def measure_itl(url: str, args: argparse.Namespace) -> dict[str, float]:
    """One warm-up request, then ``args.requests`` one after another through the streaming chat API."""
    requests = [
        BenchRequest([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], None, 0, args.tokens)
        for i in range(args.requests + 1)
    ]

    async def run():
        import httpx

        async with httpx.AsyncClient() as client:
            model = await served_model(client, url)
        options = LoadOptions(max_concurrency=1, ignore_eos=True)
        await run_load(url, model, requests[:1], options)  # warm up
        records, _ = await run_load(url, model, requests[1:], options)
        return records

    records = asyncio.run(run())
    failed = [r.error for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    itl = percentiles([gap for r in records for gap in r.itl])
    ttft = percentiles([r.ttft for r in records])
    return {"itl_p50": itl["p50"], "itl_p90": itl["p90"], "itl_p99": itl["p99"], "ttft_p50": ttft["p50"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["default", "bf16"])
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for the server and the floors (repeatable)")
    parser.add_argument("--async-scheduling", nargs="+", default=["auto"], choices=["auto", "on", "off"],
                        help="serve each config once per mode (default: the config's own)")
    parser.add_argument("--llama-server", metavar="PATH", help="also serve the model's GGUF with this llama-server")
    parser.add_argument("--rounds", type=int, default=1, help="serve everything this many times, in turn")
    parser.add_argument("--verbose", action="store_true", help="echo the server's output")
    parser.add_argument("--model", help="a shape of benchmarks/models.py (llama-3.2-1b:Q4_0), a .gguf file or a "
                                        "Hugging Face directory (default: the configs' model)")
    args = parser.parse_args()
    if args.model:  # (an override like any other: the floors, every server and llama-server read it)
        args.set.append(f"model.path={resolve_model(args.model)}")
    overrides = dict(item.split("=", 1) for item in args.set)
    print(f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    bandwidth = read_bandwidth()
    print(f"read bandwidth: {bandwidth / 1e9:.1f} GB/s")
    floors = {}
    for name in args.configs:
        print(f"[{name}] floors ...", flush=True)
        floors[name] = linear_floor(CONFIGS / f"{name}.toml", overrides)
        gc.collect()
    rows = []
    for round in range(1, args.rounds + 1):
        suffix = f" (round {round})" if args.rounds > 1 else ""
        for name in args.configs:
            linear_s, weight_bytes = floors[name]
            for mode in args.async_scheduling:
                label = (name if args.async_scheduling == ["auto"] else f"{name}, async {mode}") + suffix
                print(f"[{label}] serving {args.requests} requests of {args.tokens} tokens, one at a time ...",
                      flush=True)
                served = serve_itl(CONFIGS / f"{name}.toml", args,
                                   [f"engine.async_scheduling={mode}"] if mode != "auto" else [])
                rows.append((label, weight_bytes, weight_bytes / bandwidth, linear_s, served))
        if args.llama_server:
            print(f"[llama-server{suffix}] serving the same requests ...", flush=True)
            served = llama_server_itl(args.llama_server, args)
            # (its weights: the file's tensors as stored, the default config's bytes)
            weight_bytes = floors["default"][1] if "default" in floors else float("nan")
            rows.append((f"llama-server{suffix}", weight_bytes, weight_bytes / bandwidth, float("nan"), served))
    bf16_floor = next((bw for name, _, bw, _, _ in rows if name.split(",")[0].split(" (")[0] == "bf16"), None)
    print()
    print("| config | weights MB | bandwidth floor ms | linear floor ms | ITL p50 ms | p90 | p99 | ITL p50 / bw floor "
          "| ITL p50 / bf16 bw floor | TTFT p50 ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, weight_bytes, bw_floor, linear_s, s in rows:
        vs_bf16 = f"{s['itl_p50'] / bf16_floor:.2f}x" if bf16_floor else "-"
        print(f"| {name} | {weight_bytes / 1e6:.0f} | {bw_floor * 1e3:.1f} | {linear_s * 1e3:.1f} "
              f"| {s['itl_p50'] * 1e3:.1f} | {s['itl_p90'] * 1e3:.1f} | {s['itl_p99'] * 1e3:.1f} "
              f"| {s['itl_p50'] / bw_floor:.2f}x | {vs_bf16} | {s['ttft_p50'] * 1e3:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
