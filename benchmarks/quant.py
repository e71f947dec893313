"""What each quantization method buys on this machine: weight bytes, KV blocks, decode speed, quality.

    python benchmarks/quant.py [--methods auto none int8 fp8 fp8-kv] [--batches 1 32] [--decode-tokens 48]
                               [--model MODEL]
    python benchmarks/quant.py --kernels [--rows 1 4 8 16 64 256 512] [--model MODEL]

Each method is the default config (bf16 activations, 1 GiB of KV cache; ``auto``: the GGUF's blocks kept
packed) with one change: ``quant.plugin = none | int8 | fp8`` (none: every weight expanded to bf16), or
``kvcache.dtype = fp8``.
Decode tokens/s: B requests with 32-token prompts start together and
generate ``--decode-tokens`` each (ignore_eos); the rate counts the tokens
after every request's first, over the time after the last first token.
Quality: teacher-forced over the first 2,048 tokens of tests/data/GPL-3.txt
against the fp32 model (perplexity change and next-token top-1 agreement).
Also prints the CPU matmul paths side by side (the int8 method as it runs here: Q8_0 blocks through the C++
kernel where it has its VNNI path, else int8pack; the torch paths behind ``cpu_int8_max_rows``; fp8's paths,
its C++ kernel among them).

``--kernels``: only the packed GGUF kernel, every path built here (``conveyor.native.ggml_linear_path``)
against bf16 ``F.linear`` over the same layers dequantized: the default model's 30 layers of linear weights,
multiplied as the model does (q, k and v stacked into one product, gate and up into one, bfloat16 activations),
one step of each row count, the mean of 5; then each one's rate as a share of this CPU's peaks (``conveyor
profile``: each packed path's of its own int8 peak, the dot products alone in registers; bf16 F.linear's of the
bf16 matmul's).

``--model``: a benchmark shape of benchmarks/models.py (``llama-3.2-1b:Q4_0``, written on first use), a .gguf
file or a Hugging Face directory in place of the default model (``--kernels``: its linear weights). The shapes'
weights are random: their speeds are real, their quality columns only say how far each method moves noise
(``--no-quality`` skips them). The CPU matmul paths stay at SmolLM2's gate_up shape.
"""

from __future__ import annotations

import argparse
import gc
import logging
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from models import resolve_model

from conveyor import LLM, SamplingParams, native
from conveyor.bench.quality import agreement, perplexity, teacher_forced
from conveyor.model.formats import quantize_fp8
from conveyor.plugins.quant.int8 import Int8WeightOnly, quantize_int8

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "GPL-3.txt"
METHODS = {
    "auto": {},
    "none": {"quant.plugin": "none"},
    "int8": {"quant.plugin": "int8"},
    "fp8": {"quant.plugin": "fp8"},
    "fp8-kv": {"kvcache.dtype": "fp8"},
}
QUALITY_TOKENS = 2048
# the quality runs' step budget (the server's default): the text goes through in chunks, and later chunks read
# the earlier ones' K and V back from the cache, so a quantized cache is part of what is measured (the offline
# LLM's own budget, 2,048, would take the whole text in one chunk that never reads the cache)
QUALITY = {"model.max_model_len": QUALITY_TOKENS + 1, "scheduler.max_num_batched_tokens": 512}


def decode_rate(llm: LLM, batch: int, tokens: int) -> float:
    prompts = [f"Item {i}: write a long list of words about the sea, the sky and the fields." for i in range(batch)]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))  # warm up
    results = llm.generate(prompts, params)
    first = max(r.time_to_first_token for r in results)
    last = max(r.latency for r in results)
    decoded = sum(len(r.token_ids) - 1 for r in results)
    return decoded / (last - first)


