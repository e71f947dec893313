"""Eager vs compiled decode steps, and what compiling costs at start-up, in one run.

    python benchmarks/compiled.py [--batches 1 16 64] [--dtype bfloat16] [--tokens 48]

Decode: for each batch size B, B requests with ~40-token prompts decode
``--tokens`` tokens each (ignore_eos, greedy) through an engine with
``[engine] compile = "off"`` and one with ``"on"`` (the graphs of the default
``compile_batch_sizes``); printed: the median wall time of the steps that
decode all B requests.

Start-up: a fresh process builds an engine with compile on, twice over one
new inductor cache directory: cold (nothing cached) and warm (a restart).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from conveyor.config import load_config
from conveyor.engine.core import EngineCore
from conveyor.messages import EngineRequest
from conveyor.sampling import SamplingParams


def step_ms(core: EngineCore, batch: int, tokens: int) -> float:
    """Median milliseconds of the steps that decode all ``batch`` requests."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0)
    for i in range(batch):
        core.add_request(EngineRequest(f"b{batch}-{i}-{time.monotonic_ns()}", list(range(100 + i, 140 + i)), params))
    times = []
    while core.has_unfinished():
        start = time.perf_counter()
        _, stats = core.step()
        elapsed = time.perf_counter() - start
        if stats is not None and stats.num_prefill_tokens == 0 and stats.num_decode_tokens == batch:
            times.append(elapsed)
    return statistics.median(times) * 1e3


def startup(dtype: str) -> None:
    """(child process) Build an engine with compile on; print the seconds as JSON."""
    start = time.perf_counter()
    core = EngineCore(load_config(None, {"model.dtype": dtype, "engine.compile": "on"}))
    print(json.dumps({"seconds": time.perf_counter() - start}))
    core.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--startup", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.startup:
        startup(args.dtype)
        return 0
    results: dict[str, dict[int, float]] = {}
    for mode in ("off", "on"):
        print(f"[compile = {mode}] building the engine ...", flush=True)
        core = EngineCore(load_config(None, {"model.dtype": args.dtype, "engine.compile": mode}))
        step_ms(core, 1, 4)  # warm up
        results[mode] = {}
        for batch in args.batches:
            results[mode][batch] = step_ms(core, batch, args.tokens)
            print(f"[compile = {mode}] batch {batch}: {results[mode][batch]:.1f} ms per decode step", flush=True)
        core.shutdown()
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        seconds = []
        for label in ("cold", "warm"):
            print(f"[start-up] {label} inductor cache ...", flush=True)
            out = subprocess.run([sys.executable, __file__, "--startup", "--dtype", args.dtype], env=env, check=True,
                                 capture_output=True, text=True).stdout
            seconds.append(json.loads(out.strip().splitlines()[-1])["seconds"])
    eager = load_seconds(args.dtype)
    print()
    print(f"| decode step ({args.dtype}) | " + " | ".join(f"batch {b}" for b in args.batches) + " |")
    print("|---|" + "---|" * len(args.batches))
    for mode, label in (("off", "eager ms"), ("on", "compiled ms")):
        print(f"| {label} | " + " | ".join(f"{results[mode][b]:.1f}" for b in args.batches) + " |")
    print("| compiled / eager | " + " | ".join(f"{results['on'][b] / results['off'][b]:.2f}" for b in args.batches)
          + " |")
    print()
    print(f"start-up: eager {eager:.1f} s; compiled, cold cache {seconds[0]:.1f} s; warm cache {seconds[1]:.1f} s")
    return 0


def load_seconds(dtype: str) -> float:
    start = time.perf_counter()
    EngineCore(load_config(None, {"model.dtype": dtype, "engine.compile": "off"})).shutdown()
    return time.perf_counter() - start


if __name__ == "__main__":
    raise SystemExit(main())
