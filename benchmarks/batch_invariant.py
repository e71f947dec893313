"""What batch-invariant mode ([engine] batch_invariant) costs: the same work with it off and on, in one run.

    python benchmarks/batch_invariant.py [--num-requests 64] [--tokens 64] [--set KEY=VALUE ...]

Three measurements per mode, through the offline LLM on the default model:
one stream (greedy chats one at a time: decode time per token), the mixed
workload of benchmarks/offline.py (prompts of 30-600 tokens, outputs of
16-256, all at t=0: output tok/s), and prefill alone (one 512-token prompt,
one output token: prompt tok/s). The mode's costs: every matmul runs in
blocks of 16 rows (a one-token step pads to 16), and every prompt token
attends in the decode kernel, reading its keys on its own.
"""

from __future__ import annotations

import argparse
import time

from conveyor import LLM
from conveyor.bench.datasets import mixed
from conveyor.config import parse_override
from conveyor.sampling import SamplingParams

CHATS = ["Why is the sky blue?", "What is a list in Python?", "Name three rivers in Europe.",
         "How do plants make food?"]


def measure(overrides: dict, num_requests: int, tokens: int) -> dict[str, float]:
    with LLM(overrides=overrides) as llm:
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        llm.generate([[{"role": "user", "content": CHATS[0]}]], params)  # (warm up)
        start = time.perf_counter()
        for chat in CHATS:
            llm.generate([[{"role": "user", "content": chat}]], params)
        stream_ms = (time.perf_counter() - start) / (len(CHATS) * tokens) * 1e3

        requests = mixed(num_requests, 0, lambda m: len(llm.tokenizer.encode_chat(m)))
        start = time.perf_counter()
        llm.generate([r.messages for r in requests],
                     [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in requests])
        mixed_tps = sum(r.max_tokens for r in requests) / (time.perf_counter() - start)

        [long] = mixed(1, 1, lambda m: len(llm.tokenizer.encode_chat(m)), input_len=(512, 512))
        prompt_tokens = len(llm.tokenizer.encode_chat(long.messages))
        start = time.perf_counter()
        llm.generate([long.messages], SamplingParams(max_tokens=1, temperature=0))
        prefill_tps = prompt_tokens / (time.perf_counter() - start)
    return {"stream_ms": stream_ms, "mixed_tps": mixed_tps, "prefill_tps": prefill_tps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per one-stream chat")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    overrides = dict(parse_override(o) for o in args.set)
    results = {}
    for label, invariant in (("default", False), ("batch_invariant", True)):
        print(f"{label}: one stream, {args.num_requests} mixed requests, one 512-token prompt ...", flush=True)
        results[label] = measure({**overrides, "engine.batch_invariant": invariant}, args.num_requests, args.tokens)
        r = results[label]
        print(f"  {r['stream_ms']:.1f} ms/token alone, {r['mixed_tps']:.1f} output tok/s mixed, "
              f"{r['prefill_tps']:.0f} prompt tok/s", flush=True)
    base, inv = results["default"], results["batch_invariant"]
    print("\n| | default | batch_invariant | ratio |\n|---|---|---|---|")
    print(f"| one stream: ms per output token | {base['stream_ms']:.1f} | {inv['stream_ms']:.1f} | "
          f"{inv['stream_ms'] / base['stream_ms']:.2f}x |")
    print(f"| {args.num_requests} mixed requests: output tok/s | {base['mixed_tps']:.1f} | {inv['mixed_tps']:.1f} | "
          f"{inv['mixed_tps'] / base['mixed_tps']:.2f}x |")
    print(f"| one 512-token prompt: prompt tok/s | {base['prefill_tps']:.0f} | {inv['prefill_tps']:.0f} | "
          f"{inv['prefill_tps'] / base['prefill_tps']:.2f}x |")


if __name__ == "__main__":
    main()
