"""A soak run: a mixed and partly hostile stream of requests against a real server, then its books checked.

For a set time, ``clients`` loops each send one request after another,
picked at random: streamed chats (some with logprobs, stop strings or
``n`` > 1), completions, streams the client drops after a few chunks,
requests the client gives up waiting for, aborts, and malformed bodies; and
every ``burst_every`` seconds a burst of requests past ``max_waiting``. At
the end, once the server is idle:

- every request sent ended exactly one way: done, refused with a 4xx that
  says why, or dropped by its client; no 5xx;
- no request is left anywhere: none in flight in the frontend, none
  running or waiting in the engine, and every KV block is free;
- the frontend's and the engine's resident memory grew by no more than
  ``rss_bound_mb`` since the warm-up.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from conveyor.bench.server import Server

QUESTIONS = ["Why is the sky blue?", "Name three rivers in Europe.", "What is 17 times 3?", "Write a haiku about rain.",
             "What does a compiler do?", "Tell me a story about a dragon.", "How do plants make food?"]
# (body, status): requests every server must refuse, each for its own reason
BAD = [
    (b'{"messages": [', 400),
    (json.dumps({"messages": "Hi"}).encode(), 400),
    (json.dumps({"messages": [{"role": "user", "content": "Hi"}], "temperature": -1}).encode(), 400),
    (json.dumps({"messages": [{"role": "user", "content": "Hi"}], "n": 0}).encode(), 400),
    (json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10**9}).encode(), 400),
    (json.dumps({"messages": [{"role": "user", "content": "Hi"}], "model": "nope"}).encode(), 404),
    (json.dumps({"messages": [{"role": "user", "content": "Hi"}], "stop": ["x"] * 40}).encode(), 400),
]
KINDS = {"stream": 5, "complete": 2, "disconnect": 2, "timeout": 1, "bad": 1}


@dataclass
class Outcomes:
    """How each request ended, by kind of request and way of ending."""

    counts: Counter = field(default_factory=Counter)
    sent: int = 0
    failures: list[str] = field(default_factory=list)

    def record(self, kind: str, outcome: str) -> None:
        self.counts[kind, outcome] += 1


def soak_config(max_waiting: int, max_model_len: int) -> str:
    return f"""
[model]
max_model_len = {max_model_len}

[scheduler]
max_num_seqs = 16
max_waiting = {max_waiting}

[server]
status_interval = 0.0

