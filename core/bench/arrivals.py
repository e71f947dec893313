"""When requests arrive: gamma-distributed gaps (burstiness 1 is a Poisson process), or all at once."""

from __future__ import annotations

import math

import numpy as np


def arrival_gaps(count: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """``count`` gaps, in seconds, between consecutive arrivals.

    The gaps are gamma-distributed with shape ``burstiness`` and mean
    ``1 / rate``: burstiness 1 gives exponential gaps (Poisson arrivals);
    below 1 the arrivals come in bursts, above 1 they are more even. The
    gaps' coefficient of variation is ``1 / sqrt(burstiness)``.

    Args:
        rate: requests per second; ``inf`` sends everything at once.
    """
    if rate <= 0:
        raise ValueError(f"request rate {rate} must be > 0 (or inf)")
    if burstiness <= 0:
        raise ValueError(f"burstiness {burstiness} must be > 0")
    if math.isinf(rate):
        return np.zeros(count)
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=count)


def arrival_times(num_requests: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Seconds from the start at which each request is sent: the first at once, as vLLM's benchmark sends it (a
    first request held back for a gap would leave the run's start idle and lower its measured throughput)."""
    gaps = arrival_gaps(max(num_requests - 1, 0), rate, burstiness, seed)
    return np.concatenate([[0.0], np.cumsum(gaps)])[:num_requests]
