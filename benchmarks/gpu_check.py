"""Day one on a GPU: does every CUDA path work, and how fast? One command, minutes, a line per point.

    python benchmarks/gpu_check.py [--json gpu_check.json]   # one CUDA GPU: under 8 minutes on an H200
    python benchmarks/gpu_check.py --cpu-smoke               # the same code at tiny shapes on a CPU

Points, each printed as PASS, FAIL or SKIP with its numbers, all of them in the JSON file:

1. kernels: every Triton kernel against its torch reference at real shapes (the quantized GEMMs and
   paged attention of benchmarks/gpu_kernels.py, LoRA's shrink/expand, the fused MoE's grouped GEMM).
2. decode: a Llama-3-8B-shaped model with random weights made on the spot (``load_format = "dummy"``:
   nothing is downloaded) served by the real engine core: ITL at batch 1, 8 and 64, with CUDA graphs
   (``[engine] compile``) off and on, beside the HBM floor (the weights' bytes over the device's
   bandwidth) and the engine's own bandwidth utilization (MBU); graphs on and off give the same tokens.
3. prefill: 8 prompts of 1,024 tokens in one step: tokens/s and the share of the device's peak FLOP/s.
4. mp executor: the same requests through ``[parallel] executor = "mp"``: the model in a worker
   process, steps over ZeroMQ, the same greedy tokens as in-process. (One worker forms no process group:
   NCCL takes a second GPU, where ``tensor_parallel_size = 2`` is the check to run next.)
5. NVML: the GPU gauges /metrics serves (``conveyor.serving.nvml``), read from a scrape's registry.

``--cpu-smoke`` runs all of it at tiny shapes on the CPU, the kernels under ``TRITON_INTERPRET=1``;
CUDA graphs and NVML are SKIP there. The suite runs it (tests/test_gpu_check.py), so this script
cannot rot between the days a GPU is at hand. Exit status 1 when any point fails.

Expected on one H200 (the shape of the output; the numbers are what to look at):

    PASS kernels: quantized GEMMs and paged attention (gpu_kernels.py tables above), LoRA, fused MoE
    PASS decode b=1 graphs=off: ITL ... ms; HBM floor ... ms (...x); MBU ...%
    ...
    PASS decode b=64 graphs=on: ITL ... ms; ...
    PASS graphs on/off: the same greedy tokens (b=1, 8, 64)
    PASS prefill 8 x 1024: ... tokens/s; ...% of peak FLOP/s
    PASS mp executor: the same greedy tokens as in-process
    PASS NVML: conveyor_gpu_memory_used_bytes ... GB of ... GB
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Llama-3-8B's config.json (the fields the engine reads), and a tiny model of the same family for --cpu-smoke
LLAMA_3_8B = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
              "max_position_embeddings": 8192, "tie_word_embeddings": False}
TINY = {**LLAMA_3_8B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048}


class Report:
    """The points' lines as they come, and every number for the JSON file."""

    def __init__(self) -> None:
        self.points: list[dict] = []

    def add(self, status: str, name: str, text: str, **numbers) -> None:
        self.points.append({"status": status, "point": name, "text": text, **numbers})
        print(f"{status} {name}: {text}", flush=True)

    @property
    def failed(self) -> int:
        return sum(p["status"] == "FAIL" for p in self.points)


def kernels(report: Report, torch, device: str, smoke: bool) -> None:
    spec = importlib.util.spec_from_file_location("gpu_kernels", Path(__file__).with_name("gpu_kernels.py"))
    gpu_kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_kernels)
    peak = next((v for k, v in gpu_kernels.PEAKS.items() if k in torch.cuda.get_device_name()), None) \
        if device == "cuda" else None
    failures = (gpu_kernels.gemms(torch, device, smoke, peak) + gpu_kernels.ggml_gemms(torch, device, smoke, peak)
                + gpu_kernels.attention(torch, device, smoke))
    lora_error, moe_error = lora(torch, device, smoke), moe(torch, device, smoke)
    ok = failures == 0 and lora_error < 2e-2 and moe_error < 3e-2
    report.add("PASS" if ok else "FAIL", "kernels",
               f"quantized GEMMs (int8, fp8, GGUF blocks) and paged attention: {failures} mismatch(es) (tables "
               f"above); LoRA: relative error "
               f"{lora_error:.1e}; fused MoE: relative error {moe_error:.1e}",
               gemm_attention_failures=failures, lora_error=lora_error, moe_error=moe_error)


