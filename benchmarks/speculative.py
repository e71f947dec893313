"""Speculative decoding (n-gram prompt lookup): one stream at a time, with and without drafts.

    python benchmarks/speculative.py [--set KEY=VALUE ...]

Three repetitive tasks (repeat a given text, rewrite it with one change,
summarize it) and one open question, each greedy, one request at a time,
through the offline LLM with the default config: output tokens per second
without drafts and with ``engine.speculative = "ngram"``, the acceptance
rate (accepted over proposed tokens), the tokens each step made, and
whether the tokens are the same.
"""

from __future__ import annotations

import argparse
import time

from conveyor import LLM
from conveyor.config import parse_override
from conveyor.sampling import SamplingParams

TEXT = ("Conveyor is an open-source inference server. It keeps the hardware busy and the latency low by batching "
        "requests continuously, caching shared prompt prefixes, and scheduling prompt chunks beside decodes. "
        "Plugins choose the scheduler, the KV cache layout, the quantization and the transports.")
TASKS = {
    "repeat": f"Repeat this text exactly:\n\n{TEXT}",
    "rewrite": f"Rewrite this text, replacing 'Conveyor' with 'Belt':\n\n{TEXT}",
    "summarize": f"Summarize this text in two sentences:\n\n{TEXT}",
    "open question": "Why is the sky blue?",
}


def run(overrides: dict, speculative: str) -> dict[str, tuple]:
    results = {}
    with LLM(overrides={**overrides, "engine.speculative": speculative}) as llm:
        llm.generate("Hi", SamplingParams(max_tokens=4))  # (warm up)
        counters = llm.engine.scheduler.counters
        for name, prompt in TASKS.items():
            drafted, accepted, steps = counters.num_draft_tokens, counters.num_accepted_tokens, llm.engine.num_steps
            start = time.perf_counter()
            [out] = llm.generate([[{"role": "user", "content": prompt}]], SamplingParams(max_tokens=160, temperature=0))
            seconds = time.perf_counter() - start
            steps = llm.engine.num_steps - steps
            results[name] = (out.token_ids, len(out.token_ids) / seconds, counters.num_draft_tokens - drafted,
                             counters.num_accepted_tokens - accepted, len(out.token_ids) / max(1, steps))
            print(f"  {speculative:>5} {name:<14} {results[name][1]:6.1f} tok/s", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    overrides = dict(parse_override(o) for o in args.set)
    plain, spec = run(overrides, "off"), run(overrides, "ngram")
    print(f"\n{'task':<14} {'tokens':>6} {'off tok/s':>10} {'ngram tok/s':>12} {'speed-up':>9} {'accepted':>9} "
          f"{'tokens/step':>12} {'same tokens':>12}")
    for name in TASKS:
        tokens, off_rate, *_ = plain[name]
        spec_tokens, on_rate, drafted, accepted, per_step = spec[name]
        rate = f"{accepted}/{drafted}" if drafted else "-"
        print(f"{name:<14} {len(tokens):>6} {off_rate:>10.1f} {on_rate:>12.1f} {on_rate / off_rate:>8.2f}x "
              f"{rate:>9} {per_step:>12.2f} {tokens == spec_tokens!s:>12}")


if __name__ == "__main__":
    main()
