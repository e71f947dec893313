"""Eager vs compiled decode steps, with and without the C++ element-wise kernels, and what compiling
costs at start-up, in one run.

    python benchmarks/compiled.py [--config default] [--batches 1 16 64] [--tokens 48]

Decode: for each batch size B, B requests with ~40-token prompts decode
``--tokens`` tokens each (ignore_eos, greedy) through four engines on
configs/CONFIG.toml: ``[engine] compile = "off"`` and ``"on"`` (the graphs of
the default ``compile_batch_sizes``), each with the C++ element-wise kernels
(RMSNorm with the residual add, rotary, SwiGLU) and without them (torch ops,
which inductor fuses by itself when compiling); the attention kernels stay.
Printed: the median wall time of the steps that decode all B requests.

On CUDA (where compiled graphs are also captured as CUDA graphs) the two
element-wise variants are one, so two engines run, and the share of HBM
bandwidth the batch-1 step reaches is printed: weight bytes / step time
against the card's peak (``--peak-gbps``, else by device name).

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
from pathlib import Path

from conveyor.attention.cpu_backend import CpuAttention
from conveyor.config import load_config
from conveyor.engine.core import EngineCore
from conveyor.messages import EngineRequest
from conveyor.sampling import SamplingParams

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
# (label, [engine] compile, the C++ element-wise kernels)
MODES = [
    ("eager, C++ element-wise", "off", True),
    ("eager, torch element-wise", "off", False),
    ("compiled, C++ element-wise", "on", True),
    ("compiled, inductor's fusion", "on", False),
]


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


def engine(path: Path, compile: str, elementwise: bool) -> EngineCore:
    """An engine on ``path``; ``elementwise``: the C++ element-wise kernels on (the "cpu" backend's choice)."""
    CpuAttention.fused_layers = elementwise
    try:
        return EngineCore(load_config(path, {"engine.compile": compile}))
    finally:
        CpuAttention.fused_layers = True


def startup(path: Path) -> None:
    """(child process) Build an engine with compile on; print the seconds as JSON."""
    start = time.perf_counter()
    core = EngineCore(load_config(path, {"engine.compile": "on"}))
    print(json.dumps({"seconds": time.perf_counter() - start}))
    core.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="default", help="a config of configs/ (default, int8, ...)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--peak-gbps", type=float, default=None, help="CUDA: the card's memory bandwidth")
    parser.add_argument("--startup", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    path = CONFIGS / f"{args.config}.toml"
    if args.startup:
        startup(path)
        return 0
    import torch

    cuda = torch.cuda.is_available()
    modes = [m for m in MODES if m[2]] if cuda else MODES
    results: dict[str, dict[int, float]] = {}
    weight_bytes = 0
    for label, compile, elementwise in modes:
        print(f"[{label}] building the engine ...", flush=True)
        core = engine(path, compile, elementwise)
        weight_bytes = core.info.weight_bytes
        step_ms(core, 1, 4)  # warm up
        results[label] = {}
        for batch in args.batches:
            results[label][batch] = step_ms(core, batch, args.tokens)
            print(f"[{label}] batch {batch}: {results[label][batch]:.1f} ms per decode step", flush=True)
        core.shutdown()
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        seconds = []
        for label in ("cold", "warm"):
            print(f"[start-up] {label} inductor cache ...", flush=True)
            out = subprocess.run([sys.executable, __file__, "--startup", "--config", args.config], env=env,
                                 check=True, capture_output=True, text=True).stdout
            seconds.append(json.loads(out.strip().splitlines()[-1])["seconds"])
    eager = load_seconds(path)
    print()
    print(f"| decode step ms ({args.config}) | " + " | ".join(f"batch {b}" for b in args.batches) + " |")
    print("|---|" + "---|" * len(args.batches))
    for label, _, _ in modes:
        print(f"| {label} | " + " | ".join(f"{results[label][b]:.1f}" for b in args.batches) + " |")
    print()
    if cuda and 1 in args.batches:
        from gpu_kernels import PEAKS

        name = torch.cuda.get_device_name()
        peak = args.peak_gbps or next((v for k, v in PEAKS.items() if k in name), None)
        for label, _, _ in modes:
            rate = weight_bytes / (results[label][1] / 1e3) / 1e9
            share = f" = {rate / peak:.0%} of {peak:.0f} GB/s" if peak else ""
            print(f"{label}, batch 1: {weight_bytes / 1e6:.0f} MB of weights per step, {rate:.0f} GB/s{share}")
    print(f"start-up: eager {eager:.1f} s; compiled, cold cache {seconds[0]:.1f} s; warm cache {seconds[1]:.1f} s")
    return 0


def load_seconds(path: Path) -> float:
    start = time.perf_counter()
    EngineCore(load_config(path, {"engine.compile": "off"})).shutdown()
    return time.perf_counter() - start


if __name__ == "__main__":
    raise SystemExit(main())