def lora(torch, device: str, smoke: bool) -> float:
    """LoRA's shrink and expand kernels against their float64 reference: the largest error over the largest
    output."""
    from conveyor.model.lora_kernels import lora_add, lora_reference

    tokens, hidden, out, rank, slots = (13, 48, 40, 8, 3) if smoke else (256, 4096, 4096, 16, 4)
    x = torch.randn(tokens, hidden, device=device).bfloat16()
    y = torch.randn(tokens, out, device=device).bfloat16()
    a = (torch.randn(slots, rank, hidden, device=device) / hidden**0.5).bfloat16()
    b = (torch.randn(slots, out, rank, device=device) / rank**0.5).bfloat16()
    token_slots = torch.randint(-1, slots, (tokens,), device=device, dtype=torch.int32)
    expected = lora_reference(x, y, a, b, token_slots)
    lora_add(x, y, a, b, token_slots)
    return float((y.double() - expected).abs().max() / expected.abs().max())


def moe(torch, device: str, smoke: bool) -> float:
    """The fused MoE (grouped GEMMs over experts) against a token-by-token float64 loop."""
    from conveyor.model.moe import activate
    from conveyor.model.moe_kernels import fused_moe

    tokens, experts, top_k, hidden, width = (11, 4, 2, 32, 48) if smoke else (256, 8, 2, 4096, 14336)
    x = torch.randn(tokens, hidden, device=device).bfloat16()
    gate_up = (torch.randn(experts, 2 * width, hidden, device=device) / hidden**0.5).bfloat16()
    down = (torch.randn(experts, hidden, width, device=device) / width**0.5).bfloat16()
    chosen = torch.stack([torch.randperm(experts, device=device)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, device=device).softmax(-1)
    out = fused_moe(x, gate_up, down, chosen, weights, "silu")
    expected = torch.zeros(tokens, hidden, dtype=torch.float64, device=device)
    for t in range(tokens):
        for j in range(top_k):
            e = int(chosen[t, j])
            h = activate(gate_up[e].double() @ x[t].double(), "silu")
            expected[t] += float(weights[t, j]) * (down[e].double() @ h)
    return float((out.double() - expected).abs().max() / expected.abs().max())


def engine(shape_dir: str, smoke: bool, **overrides):
    """The real engine core over random weights of the model in ``shape_dir``."""
    from conveyor.config import load_config
    from conveyor.engine.core import EngineCore

    settings = {"model.path": shape_dir, "model.load_format": "dummy", "model.max_model_len": 2048,
                "model.dtype": "float32" if smoke else "bfloat16", "scheduler.max_num_seqs": 64,
                "scheduler.max_num_batched_tokens": 8192, "engine.compile_batch_sizes": [1, 8, 64],
                **({"kvcache.memory_gb": 0.25} if smoke else {}), **overrides}
    return EngineCore(load_config(None, settings))


def run(core, prompts: list[list[int]], max_tokens: int, tag: str):
    """Every prompt at once, greedy, to the end. Returns each request's tokens and each step's (wall seconds,
    stats)."""
    from conveyor.messages import EngineRequest
    from conveyor.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        rejected = core.add_request(EngineRequest(f"{tag}-{i}", prompt, params))
        assert rejected is None, rejected.error
    tokens: dict[str, list[int]] = {f"{tag}-{i}": [] for i in range(len(prompts))}
    steps = []
    while core.has_unfinished():
        start = time.perf_counter()
        outputs, stats = core.step()
        if stats is not None:
            steps.append((time.perf_counter() - start, stats))
        for output in outputs:
            assert output.error is None, output.error
            tokens[output.request_id] += output.new_token_ids
    return [tokens[f"{tag}-{i}"] for i in range(len(prompts))], steps


def prompts_of(count: int, length: int, vocab: int, salt: int = 0) -> list[list[int]]:
    return [[(97 * i + 31 * j + salt) % (vocab - 1) + 1 for j in range(length)] for i in range(count)]


def decode_and_prefill(report: Report, shape_dir: str, vocab: int, smoke: bool, cuda: bool) -> dict:
    """Decode ITL per batch size with graphs off and on; prefill throughput. Returns the tokens of each run."""
    batches, decode_tokens = (1, 8, 64), 8 if smoke else 48
    results: dict[str, list[list[int]]] = {}
    for graphs in ("off", "on"):
        if graphs == "on" and not cuda:
            report.add("SKIP", "decode graphs=on", "CUDA graphs need a CUDA device")
            continue
        core = engine(shape_dir, smoke, **{"engine.compile": graphs})
        try:
            floor = core.info.weight_bytes / core.peak_bytes_per_second if core.peak_bytes_per_second else math.nan
            for batch in batches:
                tokens, steps = run(core, prompts_of(batch, 128, vocab, batch), decode_tokens, f"d{batch}")
                results[f"{graphs}/{batch}"] = tokens
                decodes = [(s, st) for s, st in steps if st.num_decode_seqs == batch and not st.num_prefill_seqs]
                itl = statistics.median(s for s, _ in decodes) if decodes else math.nan
                mbu = statistics.median(st.mbu for _, st in decodes) if decodes else math.nan
                ok = bool(decodes) and all(len(t) == decode_tokens for t in tokens) and math.isfinite(itl)
                report.add("PASS" if ok else "FAIL", f"decode b={batch} graphs={graphs}",
                           f"ITL {itl * 1e3:.2f} ms; HBM floor {floor * 1e3:.2f} ms ({itl / floor:.2f}x); "
                           f"MBU {mbu:.0%}", batch=batch, graphs=graphs, itl_ms=itl * 1e3, floor_ms=floor * 1e3,
                           mbu=mbu, weight_bytes=core.info.weight_bytes)
            if graphs == "off":
                count, length = (2, 64) if smoke else (8, 1024)
                _, steps = run(core, prompts_of(count, length, vocab, 7), 1, "p")
                seconds, stats = max(steps, key=lambda s: s[1].num_prefill_tokens)
                rate = stats.num_prefill_tokens / seconds
                ok = stats.num_prefill_tokens == count * length and math.isfinite(rate)
                report.add("PASS" if ok else "FAIL", f"prefill {count} x {length}",
                           f"{rate:,.0f} tokens/s in one step of {seconds * 1e3:.1f} ms; MFU {stats.mfu:.0%}",
                           tokens_per_second=rate, step_ms=seconds * 1e3, mfu=stats.mfu)
        finally:
            core.shutdown()
            del core
            gc.collect()
    if cuda:
        same = [batch for batch in batches if results.get(f"on/{batch}") == results.get(f"off/{batch}")]
        # (bf16 rounds differently in a graph; on random weights a near tie may flip a token: most batches agree)
        report.add("PASS" if len(same) >= 2 else "FAIL", "graphs on/off",
                   f"the same greedy tokens at batch {', '.join(map(str, same)) or 'none'} of 1, 8, 64",
                   batches_identical=same)
    return results


def mp_executor(report: Report, shape_dir: str, vocab: int, smoke: bool, reference: list[list[int]]) -> None:
    core = engine(shape_dir, smoke, **{"parallel.executor": "mp", "engine.compile": "off"})
    try:
        tokens, _ = run(core, prompts_of(8, 128, vocab, 8), len(reference[0]), "mp")
    finally:
        core.shutdown()
    ok = tokens == reference
    report.add("PASS" if ok else "FAIL", "mp executor",
               "the same greedy tokens as in-process" if ok else "tokens differ from the in-process run")


def nvml(report: Report, cuda: bool) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from conveyor.serving.nvml import GpuGauges

    if not cuda:
        report.add("SKIP", "NVML", "no CUDA device")
        return
    registry = CollectorRegistry()
    gauges = GpuGauges.start(registry, "gpu-check")
    if gauges is None:
        report.add("FAIL", "NVML", "NVML did not start (nvidia-ml-py installed? see the log)")
        return
    gauges.update()
    text = generate_latest(registry).decode()
    samples = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("conveyor_gpu_") and 'gpu="0"' in line}
    used, total = samples.get("conveyor_gpu_memory_used_bytes", 0), samples.get("conveyor_gpu_memory_total_bytes", 0)
    ok = 0 < used <= total and "conveyor_gpu_utilization_ratio" in samples
    report.add("PASS" if ok else "FAIL", "NVML", f"conveyor_gpu_memory_used_bytes {used / 1e9:.1f} GB of "
               f"{total / 1e9:.1f} GB; utilization {samples.get('conveyor_gpu_utilization_ratio', math.nan):.0%}",
               **samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU, kernels interpreted")
    parser.add_argument("--json", default="gpu_check.json", help="where every number goes")
    args = parser.parse_args()
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if not cuda and not args.cpu_smoke:
        print("no CUDA device: run with --cpu-smoke for the same checks at tiny shapes on the CPU", file=sys.stderr)
        return 2
    began = time.perf_counter()
    device = "cuda" if cuda else "cpu"
    print(f"device: {torch.cuda.get_device_name() if cuda else 'CPU (smoke: tiny shapes, Triton interpreted)'}",
          flush=True)
    report = Report()
    kernels(report, torch, device, args.cpu_smoke)
    shape = TINY if args.cpu_smoke else LLAMA_3_8B
    with tempfile.TemporaryDirectory() as shape_dir:
        Path(shape_dir, "config.json").write_text(json.dumps(shape))
        results = decode_and_prefill(report, shape_dir, shape["vocab_size"], args.cpu_smoke, cuda)
        mp_executor(report, shape_dir, shape["vocab_size"], args.cpu_smoke, results["off/8"])
    nvml(report, cuda)
    seconds = time.perf_counter() - began
    Path(args.json).write_text(json.dumps({"device": device, "seconds": seconds, "points": report.points}, indent=2))
    print(f"\n{len(report.points) - report.failed} of {len(report.points)} points pass or skip, {report.failed} "
          f"fail; {seconds:.0f} s; every number in {args.json}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
