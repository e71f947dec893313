"""Every Triton kernel on a CUDA GPU: checked against its torch reference, then timed.

    python benchmarks/gpu_kernels.py [--peak-gbps 4800]
    python benchmarks/gpu_kernels.py --smoke     # CPU, TRITON_INTERPRET=1, tiny shapes: checks only

Quantized GEMMs (int8 and fp8 W8A16; fp8 W8A8 on compute capability >= 8.9;
every GGUF block type, unpacked in registers) at decode shapes (M = 1, 16)
and a prefill shape (M = 2048) of an 8B-class layer, against a bf16 torch
matmul: time, speed-up, and achieved memory bandwidth against the card's
peak. Paged attention (decode and prefill, bf16
and fp8 KV) against a dense torch attention over the gathered context.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

# peak HBM bandwidth in GB/s by device name
PEAKS = {"H200": 4800, "H100": 3350, "A100": 2039, "L40S": 864, "L4": 300, "A10": 600, "RTX 4090": 1008}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peak-gbps", type=float, default=None, help="the card's memory bandwidth (default: by name)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1, no timing")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --smoke for a CPU check of the kernels", file=sys.stderr)
        return 2
    device = "cpu" if args.smoke else "cuda"
    name = "CPU (interpreter)" if args.smoke else torch.cuda.get_device_name()
    peak = args.peak_gbps or next((v for k, v in PEAKS.items() if k in name), None)
    print(f"device: {name}; peak bandwidth: {f'{peak:.0f} GB/s' if peak else 'unknown (--peak-gbps)'}")
    failures = (gemms(torch, device, args.smoke, peak) + ggml_gemms(torch, device, args.smoke, peak)
                + attention(torch, device, args.smoke))
    print("\nall kernels match their references" if not failures else f"\n{failures} kernel check(s) FAILED")
    return 1 if failures else 0


def bench(torch, fn, smoke: bool) -> float:
    """Milliseconds per call (median of triton's do_bench), or NaN in smoke mode."""
    if smoke:
        fn()
        return float("nan")
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200)


def gemms(torch, device: str, smoke: bool, peak: float | None) -> int:
    from conveyor.model.formats import quantize_fp8
    from conveyor.plugins.quant.fp8 import has_fp8_units
    from conveyor.plugins.quant.int8 import quantize_int8
    from conveyor.plugins.quant.kernels import w8a8_fp8_matmul, w8a16_matmul

    k, n = (96, 80) if smoke else (4096, 14336)
    rows = (1, 7, 33) if smoke else (1, 16, 2048)
    weight = torch.randn(n, k, device=device) / k**0.5
    formats = {"int8 W8A16": (quantize_int8(weight), w8a16_matmul), "fp8 W8A16": (quantize_fp8(weight), w8a16_matmul)}
    if smoke or has_fp8_units(torch.device(device)):
        formats["fp8 W8A8"] = (quantize_fp8(weight), w8a8_fp8_matmul)
    w_bf16 = weight.bfloat16()
    failures = 0
    print(f"\nGEMM [M, {k}] x [{k}, {n}] (bf16 activations)")
    print(f"{'kernel':<12} {'M':>5} {'rel err':>9} {'ms':>8} {'bf16 ms':>8} {'speed-up':>9} {'GB/s':>8} {'% peak':>7}")
    for m in rows:
        x = torch.randn(m, k, device=device).bfloat16()
        bf16_ms = bench(torch, lambda: x @ w_bf16.T, smoke)
        for label, ((q, scale), kernel) in formats.items():
            out = kernel(x, q, scale)
            if "W8A8" in label:  # the reference sees the same per-token e4m3 activations
                x_scale = x.double().abs().amax(dim=1, keepdim=True) / 448
                x_ref = (x.double() / x_scale).to(torch.float8_e4m3fn).double() * x_scale
            else:
                x_ref = x.double()
            expected = x_ref @ (q.double() * scale.double()[:, None]).T
            error = float((out.double() - expected).abs().max() / expected.abs().max())
            ok = error < 2e-2
            failures += not ok
            ms = bench(torch, lambda: kernel(x, q, scale), smoke)
            moved = q.numel() + x.numel() * 2 + m * n * 2  # weight bytes dominate at decode
            gbps = moved / (ms * 1e-3) / 1e9
            share = f"{100 * gbps / peak:.0f}%" if peak and not math.isnan(ms) else "-"
            print(f"{label:<12} {m:>5} {error:>9.1e} {ms:>8.3f} {bf16_ms:>8.3f} {bf16_ms / ms:>8.2f}x {gbps:>8.0f} "
                  f"{share:>7}{'' if ok else '  MISMATCH'}")
    return failures


