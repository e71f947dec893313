"""``conveyor doctor`` against real servers driven into each regime of the checklist: it names the regime, with
the evidence that shows it and the config key to change first. Two servers, two regimes each."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from functools import partial

import anyio
import httpx
import pytest

from conveyor.bench.doctor import checklist, diagnose, quantile, read_metrics, sample
from tests.server import Server, http_config

pytestmark = pytest.mark.slow

SHORT = [{"role": "user", "content": "Tell me a long story about a dragon."}]


def long_prompt(i: int) -> list:
    """About 1,200 prompt tokens, different from the first token on (the prefix cache cannot serve it)."""
    return [{"role": "user", "content": f"{i} Summarize: " + f"The river {i} ran past the old mill. " * 110}]


async def one(client: httpx.AsyncClient, messages: list, max_tokens: int) -> None:
    await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": max_tokens,
                                                    "ignore_eos": True})


async def diagnose_under(server: Server, ready, seconds: float, *loads, cli: bool = False) -> dict:
    """Start the loads (coroutine functions of a client), wait until ``ready(server)``, read /metrics for
    ``seconds`` (through ``conveyor doctor --json`` where ``cli``), then cancel the loads (their clients leave, so
    the server aborts what is left). Returns the diagnosis as the command's JSON has it."""
    async with httpx.AsyncClient(base_url=server.http, timeout=300,
                                 limits=httpx.Limits(max_connections=100)) as client, anyio.create_task_group() as tg:
        for load in loads:
            tg.start_soon(load, client)
        with anyio.fail_after(120):
            while not ready(server):
                await anyio.sleep(0.2)
        if cli:
            done = await anyio.run_process([sys.executable, "-m", "conveyor", "doctor", server.http,
                                            "--interval", str(seconds), "--json"])
            diagnosis = json.loads(done.stdout)
        else:
            diagnosis = asdict(diagnose(await anyio.to_thread.run_sync(sample, server.http, seconds), seconds))
        tg.cancel_scope.cancel()
    server.wait_for(lambda: server.metric("conveyor_num_requests_in_flight") == 0, what="the loads to end")
    return diagnosis


def many(count: int, messages: list, max_tokens: int):
    async def load(client: httpx.AsyncClient) -> None:
        async with anyio.create_task_group() as tg:
            for _ in range(count):
                tg.start_soon(one, client, messages, max_tokens)
    return load


def test_a_small_kv_cache_and_a_small_batch(tmp_path):
    """max_num_seqs = 2 and a KV cache of 12 blocks of 16 tokens. Two requests of 140 tokens fit one at a time:
    read from before they arrive, the window sees a preemption, and the verdict is KV capacity. Then 120 short
    requests at once (more than a fast device finishes in the window; the rest are cancelled): two run, the rest
    wait, the cache has room and compute idles, so the verdict is a batch too small."""
    server = Server(http_config() + "\n[scheduler]\nmax_num_seqs = 2\nmax_waiting = 128\n"
                    "\n[kvcache]\nnum_blocks = 12\nblock_size = 16\n", tmp_path).start()
    try:
        kv = anyio.run(diagnose_under, server, lambda s: True, 5.0, many(2, SHORT, 140))
        assert kv["verdict"] == "kv_capacity", kv["window"]
        finding = kv["findings"][0]
        assert finding["evidence"]["preemptions"] > 0 and finding["change"] == "kvcache.memory_gb"

        small = anyio.run(diagnose_under, server, lambda s: s.metric("conveyor_num_requests_waiting") >= 5, 3.0,
                          many(120, SHORT, 24))
        assert small["verdict"] == "batch_too_small", small["window"]
        finding = small["findings"][0]
        assert finding["evidence"]["running_max"] == 2 and finding["evidence"]["waiting_mean"] >= 1
        assert finding["change"] == "scheduler.max_num_seqs"
    finally:
        assert server.stop() == 0, server.output


def test_long_prompts_among_decodes_and_a_flood(tmp_path):
    """max_num_seqs = 16. Six decoding requests while prompts of about 1,200 tokens keep arriving: the verdict is
    prefill interference (ITL P99 over 3x P50). Then 120 requests at once: 16 run, the rest wait, and the verdict
    is queueing, with the doctor's JSON from the command line."""
    server = Server(http_config() + "\n[scheduler]\nmax_num_seqs = 16\nmax_waiting = 128\n"
                    "max_num_batched_tokens = 512\n", tmp_path).start()
    try:
        async def prompts(client: httpx.AsyncClient) -> None:
            for i in range(1000):
                await one(client, long_prompt(i), 1)

        def decoding(s: Server) -> bool:
            return s.metric("conveyor_num_requests_running") >= 6

        mixed = anyio.run(diagnose_under, server, decoding, 4.0, many(6, SHORT, 2000), prompts)
        assert mixed["verdict"] == "prefill_interference", mixed["window"]
        finding = mixed["findings"][0]
        assert finding["evidence"]["itl_p99_s"] > 3 * finding["evidence"]["itl_p50_s"] > 0
        assert finding["evidence"]["prompt_tokens"] > 1000
        assert finding["change"] == "scheduler.max_num_batched_tokens"

        flood = anyio.run(partial(diagnose_under, cli=True), server,
                          lambda s: s.metric("conveyor_num_requests_waiting") >= 20, 3.0, many(120, SHORT, 200))
        assert flood["verdict"] == "queueing", flood["window"]
        finding = flood["findings"][0]
        assert finding["evidence"]["waiting_mean"] >= 10 and finding["evidence"]["running_mean"] >= 8
        assert finding["change"] == "parallel.data_parallel_size"
    finally:
        assert server.stop() == 0, server.output


def test_histogram_quantiles_interpolate_within_buckets():
    def reading(counts: list[float]) -> dict:
        bounds = ["0.01", "0.02", "0.05", "+Inf"]
        return read_metrics("".join(f'x_bucket{{le="{b}"}} {c}\n' for b, c in zip(bounds, counts)))

    first, last = reading([0, 0, 0, 0]), reading([50, 90, 100, 100])
    assert quantile(first, last, "x", 0.5) == pytest.approx(0.01)  # 50 of 100 at or below 0.01
    assert quantile(first, last, "x", 0.7) == pytest.approx(0.015)  # halfway through the second bucket
    assert quantile(first, last, "x", 0.99) == pytest.approx(0.047)
    assert quantile(last, last, "x", 0.5) == 0.0  # (nothing observed between the readings)
    assert checklist(dict.fromkeys(diagnose([first, last], 1.0).window, 0.0) | {"seconds": 1.0}) == []
