"""Scheduler overhead per step: schedule() + update() with N running requests and no model.

    python benchmarks/scheduler_overhead.py [--running 256 1024] [--steps 200]

Every request is past its prompt and decoding (the steady state of a busy
server); the fake runner returns a token for each. Prints microseconds per
step for each scheduler, with the paged KV cache (prefix caching on).
"""

from __future__ import annotations

import argparse
import statistics
import time

from conveyor.kvcache import KVCacheSpec
from conveyor.messages import RunnerOutput
from conveyor.plugins.kvcache.paged import PagedKVCache, PagedOptions
from conveyor.plugins.schedulers.continuous import ContinuousOptions, ContinuousScheduler
from conveyor.plugins.schedulers.static import StaticOptions, StaticScheduler
from conveyor.request import Request
from conveyor.sampling import SamplingParams

PROMPT_LEN = 100
MAX_TOKENS = 1000


def build(kind: str, num_running: int):
    spec = KVCacheSpec(1, 1, 4, "float32", 4096)
    # room for every request at its longest, so the static scheduler admits them all at once
    blocks_per_request = -(-(PROMPT_LEN + MAX_TOKENS) // 16)
    kvcache = PagedKVCache(PagedOptions(block_size=16, num_blocks=num_running * blocks_per_request), spec)
    if kind == "continuous":
        options = ContinuousOptions(max_num_seqs=num_running, max_num_batched_tokens=max(8192, num_running))
        return ContinuousScheduler(options, kvcache, 4096)
    options = StaticOptions(batch_size=num_running, max_wait_ms=0, max_num_batched_tokens=num_running * PROMPT_LEN)
    return StaticScheduler(options, kvcache, 4096)


def measure(kind: str, num_running: int, num_steps: int) -> list[float]:
    scheduler = build(kind, num_running)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    for i in range(num_running):
        prompt = [(i * 7919 + j) % 49_000 for j in range(PROMPT_LEN)]
        scheduler.add(Request(f"r{i}", prompt, params, 4096))
    timings = []
    for step in range(num_steps + 20):
        start = time.perf_counter()
        batch = scheduler.schedule()
        sampled = [
            17 if r.num_computed_tokens + n == r.num_tokens else None for r, n in zip(batch.requests, batch.num_tokens)
        ]
        scheduler.submitted(batch)
        scheduler.update(batch, RunnerOutput(sampled, [None] * len(batch)))
        elapsed = time.perf_counter() - start
        # the first steps are prefill; measure the decode steady state
        if step >= 20:
            assert batch.num_decodes == num_running
            timings.append(elapsed * 1e6)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    print(f"{'scheduler':<12}{'running':>9}{'median us/step':>16}{'p90 us/step':>13}{'us/request':>12}")
    for kind in ("continuous", "static"):
        for num_running in args.running:
            timings = sorted(measure(kind, num_running, args.steps))
            median = statistics.median(timings)
            p90 = timings[int(0.9 * len(timings))]
            print(f"{kind:<12}{num_running:>9}{median:>16.0f}{p90:>13.0f}{median / num_running:>12.2f}")


if __name__ == "__main__":
    main()
