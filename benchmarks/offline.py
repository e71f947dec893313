"""Offline throughput: one seeded mixed workload through every scheduler x KV layout,
and through Hugging Face transformers' generate() in static batches, in one run.

    python benchmarks/offline.py [--num-requests 64] [--dtype bfloat16] [--kv-gb 1.0] [--only NAME ...]
                                 [--busy-core] [--model MODEL]

The workload: chat requests with prompts of ~30-600 tokens and outputs of
16-256 tokens (ignore_eos, greedy), all submitted at t=0. Reported per system:
output tokens/s (requested tokens only), mean and P99 request latency from
t=0, peak KV memory reserved and actually used, preemptions, wasted slots.
``--busy-core``: each system runs again while another process keeps one core
busy (a Python loop that never sleeps: a noisy neighbour, or a container
given fewer cores than it sees), and the slowdown is printed; losing one of
two cores costs at most 2x in proportion, more where threads wait on each
other.

``--model``: a benchmark shape of benchmarks/models.py (``llama-3.2-1b:Q4_0``,
written on first use), a .gguf file or a Hugging Face directory in place of
the default model, for every system; transformers reads a GGUF through its
own loader (blocks dequantized; llama.cpp's ``rope_freqs`` ignored, which
changes the text, not the speed).

NOTE: on a 2-core CPU every system pays for prefill at the matmul ceiling
(about 360 GFLOP/s in bf16). Decode is where the schedulers differ: a step
costs a fixed part (reading every weight) plus a part per running
request, so continuous batching wins by running fewer, fuller steps. The C++
CPU kernels (conveyor.native) read each sequence's K and V once, in place;
without them (no compiler) the torch path gathers the blocks first and
decode at 64 running requests is bound by that memory traffic.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import conveyor  # noqa: F401, I001 -- first: it sets OpenMP's wait policy before torch loads the runtime
import torch

from conveyor import LLM
from conveyor.bench.datasets import mixed
from conveyor.config import load_config
from conveyor.entrypoints.llm import OFFLINE_DEFAULTS
from conveyor.messages import StepStats
from conveyor.model.checkpoint import resolve_model_path
from conveyor.model.tokenizer import load_tokenizer
from conveyor.config import paths
from conveyor.perf.floors import linear_flops_per_token, linear_seconds, matmul_flops
from conveyor.perf.peaks import cpu_peaks
from conveyor.sampling import SamplingParams
from models import DEFAULT_MODEL, resolve_model
from neighbour import busy_core

CONFIGS = Path(__file__).resolve().parent.parent / "configs"

# name -> (config file, overrides); continuous batching with the offline LLM's step budget (the server's
# default is smaller, for inter-token latency)
SYSTEMS = {
    "static + contiguous": ("static.toml", {"kvcache.plugin": "contiguous"}),
    "static + paged": ("static.toml", {}),
    "dynamic + contiguous": ("dynamic.toml", {"kvcache.plugin": "contiguous"}),
    "dynamic + paged": ("dynamic.toml", {}),
    "continuous + contiguous": ("contiguous.toml", OFFLINE_DEFAULTS),
    "continuous + paged": ("default.toml", OFFLINE_DEFAULTS),
    # the default with steps overlapped ([engine] async_scheduling; "auto" leaves it off on a CPU)
    "continuous + paged, async scheduling": ("default.toml", {**OFFLINE_DEFAULTS, "engine.async_scheduling": "on"}),
    # the default with every weight expanded to bf16 (a quantized GGUF's blocks are kept packed by default)
    "continuous + paged, bf16 weights": ("bf16.toml", OFFLINE_DEFAULTS),
}
HF = "transformers generate (batches of 16)"


@dataclass
class Result:
    system: str
    output_tokens: int
    seconds: float
    mean_latency: float
    p99_latency: float
    kv_reserved_mib: float
    kv_used_mib: float
    preemptions: int = 0
    wasted_slots: int = 0
    # output tokens/s this machine allows for the steps this system ran (Conveyor only; 0: not measured)
    ceiling: float = 0.0
    # the same, with the steps' other memory traffic (K and V read and written, activations) at the measured
    # read bandwidth: attention's part that no kernel can skip
    ceiling_with_kv: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def progress(name: str, done: int, total: int, tokens: int, start: float, last: list[float]) -> None:
    now = time.perf_counter()
    if now - last[0] >= 5 or done == total:
        last[0] = now
        print(f"  {name}: {done}/{total} requests done, {tokens} tokens, {now - start:.0f} s", flush=True)


def run_conveyor(name: str, prompts: list[list[int]], max_tokens: list[int], dtype: str, kv_gb: float,
                 matmul_rate: float, bandwidth: float, model: dict[str, str]) -> Result:
    """The workload through ``LLM.generate``: the engine path the server takes, in this process."""
    config_file, overrides = SYSTEMS[name]
    llm = LLM(CONFIGS / config_file, {**model, "model.dtype": dtype, "kvcache.memory_gb": kv_gb, **overrides})
    bytes_per_token = llm.engine.kvcache.spec.bytes_per_token
    # warm-up: one short request, so thread pools and allocators are ready
    llm.generate([prompts[0][:32]], SamplingParams(max_tokens=2, temperature=0))
    finished_before = llm.engine.scheduler.stats().num_finished
    peaks = {"reserved": 0, "used": 0, "tokens": 0}
    steps: list[tuple[int, int]] = []  # (prompt tokens, decode tokens) of each step
    other_bytes = [0.0]  # the steps' memory traffic besides the weights (conveyor.perf.roofline)
    weight_bytes = llm.engine.info.weight_bytes
    start = time.perf_counter()
    last = [start]

    def observe(stats: StepStats) -> None:
        if stats.num_prefill_tokens or stats.num_decode_tokens:
            steps.append((stats.num_prefill_tokens, stats.num_decode_tokens))
            other_bytes[0] += max(0.0, stats.bytes_moved - weight_bytes)
        peaks["reserved"] = max(peaks["reserved"], stats.kv.reserved_tokens)
        peaks["used"] = max(peaks["used"], stats.kv.used_tokens)
        peaks["tokens"] += stats.num_decode_tokens
        progress(name, stats.scheduler.num_finished - finished_before, len(prompts), peaks["tokens"], start, last)

    llm.client.stats_observers.append(observe)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in max_tokens]
    completions = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    latencies = [c.latency for c in completions]
    scheduler = llm.engine.scheduler.stats()
    output_tokens = sum(len(c.token_ids) for c in completions)
    print(f"  {name}: measuring the ceiling of its {len(steps)} steps ...", flush=True)
    ceiling_s = ceiling_seconds(llm.engine.executor.worker.model, steps, matmul_rate)
    llm.close()
    return Result(
        name, output_tokens, seconds, sum(latencies) / len(latencies),
        percentile(latencies, 99), peaks["reserved"] * bytes_per_token / 2**20,
        peaks["used"] * bytes_per_token / 2**20, scheduler.num_preemptions, scheduler.num_wasted_slots,
        output_tokens / ceiling_s, output_tokens / (ceiling_s + other_bytes[0] / bandwidth),
    )


def ceiling_seconds(model, steps: list[tuple[int, int]], matmul_rate: float) -> float:
    """The shortest time the steps could take here: each step's prompt tokens at the faster of the measured
    matmul rate and the model's own linear layers at 512 rows (their FLOPs; a CPU without a fast bf16 matmul
    runs a quantized model's prompts in its integer kernels), plus its decode tokens at the speed of the
    model's own linear layers and output head at that batch size (measured once per batch size)."""
    flops = linear_flops_per_token(model)
    rate = max(matmul_rate, flops * 512 / linear_seconds(model, 512, repeat=3, head=False))
    decode_times: dict[int, float] = {}
    total = 0.0
    for prompt_tokens, decode_tokens in steps:
        total += prompt_tokens * flops / rate
        if decode_tokens:
            if decode_tokens not in decode_times:
                decode_times[decode_tokens] = linear_seconds(model, decode_tokens, repeat=5)
            total += decode_times[decode_tokens]
    return total


