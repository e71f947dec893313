"""Per-request timings and the summary statistics of a run, defined as vLLM's ``bench serve`` defines them.

- TTFT: from sending the request to the first chunk that carries content.
- ITL: the gaps between consecutive content chunks of a request (all requests pooled).
- TPOT: per request, ``(e2e - TTFT) / (output tokens - 1)``; requests with one token have none.
- E2E: from sending the request to its last chunk.
- Goodput: requests per second that met every SLO given (``ttft``, ``tpot``, ``e2e`` in ms).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec
import numpy as np

from conveyor.scheduling.slo import itl_p99

PERCENTILES = (50, 90, 95, 99)
SLO_METRICS = ("ttft", "tpot", "e2e", "itl")


class RequestRecord(msgspec.Struct, omit_defaults=True):
    """One request's timings, in seconds from the start of the run."""

    index: int
    prompt_tokens: int
    # output tokens as the server's usage reported them (0 for a failed request)
    output_tokens: int = 0
    # when the request was sent
    start: float = 0.0
    # seconds from start to the first content chunk, and to the end
    ttft: float | None = None
    e2e: float | None = None
    # seconds between consecutive content chunks
    itl: list[float] = []
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def percentiles(values: Sequence[float], points: Sequence[int] = PERCENTILES) -> dict[str, float]:
    """mean and the percentiles (numpy's linear interpolation) of ``values``; NaN when empty."""
    if not values:
        return {"mean": float("nan"), **{f"p{p}": float("nan") for p in points}}
    array = np.asarray(values, dtype=np.float64)
    return {"mean": float(array.mean()), **{f"p{p}": float(np.percentile(array, p)) for p in points}}


def meets_slos(record: RequestRecord, slos_ms: Mapping[str, float]) -> bool:
    """True when the request succeeded and each SLO given holds: ttft, tpot, e2e, or itl (the P99 of the
    request's own gaps between tokens, as the server's goodput counts it); a request without a TPOT or gaps
    passes that one."""
    if not record.ok:
        return False
    values = {"ttft": record.ttft, "tpot": record.tpot, "e2e": record.e2e,
              "itl": itl_p99(record.itl) if record.itl else None}
    for name, limit in slos_ms.items():
        value = values[name]
        if value is not None and value * 1000 > limit:
            return False
    return True


def summarize(records: Sequence[RequestRecord], duration: float, slos_ms: Mapping[str, float] | None = None) -> dict:
    """The run's summary: counts, throughputs, and latency statistics in milliseconds."""
    ok = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    duration = max(duration, 1e-9)

    def ms(values: list[float]) -> dict[str, float]:
        return {k: v * 1000 for k, v in percentiles(values).items()}

    summary = {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
        "ttft_ms": ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": ms([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": ms([gap for r in ok for gap in r.itl]),
        "e2e_ms": ms([r.e2e for r in ok if r.e2e is not None]),
        "errors": sorted({r.error for r in records if r.error is not None}),
    }
    if slos_ms:
        good = sum(meets_slos(r, slos_ms) for r in records)
        summary["slos_ms"] = dict(slos_ms)
        summary["goodput"] = good / duration
    return summary