def time_it(fn, repeat: int = 20) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def cpu_paths() -> None:
    """Microseconds of the CPU matmul paths for SmolLM2's gate_up shape: bf16, int8 and fp8."""
    w = torch.randn(3072, 576)
    q, scale = quantize_int8(w)
    f, fscale = quantize_fp8(w)
    scale_bf16 = scale.bfloat16()
    w_bf16 = w.bfloat16()
    print("\nCPU matmul paths, [M, 576] x [576, 3072] in bf16, microseconds:")
    int8 = Int8WeightOnly(None, torch.bfloat16, torch.device("cpu"))
    int8_params = int8.prepare(w)
    int8_name = "int8 Q8_0" if "q8_0" in int8_params else "int8 method"
    fp8_kernel = native.load() and native.fp8_linear_supported()
    print(f"{'M':>5} {'bf16':>7} {int8_name:>10} {'int8pack':>9} {'int8 dequant':>13} {'fp8 dequant':>12}"
          f" {'fp8 scaled_mm':>14} {'fp8 kernel':>11}")
    for m in (1, 4, 8, 16, 32, 64, 128, 256):
        x = torch.randn(m, 576).bfloat16()
        bf16 = time_it(lambda: F.linear(x, w_bf16))
        method = time_it(lambda: int8.linear(x, int8_params))
        packed = time_it(lambda: torch._weight_int8pack_mm(x, q, scale_bf16))
        dequant = time_it(lambda: F.linear(x, q.to(torch.bfloat16) * scale_bf16[:, None]))
        # (dequantized as the method does it: in the C++ pass where the kernels build)
        fp8_dequant = time_it(lambda: F.linear(x, native.fp8_upcast(f, fscale, torch.bfloat16) if fp8_kernel
                                               else f.to(torch.bfloat16) * fscale.bfloat16()[:, None]))

        def scaled():
            xq, xs = quantize_fp8(x)
            return torch._scaled_mm(xq, f.t(), scale_a=xs[:, None], scale_b=fscale[None, :], out_dtype=x.dtype)

        fp8_scaled = time_it(scaled)
        fp8_own = time_it(lambda: native.fp8_linear(x, f, fscale)) if fp8_kernel else float("nan")
        print(f"{m:>5} {bf16 * 1e6:>7.0f} {method * 1e6:>10.0f} {packed * 1e6:>9.0f} {dequant * 1e6:>13.0f}"
              f" {fp8_dequant * 1e6:>12.0f} {fp8_scaled * 1e6:>14.0f} {fp8_own * 1e6:>11.0f}")


def ggml_kernels(row_counts: list[int], model: dict[str, str]) -> None:
    from conveyor import native
    from conveyor.config import ModelConfig
    from conveyor.model import ggml
    from conveyor.model.checkpoint import open_checkpoint

    if not native.load():
        print("the C++ kernels do not build here")
        return
    ckpt = open_checkpoint(model.get("model.path") or ModelConfig().path)
    # the weights as the model multiplies them: q, k and v in one product, gate and up in one, where their blocks
    # are of one format (as the gguf method stacks them), and bfloat16 activations (the default dtype)
    groups = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
              ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))
    stored = []
    for i in range(ckpt.spec.num_layers):
        for group in groups:
            parts = [ckpt.packed(f"model.layers.{i}.{name}.weight") for name in group]
            if len({part.format for part in parts}) > 1:
                stored += parts
            else:
                stored.append(ggml.PackedWeight(parts[0].format, torch.cat([p.data for p in parts]),
                                                parts[0].in_features))
    packed = [ggml.repack(w) for w in stored]
    dense = [ggml.dequantize(w, torch.bfloat16) for w in stored]
    paths = ["scalar", "avx2", "avx512_vnni", "amx"]
    paths = paths[1 : paths.index(native.ggml_linear_path()) + 1]
    formats = sorted({w.format for w in stored})
    print(f"\n{len(stored)} linear products ({', '.join(formats)}), {torch.get_num_threads()} threads: ms a step")
    print(f"{'rows':>5} " + " ".join(f"{p:>12}" for p in paths) + f" {'bf16 F.linear':>14}")
    # FLOPs of one row through every weight (a multiply-add is two)
    row_flops = 2 * sum(w.out_features * w.in_features for w in stored)
    rates = {}
    for m in row_counts:
        xs = {w.in_features: torch.randn(m, w.in_features).bfloat16() for w in stored}
        times = [time_it(lambda: [native.ggml_linear(xs[s.in_features], w.data, ggml.TYPE_IDS[w.format], path=p)
                                  for s, w in zip(stored, packed)], repeat=5) for p in paths]
        bf16 = time_it(lambda: [F.linear(xs[w.shape[1]], w) for w in dense], repeat=5)
        print(f"{m:>5} " + " ".join(f"{t * 1e3:>12.1f}" for t in times) + f" {bf16 * 1e3:>14.1f}", flush=True)
        rates[m] = [m * row_flops / t for t in [*times, bf16]]
    shares_of_peaks(paths, rates)