def run_transformers(prompts: list[list[int]], max_tokens: list[int], dtype: str, batch_size: int,
                     model_path: str) -> Result:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    path = resolve_model_path(model_path)
    if path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype))
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                     dtype=getattr(torch, dtype))
    model.eval()
    config = model.config
    bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * (
        config.hidden_size // config.num_attention_heads
    ) * torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    pad = 2
    with torch.inference_mode():  # warm-up
        model.generate(torch.tensor([prompts[0][:32]]), max_new_tokens=2, do_sample=False, pad_token_id=pad)
    start = time.perf_counter()
    latencies, tokens, peak_reserved, peak_used, last = [], 0, 0, 0, [start]
    for first in range(0, len(prompts), batch_size):
        batch, limits = prompts[first : first + batch_size], max_tokens[first : first + batch_size]
        width, new = max(len(p) for p in batch), max(limits)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            # one max_new_tokens for the whole batch; min_new_tokens plays ignore_eos
            model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad
            )
        latencies += [time.perf_counter() - start] * len(batch)
        tokens += sum(limits)  # tokens past a request's own max_tokens are waste
        peak_reserved = max(peak_reserved, len(batch) * (width + new))
        peak_used = max(peak_used, sum(len(p) + n for p, n in zip(batch, limits)))
        progress(HF, len(latencies), len(prompts), tokens, start, last)
    seconds = time.perf_counter() - start
    return Result(
        HF, tokens, seconds, sum(latencies) / len(latencies), percentile(latencies, 99),
        peak_reserved * bytes_per_token / 2**20, peak_used * bytes_per_token / 2**20,
    )


