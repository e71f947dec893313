"""What the live dashboard (``GET /dashboard``) shows, kept as the engine's steps and the requests' tokens come.

The page polls ``GET /dashboard/data`` (JSON, the shape of ``DashboardFeed.snapshot``) about once a second:

- ``steps``: the last ``STEPS_KEPT`` steps of all replicas: prompt tokens (whole prompts and chunks) and
  decode tokens, the requests of each kind, the step's seconds;
- ``series``: one row per second of the last ``SECONDS_KEPT``: running and waiting requests, KV usage (the
  fullest replica's), TTFT and ITL P50/P99 of the tokens that came in that second, output tokens per second,
  the second's MFU and MBU (weighted by forward time), and the requests that ended in it within the
  scheduler's latency targets (goodput; with no targets, every request that ended normally);
- ``replicas``: each engine's queues now, and its KV block map: which running request holds which blocks,
  as runs ``[first block, count]`` (a block two requests hold is a shared prefix block), with the free
  blocks counted at the same step;
- ``queue``: the requests the frontend has sent that have no token yet (waiting or in their prefill), how
  many, and the oldest ``QUEUE_SHOWN`` with their seconds since arrival and prompt tokens;
- ``verdict``: ``conveyor doctor``'s diagnosis of the last ``VERDICT_WINDOW_S`` seconds of /metrics.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from conveyor.messages import KVOwners, StepStats
from conveyor.perf.checklist import diagnose
from conveyor.perf.readings import Reading, read_metrics

# steps shown as bars
STEPS_KEPT = 240
# seconds of history in the time charts
SECONDS_KEPT = 300
# seconds of /metrics readings the verdict is made from
VERDICT_WINDOW_S = 10.0
# seconds between two readings of /metrics for the verdict (more polls reuse the last one)
READ_EVERY_S = 0.5
# requests listed in the queue, oldest first
QUEUE_SHOWN = 10


def block_runs(block_ids: list[int], num_blocks: int) -> list[list[int]]:
    """Blocks as runs ``[first, count]`` of consecutive ids (ids past the pool, placeholders, left out)."""
    runs: list[list[int]] = []
    for block in block_ids:
        if not 0 <= block < num_blocks:
            continue
        if runs and runs[-1][0] + runs[-1][1] == block:
            runs[-1][1] += 1
        else:
            runs.append([block, 1])
    return runs


def _quantile(values: list[float], q: float) -> float:
    """The nearest-rank quantile of unsorted values."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class _Second:
    """What came in one wall-clock second."""

    def __init__(self, start: int):
        self.start = start
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.tokens = 0  # output tokens (an output of accepted drafts brings several)
        self.work = 0.0  # forward seconds
        self.within_slo = 0  # requests that ended within the latency targets
        self.mfu_work = 0.0  # MFU x forward seconds
        self.mbu_work = 0.0

    def row(self, running: int, waiting: int, kv_usage: float) -> list[Any]:
        def ms(values: list[float], q: float) -> float | None:
            return round(_quantile(values, q) * 1e3, 3) if values else None

        mfu = self.mfu_work / self.work if self.work else None
        mbu = self.mbu_work / self.work if self.work else None
        return [self.start, running, waiting, round(kv_usage, 4), ms(self.ttft, 0.5), ms(self.ttft, 0.99),
                ms(self.itl, 0.5), ms(self.itl, 0.99), self.tokens, mfu, mbu, self.within_slo]


SERIES = ("t", "running", "waiting", "kv_usage", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
          "output_tokens_per_s", "mfu", "mbu", "requests_within_slo_per_s")
STEP_FIELDS = ("step", "prefill_tokens", "decode_tokens", "prefill_seqs", "decode_seqs", "step_ms")