def shares_of_peaks(paths: list[str], rates: dict[int, list[float]]) -> None:
    """Each kernel's rate (GOP/s) and its share of this CPU's peak for its arithmetic: each packed path's of that
    path's int8 peak, bf16 F.linear's of the bf16 matmul's (the cached profile; measured first where there is
    none)."""
    from conveyor.config import paths as conveyor_paths
    from conveyor.perf.peaks import cpu_peaks

    peaks = cpu_peaks(conveyor_paths.cache_root())
    int8 = [peaks.int8_by_path.get(path, peaks.flops.get("int8", 0.0)) for path in paths]
    bf16 = peaks.flops_for("bfloat16")
    measured = ", ".join(f"{path} {rate / 1e9:,.0f}" for path, rate in zip(paths, int8))
    print(f"\nshare of the peaks (GOP/s, %): int8 by path {measured} GOP/s (the kernels take "
          f"{peaks.int8_path or '-'}), bf16 matmul {bf16 / 1e9:,.0f} GFLOP/s ({peaks.source})")
    print(f"{'rows':>5} " + " ".join(f"{p:>15}" for p in [*paths, "bf16 F.linear"]))
    for m, row in rates.items():
        cells = [f"{rate / 1e9:>7,.0f} {rate / peak if peak else 0.0:>6.0%}" for rate, peak in zip(row, [*int8, bf16])]
        print(f"{m:>5} " + " ".join(f"{cell:>15}" for cell in cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--decode-tokens", type=int, default=48)
    parser.add_argument("--no-quality", action="store_true")
    parser.add_argument("--kernels", action="store_true", help="only the packed GGUF kernel against bf16")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8, 16, 64, 256, 512])
    parser.add_argument("--model", help="a shape of benchmarks/models.py (llama-3.2-1b:Q4_0), a .gguf file or a "
                                        "Hugging Face directory (default: the default model)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    # (a config override, where given, for every LLM below and the kernels' weights)
    model = {"model.path": resolve_model(args.model)} if args.model else {}
    if args.kernels:
        return ggml_kernels(args.rows, model)
    cpu_paths()

    reference = None
    text_ids: list[int] = []
    if not args.no_quality:
        print("\nfp32 reference for quality ...", flush=True)
        fp32 = LLM(overrides={**model, "model.dtype": "float32", "quant.plugin": "none", **QUALITY})
        text_ids = fp32.tokenizer.encode(TEXT.read_text())[:QUALITY_TOKENS]
        reference = teacher_forced(fp32, text_ids)
        del fp32
        gc.collect()

    rows = []
    for name in args.methods:
        print(f"{name} ...", flush=True)
        llm = LLM(overrides={**model, **QUALITY, **METHODS[name]})
        row = {
            "method": name,
            "weights MB": llm.engine.info.weight_bytes / 1e6,
            "KV blocks": llm.engine.kvcache.num_blocks,
        }
        for batch in args.batches:
            row[f"decode tok/s @{batch}"] = decode_rate(llm, batch, args.decode_tokens)
        if reference is not None:
            logprobs, predictions = teacher_forced(llm, text_ids)
            ref_ppl = perplexity(reference[0])
            row["ppl vs fp32"] = f"{perplexity(logprobs):.3f} ({perplexity(logprobs) / ref_ppl - 1:+.2%})"
            row["top-1 agreement"] = f"{agreement(predictions, reference[1]):.1%}"
        rows.append(row)
        del llm
        gc.collect()

    if reference is not None:
        print(f"\nfp32 perplexity on {len(text_ids)} tokens of GPL-3: {perplexity(reference[0]):.3f}")
    columns = list(rows[0])
    print("\n| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        cells = [f"{v:,.1f}" if isinstance(v, float) else str(v) for v in row.values()]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