def table(results: list[Result]) -> str:
    header = (
        f"| {'system':<38} | tokens/s | ceiling tokens/s | of ceiling | with KV reads | of it |"
        " mean latency s | P99 latency s |"
        " KV reserved MiB | KV used MiB | preemptions | wasted slots |"
    )
    lines = [header, "|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|"]
    for r in results:
        lines.append(
            f"| {r.system:<38} | {r.tokens_per_s:>8.1f} | {r.ceiling:>16.0f} |"
            f" {f'{r.tokens_per_s / r.ceiling:.0%}' if r.ceiling else '-':>10} |"
            f" {r.ceiling_with_kv:>13.0f} | {f'{r.tokens_per_s / r.ceiling_with_kv:.0%}' if r.ceiling else '-':>5} |"
            f" {r.mean_latency:>14.1f} | {r.p99_latency:>13.1f} |"
            f" {r.kv_reserved_mib:>15.0f} | {r.kv_used_mib:>11.0f} | {r.preemptions:>11} | {r.wasted_slots:>12} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--kv-gb", type=float, default=1.0, help="KV cache memory for every Conveyor system")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--only", nargs="+", choices=[*SYSTEMS, "transformers"], help="run only these systems")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--busy-core", action="store_true",
                        help="run each system again beside a process that keeps one core busy")
    parser.add_argument("--model", help="a shape of benchmarks/models.py (llama-3.2-1b:Q4_0), a .gguf file or a "
                                        f"Hugging Face directory (default: the configs' model, {DEFAULT_MODEL})")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    # (a config override, where given: every Conveyor system and the tokenizer read it)
    model = {"model.path": resolve_model(args.model)} if args.model else {}

    tokenizer = load_tokenizer(load_config(CONFIGS / "default.toml", model).model)
    workload = mixed(args.num_requests, args.seed, lambda m: len(tokenizer.encode_chat(m)))
    prompts = [tokenizer.encode_chat(r.messages) for r in workload]
    max_tokens = [r.max_tokens for r in workload]
    print(
        f"workload: {len(prompts)} chat requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens "
        f"(mean {sum(map(len, prompts)) / len(prompts):.0f}), outputs {min(max_tokens)}-{max(max_tokens)} tokens "
        f"(total {sum(max_tokens)}); {args.dtype}, {torch.get_num_threads()} threads",
        flush=True,
    )
    # (this CPU's cached profile: measured once, and without a 2048-cubed bf16 matmul where a small one shows
    # bf16 is emulated, which takes minutes)
    peaks = cpu_peaks(paths.cache_root())
    matmul_rate = peaks.flops.get(args.dtype) or matmul_flops(getattr(torch, args.dtype))
    bandwidth = peaks.bytes_per_second
    print(f"matmul: {matmul_rate / 1e9:.0f} GFLOP/s ({args.dtype}); read bandwidth {bandwidth / 1e9:.1f} GB/s "
          f"(the CPU's profile)", flush=True)
    names = args.only or [*SYSTEMS, "transformers"]

    def run(name: str) -> Result:
        print(f"running {name if name != 'transformers' else HF} ...", flush=True)
        if name == "transformers":
            result = run_transformers(prompts, max_tokens, args.dtype, args.hf_batch_size,
                                      model.get("model.path", DEFAULT_MODEL))
        else:
            result = run_conveyor(name, prompts, max_tokens, args.dtype, args.kv_gb, matmul_rate, bandwidth, model)
        gc.collect()
        return result

    results = [run(name) for name in names]
    print()
    print(table(results))
    if args.busy_core:
        with busy_core():
            print("\nagain, beside a process that keeps one core busy", flush=True)
            beside = [run(name) for name in names]
        print()
        print(table(beside))
        for alone, shared in zip(results, beside):
            print(f"{alone.system}: {alone.tokens_per_s:.0f} tok/s alone, {shared.tokens_per_s:.0f} beside a busy "
                  f"core: {alone.tokens_per_s / shared.tokens_per_s:.2f}x slower")
    by_name = {r.system: r for r in results}
    best = by_name.get("continuous + paged")
    if best:
        for other in ("static + paged", "continuous + paged, bf16 weights", HF):
            if other in by_name:
                print(f"continuous + paged vs {other}: {best.tokens_per_s / by_name[other].tokens_per_s:.2f}x tokens/s")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in results], indent=2))


if __name__ == "__main__":
    main()