# each GGUF block type's float16 fields (byte offsets in its block): set to a sane scale in random blocks
GGML_HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
               "Q5_K": (0, 2), "Q6_K": (208,)}


def ggml_gemms(torch, device: str, smoke: bool, peak: float | None) -> int:
    """The Triton GEMM over packed GGUF blocks, every block type: random blocks (their scales set to small
    float16 values), against float64 products with the torch dequantizer's weights."""
    from conveyor.model import ggml
    from conveyor.plugins.quant.ggml_kernels import ggml_matmul

    k, n = (512, 40) if smoke else (4096, 14336)
    rows = (1, 7, 33) if smoke else (1, 16, 2048)
    failures = 0
    print(f"\nGGUF blocks [M, {k}] x [{k}, {n}] (bf16 activations, weights unpacked in registers)")
    print(f"{'format':<12} {'M':>5} {'rel err':>9} {'ms':>8} {'bf16 ms':>8} {'speed-up':>9} {'GB/s':>8} {'% peak':>7}")
    generator = torch.Generator(device=device).manual_seed(0)
    w_bf16 = torch.randn(n, k, device=device, generator=generator).bfloat16()
    for format, halves in GGML_HALVES.items():
        values, size = ggml.BLOCKS[format]
        data = torch.randint(0, 256, (n, k // values, size), dtype=torch.uint8, device=device, generator=generator)
        for offset in halves:
            scale = (torch.rand(n, k // values, device=device, generator=generator) * 0.02 + 0.001).half()
            data[..., offset : offset + 2] = scale[..., None].view(torch.uint8)
        data = data.reshape(n, -1)
        weight = ggml.dequantize(ggml.PackedWeight(format, data, k), torch.float32).double()
        for m in rows:
            x = torch.randn(m, k, device=device, generator=generator).bfloat16()
            out = ggml_matmul(x, data, format)
            expected = x.double() @ weight.T
            error = float((out.double() - expected).abs().max() / expected.abs().max())
            ok = error < 2e-2
            failures += not ok
            ms = bench(torch, lambda: ggml_matmul(x, data, format), smoke)
            bf16_ms = bench(torch, lambda: x @ w_bf16.T, smoke)
            moved = data.numel() + x.numel() * 2 + m * n * 2
            gbps = moved / (ms * 1e-3) / 1e9
            share = f"{100 * gbps / peak:.0f}%" if peak and not math.isnan(ms) else "-"
            print(f"{format:<12} {m:>5} {error:>9.1e} {ms:>8.3f} {bf16_ms:>8.3f} {bf16_ms / ms:>8.2f}x {gbps:>8.0f} "
                  f"{share:>7}{'' if ok else '  MISMATCH'}")
    return failures


def attention(torch, device: str, smoke: bool) -> int:
    from conveyor.attention.kernels import paged_decode_attention, paged_prefill_attention
    from conveyor.attention.storage import SCALE_DTYPE, dequantize
    from conveyor.model.formats import quantize_fp8

    heads, kv_heads, dim, block = (4, 2, 16, 4) if smoke else (32, 8, 128, 16)
    batch, context, chunk = (3, 21, 9) if smoke else (32, 2048, 512)
    blocks_per_seq = -(-context // block)
    num_blocks = batch * blocks_per_seq
    k = torch.randn(kv_heads, num_blocks * block, dim, device=device).bfloat16()
    v = torch.randn_like(k)
    tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).int()
    bits_k, scale_k = quantize_fp8(k.transpose(0, 1), SCALE_DTYPE)
    bits_v, scale_v = quantize_fp8(v.transpose(0, 1), SCALE_DTYPE)
    fp8 = {"k": bits_k.transpose(0, 1).contiguous(), "ks": scale_k.T.contiguous(),
           "v": bits_v.transpose(0, 1).contiguous(), "vs": scale_v.T.contiguous()}
    k_deq = dequantize(fp8["k"].view(torch.uint8), fp8["ks"], torch.float32)
    v_deq = dequantize(fp8["v"].view(torch.uint8), fp8["vs"], torch.float32)
    failures = 0
    print(f"\npaged attention: {batch} sequences, context {context}, {heads}/{kv_heads} heads x {dim}, blocks of {block}")
    print(f"{'kernel':<24} {'max err':>9} {'ms':>8} {'GB/s':>8}")

    def reference(q, keys, values, start):
        """Dense causal attention of queries at positions start.. over keys [Hkv, L, D], float32."""
        group = heads // kv_heads
        keys, values = keys.float().repeat_interleave(group, 0), values.float().repeat_interleave(group, 0)
        scores = torch.einsum("thd,hld->htl", q.float(), keys) * dim**-0.5
        positions = torch.arange(keys.shape[1], device=device)
        allowed = positions[None, :] <= (start + torch.arange(q.shape[0], device=device))[:, None]
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        return torch.einsum("htl,hld->thd", scores.softmax(-1), values)

    def slots(seq: int, length: int):
        table = tables[seq].long()
        return (table[:, None] * block + torch.arange(block, device=device)).flatten()[:length]

    lengths = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, dim, device=device).bfloat16()
    for label, caches, scales in (("decode, bf16 KV", (k, v), (None, None)),
                                  ("decode, fp8 KV", (fp8["k"], fp8["v"]), (fp8["ks"], fp8["vs"]))):
        out = paged_decode_attention(q, *caches, tables, lengths, block, *scales)
        keys, values = (k, v) if scales[0] is None else (k_deq, v_deq)
        error = max(
            float((out[i].float() - reference(q[i : i + 1], keys[:, slots(i, context)], values[:, slots(i, context)],
                                              context - 1)[0]).abs().max())
            for i in range(batch)
        )
        ms = bench(torch, lambda: paged_decode_attention(q, *caches, tables, lengths, block, *scales), smoke)
        moved = 2 * batch * context * kv_heads * dim * caches[0].element_size()
        failures += error > 3e-2
        print(f"{label:<24} {error:>9.1e} {ms:>8.3f} {moved / (ms * 1e-3) / 1e9:>8.0f}"
              f"{'' if error <= 3e-2 else '  MISMATCH'}")

    q_chunks = torch.randn(batch * chunk, heads, dim, device=device).bfloat16()
    rows = torch.arange(0, batch * chunk, chunk, dtype=torch.int32, device=device)
    q_lens = torch.full((batch,), chunk, dtype=torch.int32, device=device)
    starts = torch.full((batch,), context - chunk, dtype=torch.int32, device=device)
    for label, caches, scales in (("prefill chunk, bf16 KV", (k, v), (None, None)),
                                  ("prefill chunk, fp8 KV", (fp8["k"], fp8["v"]), (fp8["ks"], fp8["vs"]))):
        def run():
            return paged_prefill_attention(q_chunks, *caches, tables, rows, q_lens, starts, block, chunk,
                                           k_scale=scales[0], v_scale=scales[1])

        out = run()
        keys, values = (k, v) if scales[0] is None else (k_deq, v_deq)
        error = max(
            float((out[i * chunk : (i + 1) * chunk].float()
                   - reference(q_chunks[i * chunk : (i + 1) * chunk], keys[:, slots(i, context)],
                               values[:, slots(i, context)], context - chunk)).abs().max())
            for i in range(batch)
        )
        ms = bench(torch, run, smoke)
        failures += error > 3e-2
        flops = 4 * batch * heads * dim * chunk * (context - chunk / 2)
        print(f"{label:<24} {error:>9.1e} {ms:>8.3f} {'':>8} ({flops / (ms * 1e-3) / 1e12:.1f} TFLOP/s)"
              f"{'' if error <= 3e-2 else '  MISMATCH'}")
    return failures


if __name__ == "__main__":
    sys.exit(main())
