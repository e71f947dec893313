"""A long prompt arriving while requests decode: the decodes' inter-token latency without it and beside it, for
each setup, in one run.

    python benchmarks/long_prompt.py [--model llama-3.2-1b:Q4_0] [--prompt-tokens 16384] [--decodes 8]
                                     [--alone-tokens 64] [--stretch 0 2] [--out bench-results/long_prompt]

``--decodes`` chats stream their answers (greedy, ignore_eos). Alone: each answers ``--alone-tokens`` tokens
more once all have started (the gaps counted are those after the last of them had a few tokens).
Beside: they start again and, once each has a few tokens, one prompt of ``--prompt-tokens`` tokens (random token
ids of the vocabulary: nothing cached) arrives asking for one token; the decodes stop when it has its token.
Setups: configs/default.toml with ``[scheduler] decode_stretch`` at each value of ``--stretch`` (0: the whole
step budget for the prompt), ``max_model_len`` raised to hold the prompt. Printed per setup: the decodes' ITL p50
and p99 alone, and over the gaps between the long prompt's arrival and its first token; p99 beside over p50
alone; the long prompt's TTFT. Each setup's gaps as JSON under ``--out``.

``--model``: a shape of benchmarks/models.py (``llama-3.2-1b:Q4_0``, written on first use), a .gguf file or a
Hugging Face directory (default: the default model).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

from models import resolve_model

from conveyor.bench.command import _tokenizer
from conveyor.bench.server import Server
from conveyor.bench.stats import percentiles

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
# tokens each decode has before the long prompt is sent
STARTED = 4


async def decode(client, model: str, index: int, max_tokens: int, times: list[float],
                 stop: asyncio.Event | None = None) -> None:
    """One chat's answer, streamed: the time of each content chunk into ``times``, until done or ``stop``."""
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"Tell me a long story about the number {index}."}],
        max_tokens=max_tokens, temperature=0, stream=True, extra_body={"ignore_eos": True})
    try:
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                times.append(time.perf_counter())
            if stop is not None and stop.is_set():
                break
    finally:
        await stream.close()


def gaps(times: list[float], after: float = 0.0, before: float = float("inf")) -> list[float]:
    """Seconds between consecutive tokens, of the gaps that end after ``after`` and begin before ``before``."""
    return [b - a for a, b in zip(times, times[1:]) if b > after and a < before]


async def measure(url: str, args: argparse.Namespace, prompt: list[int], max_model_len: int) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key="none", timeout=3600)
    model = (await client.models.list()).data[0].id
    await decode(client, model, -1, 8, [])  # (warm-up)
    alone: list[list[float]] = [[] for _ in range(args.decodes)]
    await asyncio.gather(*(decode(client, model, i, STARTED + args.alone_tokens, alone[i])
                           for i in range(args.decodes)))
    steady = max(t[STARTED - 1] for t in alone)  # (every decode started: no one's prompt in the steps since)
    beside: list[list[float]] = [[] for _ in range(args.decodes)]
    stop = asyncio.Event()
    most = max_model_len - 64  # (the decodes must outlast the long prompt's prefill, however long it takes)
    tasks = [asyncio.create_task(decode(client, model, i, most, beside[i], stop)) for i in range(args.decodes)]
    while any(len(t) < STARTED for t in beside):
        await asyncio.sleep(0.01)
    sent = time.perf_counter()
    print(f"   the long prompt ({len(prompt)} tokens) sent ...", file=sys.stderr, flush=True)
    await client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
    first = time.perf_counter()
    stop.set()
    await asyncio.gather(*tasks)
    late = [len(t) for t in beside if t[-1] < first]  # (a decode that ended before the prompt's token)
    alone_gaps = [g for t in alone for g in gaps(t, steady)]
    beside_gaps = [g for t in beside for g in gaps(t, sent, first)]
    return {"alone": alone_gaps, "beside": beside_gaps, "ttft": first - sent, "decodes_ended_early": len(late)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a shape of benchmarks/models.py (llama-3.2-1b:Q4_0), a .gguf file or a "
                                        "Hugging Face directory (default: the default model)")
    parser.add_argument("--prompt-tokens", type=int, default=16384)
    parser.add_argument("--decodes", type=int, default=8)
    parser.add_argument("--alone-tokens", type=int, default=64)
    parser.add_argument("--stretch", nargs="+", type=float, default=[0, 2])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench-results/long_prompt")
    args = parser.parse_args()
    model = resolve_model(args.model) if args.model else None
    tokenizer = _tokenizer(model if model and Path(model).exists() else None)
    rng = random.Random(args.seed)
    # (ids clear of the special tokens at either end of the vocabulary)
    prompt = [rng.randrange(100, tokenizer.vocab_size - 100) for _ in range(args.prompt_tokens)]
    max_model_len = args.prompt_tokens + 1024
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for stretch in args.stretch:
        overrides = ["transport.0.port=0", "server.status_interval=0", f"model.max_model_len={max_model_len}",
                     f"scheduler.decode_stretch={stretch}", *([f"model.path={model}"] if model else [])]
        print(f"== decode_stretch = {stretch:g}: starting conveyor serve", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            server = Server((CONFIGS / "default.toml").read_text(), Path(tmp), overrides=overrides).start()
            try:
                result = asyncio.run(measure(server.http, args, prompt, max_model_len))
            finally:
                server.stop()
        (out / f"stretch-{stretch:g}.json").write_text(json.dumps(result))
        alone, beside = percentiles(result["alone"]), percentiles(result["beside"])
        rows.append((stretch, alone, beside, result))
        print(f"   ITL alone p50 {alone['p50'] * 1e3:.0f} ms p99 {alone['p99'] * 1e3:.0f} ms; beside the long prompt "
              f"p50 {beside['p50'] * 1e3:.0f} ms p99 {beside['p99'] * 1e3:.0f} ms; its TTFT {result['ttft']:.1f} s",
              file=sys.stderr, flush=True)
    print(f"\n{Path(model).name if model else 'the default model'}, {platform.processor() or platform.machine()}; "
          f"{args.decodes} decodes, a prompt of {args.prompt_tokens} tokens\n")
    print("| decode_stretch | ITL p50 alone (ms) | ITL p99 alone | ITL p50 beside | ITL p99 beside | p99 beside / "
          "p50 alone | long prompt TTFT (s) |")
    print("|---|---|---|---|---|---|---|")
    for stretch, alone, beside, result in rows:
        print(f"| {stretch:g} | {alone['p50'] * 1e3:.0f} | {alone['p99'] * 1e3:.0f} | {beside['p50'] * 1e3:.0f} | "
              f"{beside['p99'] * 1e3:.0f} | {beside['p99'] / alone['p50']:.1f}x | {result['ttft']:.1f} |"
              + (f" ({result['decodes_ended_early']} decodes ended first)" if result["decodes_ended_early"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
