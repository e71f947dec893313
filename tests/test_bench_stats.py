"""The benchmark's statistics and arrival process against hand-computed values and the gamma distribution."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conveyor.bench.arrivals import arrival_gaps, arrival_times
from conveyor.bench.stats import RequestRecord, meets_slos, percentiles, summarize


def test_percentiles_interpolate_linearly():
    stats = percentiles([4.0, 1.0, 3.0, 2.0])
    assert stats["mean"] == 2.5
    assert stats["p50"] == pytest.approx(2.5)
    # rank 0.9 x 3 = 2.7: 3 + 0.7 x (4 - 3)
    assert stats["p90"] == pytest.approx(3.7)
    assert stats["p99"] == pytest.approx(3.97)
    assert math.isnan(percentiles([])["p50"])


def test_tpot_excludes_the_first_token():
    record = RequestRecord(0, prompt_tokens=10, output_tokens=5, ttft=0.5, e2e=2.5)
    assert record.tpot == pytest.approx((2.5 - 0.5) / 4)
    assert RequestRecord(1, 10, output_tokens=1, ttft=0.5, e2e=0.5).tpot is None


def test_summary_by_hand():
    records = [
        RequestRecord(0, 10, output_tokens=3, start=0.0, ttft=0.1, e2e=0.5, itl=[0.2, 0.2]),
        RequestRecord(1, 20, output_tokens=5, start=0.1, ttft=0.3, e2e=1.1, itl=[0.1, 0.3, 0.2, 0.2]),
        RequestRecord(2, 30, error="HTTP 500: boom"),
    ]
    s = summarize(records, duration=2.0, slos_ms={"ttft": 200})
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["output_tokens"] == 8 and s["prompt_tokens"] == 30
    assert s["output_throughput"] == pytest.approx(4.0)
    assert s["total_token_throughput"] == pytest.approx(19.0)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    # TPOT: (0.5 - 0.1) / 2 = 0.2 and (1.1 - 0.3) / 4 = 0.2
    assert s["tpot_ms"]["p50"] == pytest.approx(200.0)
    # ITL pools every gap: [0.2, 0.2, 0.1, 0.3, 0.2, 0.2]
    assert s["itl_ms"]["mean"] == pytest.approx(200.0)
    assert s["itl_ms"]["p99"] == pytest.approx(1000 * float(np.percentile([0.2, 0.2, 0.1, 0.3, 0.2, 0.2], 99)))
    # only request 0 has TTFT <= 200 ms; the failed one never counts
    assert s["goodput"] == pytest.approx(0.5)
    assert s["errors"] == ["HTTP 500: boom"]


def test_goodput_checks_every_slo():
    record = RequestRecord(0, 10, output_tokens=11, ttft=0.1, e2e=1.1)  # TPOT 100 ms
    assert meets_slos(record, {"ttft": 100, "tpot": 100})
    assert not meets_slos(record, {"ttft": 100, "tpot": 99})
    assert not meets_slos(record, {"e2e": 1000})


@pytest.mark.parametrize("rate", [0.5, 4.0, 50.0])
def test_mean_arrival_rate(rate):
    gaps = arrival_gaps(10_000, rate, seed=7)
    assert 1 / gaps.mean() == pytest.approx(rate, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_burstiness_sets_the_gamma_variance(burstiness):
    rate = 2.0
    gaps = arrival_gaps(10_000, rate, burstiness, seed=3)
    # gamma(shape=b, scale=1/(rate b)): variance 1 / (rate^2 b), coefficient of variation 1/sqrt(b)
    assert gaps.var() == pytest.approx(1 / (rate**2 * burstiness), rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_infinite_rate_sends_everything_at_once():
    assert not arrival_times(100, math.inf).any()
    times = arrival_times(100, 3.0, seed=1)
    assert (np.diff(times) >= 0).all()
    with pytest.raises(ValueError, match="rate"):
        arrival_gaps(3, 0.0)
