"""The soak run for 20 seconds against a real server (``benchmarks/soak.py`` runs it for ten minutes): requests of
every kind, dropped clients, malformed bodies and bursts past max_waiting at once; every request ends one way,
no 5xx, nothing left in flight or in the KV cache, memory bounded, a clean exit."""

from __future__ import annotations

from conveyor.bench.soak import format_report, soak


def test_twenty_seconds_of_mixed_and_hostile_traffic(tmp_path):
    # (a looser memory bound than the ten-minute run's 64 MiB: allocators on other CPUs settle differently)
    report = soak(tmp_path, seconds=20, clients=8, burst_every=6, rss_bound_mb=128)
    print(format_report(report))
    assert report["ok"], format_report(report)
    outcomes = {outcome for (_, outcome) in report["outcomes"]}
    # every way of ending happened (so each was checked)
    assert {"done", "client left", "client timed out", "400", "429"} <= outcomes, outcomes