[[transport]]
plugin = "http"
port = 0
"""


def rss_mb(pid: int) -> float:
    """Resident memory of a process, in MiB (Linux)."""
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) / 1024


async def _one(client: httpx.AsyncClient, kind: str, rng: random.Random, outcomes: Outcomes) -> None:
    outcomes.sent += 1
    try:
        await _request(client, kind, rng, outcomes)
    except httpx.HTTPError as e:  # (a timeout where none was meant, a refused connection)
        outcomes.failures.append(f"{kind}: {type(e).__name__}: {e}")
        outcomes.record(kind, type(e).__name__)


async def _request(client: httpx.AsyncClient, kind: str, rng: random.Random, outcomes: Outcomes) -> None:
    messages = [{"role": "user", "content": rng.choice(QUESTIONS)}]
    body: dict = {"messages": messages, "max_tokens": rng.randint(4, 48), "temperature": rng.choice([0, 0.8])}
    if rng.random() < 0.3:
        body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 5)
    if rng.random() < 0.2:
        body["stop"] = [rng.choice([".", "\n", " the"])]
    if rng.random() < 0.2:
        body["n"] = rng.randint(2, 3)
    if kind == "bad":
        content, expected = rng.choice(BAD)
        response = await client.post("/v1/chat/completions", content=content,
                                     headers={"Content-Type": "application/json"})
        outcome = f"{response.status_code}" + ("" if response.status_code == expected else f" (expected {expected})")
        if response.status_code != expected:
            outcomes.failures.append(f"bad request {content[:80]!r}: {response.status_code} {response.text[:200]}")
        outcomes.record(kind, outcome)
        return
    if kind == "timeout":  # (400 tokens take longer than 0.25 s on any device: one step each)
        body.update(max_tokens=400, ignore_eos=True)
        try:
            response = await client.post("/v1/chat/completions", json=body, timeout=0.25)
        except httpx.TimeoutException:
            outcomes.record(kind, "client timed out")
            return
        _check_done(kind, response, outcomes)
        return
    if kind == "burst":  # (each one admitted holds its place for 48 steps, so the burst outlasts its own arrival)
        body.update(max_tokens=48, ignore_eos=True)
    if kind in ("complete", "burst"):
        response = await client.post("/v1/chat/completions", json=body)
        _check_done(kind, response, outcomes)
        return
    body["stream"] = True
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            _check_refused(kind, response, outcomes)
            return
        chunks = 0
        finished = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks += 1
            data = json.loads(line[6:])
            if "error" in data:  # (refused after the stream began: one of n choices found the queue full)
                status = data["error"]["code"]
                if status != 429:
                    outcomes.failures.append(f"{kind}: an error event {data['error']}")
                outcomes.record(kind, f"{status} in the stream")
                return
            finished += sum(1 for c in data["choices"] if c.get("finish_reason"))
            if kind == "disconnect" and chunks >= 3:
                outcomes.record(kind, "client left")
                return  # (closing the stream drops the connection)
        if finished == body.get("n", 1):
            outcomes.record(kind, "done")
        else:
            outcomes.failures.append(f"a stream ended with {finished} of {body.get('n', 1)} choices finished")
            outcomes.record(kind, "stream cut")


def _check_done(kind: str, response: httpx.Response, outcomes: Outcomes) -> None:
    if response.status_code != 200:
        _check_refused(kind, response, outcomes)
        return
    reasons = [c["finish_reason"] for c in response.json()["choices"]]
    if all(reasons):
        outcomes.record(kind, "done")
    else:
        outcomes.failures.append(f"a reply without finish reasons: {reasons}")
        outcomes.record(kind, "no finish reason")


def _check_refused(kind: str, response: httpx.Response, outcomes: Outcomes) -> None:
    status = response.status_code
    if status != 429:  # (a valid request is refused only for a full queue)
        outcomes.failures.append(f"{kind}: {status} {response.text[:200]}")
    outcomes.record(kind, str(status))


async def _drive(url: str, seconds: float, clients: int, burst_every: float, burst: int, seed: int,
                 outcomes: Outcomes, progress) -> None:
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=clients + burst + 8)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def loop(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            kinds, weights = zip(*KINDS.items())
            while time.monotonic() < deadline:
                await _one(client, rng.choices(kinds, weights)[0], rng, outcomes)

        async def bursts() -> None:
            rng = random.Random(seed)
            while time.monotonic() + burst_every < deadline:
                await asyncio.sleep(burst_every)
                progress(f"burst of {burst} requests; {sum(outcomes.counts.values())} done so far")
                await asyncio.gather(*(_one(client, "burst", rng, outcomes) for _ in range(burst)))

        await asyncio.gather(bursts(), *(loop(i) for i in range(clients)))


def soak(tmp: Path, seconds: float = 600.0, clients: int = 12, burst_every: float = 20.0, max_waiting: int = 16,
         rss_bound_mb: float = 64.0, seed: int = 0, progress=print, overrides: list[str] | None = None) -> dict:
    """Run the soak against a new ``conveyor serve``; returns the report (``report["ok"]``: every check held)."""
    server = Server(soak_config(max_waiting, 512), tmp, overrides=overrides).start()
    try:
        engine_pid = server.engine_pid
        outcomes = Outcomes()
        # the warm-up has a burst too, so that the memory measured after it has seen full batches
        warm = min(15.0, seconds / 4)
        asyncio.run(_drive(server.http, warm, clients, warm / 2, 4 * max_waiting, seed + 1, outcomes, progress))
        rss_start = {"frontend": rss_mb(server.process.pid), "engine": rss_mb(engine_pid)}
        progress(f"warmed up ({sum(outcomes.counts.values())} requests); soaking for {seconds - warm:.0f} s")
        asyncio.run(_drive(server.http, seconds - warm, clients, burst_every, 4 * max_waiting, seed, outcomes,
                           progress))
        idle = _wait_idle(server)
        rss_end = {"frontend": rss_mb(server.process.pid), "engine": rss_mb(engine_pid)}
        blocks, free = server.metric("conveyor_kv_cache_blocks"), server.metric("conveyor_kv_cache_free_blocks")
    finally:
        code = server.stop()
    growth = {name: rss_end[name] - rss_start[name] for name in rss_start}
    checks = {
        "no 5xx and every refusal expected": not outcomes.failures,
        "every request sent ended one way": sum(outcomes.counts.values()) == outcomes.sent,
        "nothing in flight, running or waiting": idle,
        "every KV block free": free == blocks,
        f"RSS grew by at most {rss_bound_mb:.0f} MiB": all(g <= rss_bound_mb for g in growth.values()),
        "the server exited 0": code == 0,
    }
    return {"ok": all(checks.values()), "checks": checks, "outcomes": dict(outcomes.counts),
            "failures": outcomes.failures[:20], "sent": outcomes.sent, "rss_start_mb": rss_start, "rss_end_mb": rss_end, "kv_blocks": (free, blocks)}


def _wait_idle(server: Server, timeout: float = 60.0) -> bool:
    def idle() -> bool:
        return (server.metric("conveyor_num_requests_in_flight") == 0
                and server.metric("conveyor_num_requests_running") == 0
                and server.metric("conveyor_num_requests_waiting") == 0
                and server.metric("conveyor_kv_cache_free_blocks") == server.metric("conveyor_kv_cache_blocks"))

    try:
        server.wait_for(idle, timeout, "the server to be idle")
    except AssertionError:
        return False
    return True


def format_report(report: dict) -> str:
    lines = ["| request | ended | count |", "|---|---|---|"]
    lines += [f"| {kind} | {outcome} | {n} |" for (kind, outcome), n in sorted(report["outcomes"].items())]
    lines += ["", "| check | held |", "|---|---|"]
    lines += [f"| {name} | {'yes' if held else 'NO'} |" for name, held in report["checks"].items()]
    rss = ", ".join(f"{name} {report['rss_start_mb'][name]:.0f} -> {report['rss_end_mb'][name]:.0f} MiB"
                    for name in report["rss_start_mb"])
    lines += ["", (f"requests sent: {report['sent']}; KV blocks free: {report['kv_blocks'][0]:.0f}/"
              f"{report['kv_blocks'][1]:.0f}; RSS {rss}")]
    lines += [f"failure: {f}" for f in report["failures"]]
    return "\n".join(lines)
