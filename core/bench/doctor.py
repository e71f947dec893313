"""``conveyor doctor URL``: what limits a running server now, with the evidence, and the config key to change first.

It reads the server's ``/metrics`` every half second for an interval and compares the first and the last
reading (counters and histograms, their rates over the time between the two) and every reading of the gauges
(``conveyor.perf.readings``); the checklist that names the verdict is ``conveyor.perf.checklist``, which the
server's dashboard runs too.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict

import httpx

from conveyor.perf.checklist import Diagnosis, diagnose, giga
from conveyor.perf.readings import Reading, read_metrics

# seconds between readings of /metrics
SAMPLE_EVERY_S = 0.5


def examine(url: str, seconds: float, progress: Callable[[str], None] | None = None) -> Diagnosis:
    """The diagnosis of ``url`` from readings that span ``seconds``, its rates over the time between the first and
    the last reading (as the dashboard's are), not over ``seconds``: the requests' own time and the half-second
    steps make that longer."""
    readings = timed_readings(url, seconds, progress)
    return diagnose([reading for _, reading in readings], readings[-1][0] - readings[0][0])


def timed_readings(url: str, seconds: float,
                   progress: Callable[[str], None] | None = None) -> list[tuple[float, Reading]]:
    """(time.monotonic() when it arrived, reading) of ``url``'s /metrics every half second until the readings span
    ``seconds`` (at least two readings)."""
    readings: list[tuple[float, Reading]] = []
    with httpx.Client(timeout=10) as client:
        while True:
            response = client.get(f"{url.rstrip('/')}/metrics")
            response.raise_for_status()
            readings.append((time.monotonic(), read_metrics(response.text)))
            if len(readings) >= 2 and readings[-1][0] - readings[0][0] >= seconds:
                return readings
            if progress is not None and len(readings) % 10 == 0:
                progress(f"{len(readings)} readings")
            time.sleep(SAMPLE_EVERY_S)


def format_diagnosis(diagnosis: Diagnosis) -> str:
    w = diagnosis.window
    head = (f"over {diagnosis.seconds:.0f} s: {w['steps']:.0f} steps, {w['generated_tokens']:.0f} tokens generated, "
            f"MFU {w['mfu']:.1%}{_of(w['peak_flops'], 'GFLOP/s')}, MBU {w['mbu']:.1%}"
            f"{_of(w['peak_bytes_per_second'], 'GB/s')}, busy {w['busy_fraction']:.0%}, "
            f"{w['running_mean']:.1f} running, {w['waiting_mean']:.1f} waiting, KV up to {w['kv_usage_max']:.0%}")
    if w["slo_ttft_s"] or w["slo_itl_s"]:
        head += f", goodput {w['goodput']:.2f} requests/s within the latency targets"
    lines = [head]
    if not diagnosis.findings:
        lines.append("verdict: idle (no steps ran)" if diagnosis.verdict == "idle" else
                     "verdict: healthy (nothing on the checklist limits the server now)")
    for i, finding in enumerate(diagnosis.findings):
        head = "verdict" if i == 0 else "also"
        lines.append(f"{head}: {finding.regime}: {finding.summary}")
        lines.append("  evidence: " + ", ".join(f"{k} = {v:g}" for k, v in finding.evidence.items()))
        lines.append(f"  change first: {finding.change}: {finding.advice}")
    return "\n".join(lines)


def _of(peak: float, unit: str) -> str:
    """' of 446 GFLOP/s': the peak a share is of (none where /metrics has no peak)."""
    return f" of {giga(peak)} {unit}" if peak else ""


def to_json(diagnosis: Diagnosis) -> str:
    return json.dumps(asdict(diagnosis), indent=2)