class DashboardFeed:
    """The dashboard's recent history, fed by the server's metrics (steps of every replica, tokens)."""

    def __init__(self, num_replicas: int = 1, clock=time.time):
        self._clock = clock
        self._steps: deque[tuple[int, int, int, int, int, float]] = deque(maxlen=STEPS_KEPT)
        self._num_steps = 0
        self._rows: deque[list[Any]] = deque(maxlen=SECONDS_KEPT)
        self._second = _Second(int(clock()))
        # per replica, its latest step stats (or snapshot between steps)
        self.latest: list[StepStats | None] = [None] * num_replicas
        # per replica, the latest step that carried the KV cache's owners
        self._owners: list[StepStats | None] = [None] * num_replicas
        self._readings: deque[tuple[float, Reading]] = deque()
        # requests with no token yet: id -> (arrival, prompt tokens), oldest first
        self._pending: dict[str, tuple[float, int]] = {}
        self._verdict: dict[str, Any] | None = None

    def _now_second(self) -> _Second:
        """The open second, after closing the ones that have passed (idle seconds get rows too)."""
        now = int(self._clock())
        while self._second.start < now:
            self._rows.append(self._second.row(*self._gauges()))
            start = self._second.start + 1 if now - self._second.start <= SECONDS_KEPT else now - SECONDS_KEPT + 1
            self._second = _Second(start)
        return self._second

    def _gauges(self) -> tuple[int, int, float]:
        seen = [s for s in self.latest if s is not None]
        return (sum(s.scheduler.num_running for s in seen), sum(s.scheduler.num_waiting for s in seen),
                max((s.kv.usage for s in seen), default=0.0))

    def step(self, stats: StepStats, replica: int = 0) -> None:
        """A step's stats (or a snapshot between steps) from engine replica ``replica``."""
        second = self._now_second()
        self.latest[replica] = stats
        if stats.kv_owners is not None:
            self._owners[replica] = stats
        if not (stats.num_prefill_tokens or stats.num_decode_tokens):
            return
        self._num_steps += 1
        seconds = stats.schedule_time + stats.forward_time + stats.sample_time + stats.update_time
        self._steps.append((self._num_steps, stats.num_prefill_tokens, stats.num_decode_tokens,
                            stats.num_prefill_seqs, stats.num_decode_seqs, round(seconds * 1e3, 3)))
        second.work += stats.forward_time
        second.mfu_work += stats.mfu * stats.forward_time
        second.mbu_work += stats.mbu * stats.forward_time

    def engine_ready(self, replica: int = 0) -> None:
        """Replica ``replica``'s engine (re)started: nothing runs on it yet."""
        self.latest[replica] = self._owners[replica] = None

    def pending(self, request_id: str, prompt_tokens: int) -> None:
        """A request was sent to the engine."""
        self._pending[request_id] = (self._clock(), prompt_tokens)

    def answered(self, request_id: str) -> None:
        """A request got its first token, or ended."""
        self._pending.pop(request_id, None)

    def first_token(self, ttft: float, num_tokens: int = 1) -> None:
        second = self._now_second()
        second.ttft.append(ttft)
        second.tokens += num_tokens

    def next_token(self, itl: float, num_tokens: int = 1) -> None:
        second = self._now_second()
        second.itl.append(itl)
        second.tokens += num_tokens

    def within_slo(self) -> None:
        """A request ended within the latency targets."""
        self._now_second().within_slo += 1

    def read_metrics(self, exposition: Callable[[], bytes]) -> None:
        """Read /metrics (``exposition``: its text) unless it was read less than READ_EVERY_S ago; the verdict
        is made from the readings of the last VERDICT_WINDOW_S seconds."""
        now = time.monotonic()
        if self._readings and now - self._readings[-1][0] < READ_EVERY_S:
            return
        self._readings.append((now, read_metrics(exposition().decode())))
        while len(self._readings) > 2 and now - self._readings[1][0] >= VERDICT_WINDOW_S:
            self._readings.popleft()
        if len(self._readings) >= 2:
            seconds = now - self._readings[0][0]
            self._verdict = asdict(diagnose([r for _, r in self._readings], seconds))

    def snapshot(self) -> dict[str, Any]:
        """Everything the page draws (see the module's docstring)."""
        self._now_second()
        now = self._clock()
        replicas = []
        for latest, mapped in zip(self.latest, self._owners):
            if latest is None:
                replicas.append(None)
                continue
            # the map and its block counts from the same step
            kv = (mapped or latest).kv
            owners = mapped.kv_owners if mapped is not None else KVOwners([], [])
            holders = [{"request_id": request_id, "blocks": block_runs(blocks, kv.num_blocks)}
                       for request_id, blocks in zip(owners.request_ids, owners.block_ids)]
            replicas.append({"num_blocks": kv.num_blocks, "block_size": kv.block_size,
                             "num_free_blocks": kv.num_free_blocks, "kv_usage": latest.kv.usage,
                             "running": latest.scheduler.num_running, "waiting": latest.scheduler.num_waiting,
                             "preemptions": latest.scheduler.num_preemptions, "owners": holders})
        return {
            "time": now,
            "steps": {name: [step[i] for step in self._steps] for i, name in enumerate(STEP_FIELDS)},
            "series": {name: [row[i] for row in self._rows] for i, name in enumerate(SERIES)},
            "replicas": replicas,
            "queue": {"count": len(self._pending), "oldest": [
                [request_id, round(now - arrival, 3), tokens]
                for request_id, (arrival, tokens) in itertools.islice(self._pending.items(), QUEUE_SHOWN)]},
            "verdict": self._verdict,
        }
