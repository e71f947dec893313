"""The KV connector's tiers on /metrics: blocks held, prompt tokens loaded, bytes moved, files skipped; and the
prompts' KV handed from prefill engines to decode engines (requests by outcome, bytes, seconds waited)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from conveyor.messages import ConnectorStats

# ConnectorStats field (per tier) -> the counter that follows it: name, help
_COUNTERS = {
    "hit_tokens": ("conveyor_kv_tier_hit_tokens", "Prompt tokens loaded from a KV tier instead of computed."),
    "read_bytes": ("conveyor_kv_tier_read_bytes", "Bytes of KV blocks read from a tier."),
    "written_bytes": ("conveyor_kv_tier_written_bytes", "Bytes of KV blocks written to a tier."),
}


class TierMetrics:
    """Each tier's gauges and counters, labeled ``tier`` (and ``replica`` with several engines)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, num_replicas: int):
        extra = ["replica"] if num_replicas > 1 else []
        self.model_name = model_name
        self.num_replicas = num_replicas
        self.blocks = Gauge("conveyor_kv_tier_blocks", "KV blocks a tier holds.", ["model_name", "tier", *extra],
                            registry=registry)
        self.capacity = Gauge("conveyor_kv_tier_capacity_blocks", "KV blocks a tier holds at most.",
                              ["model_name", "tier", *extra], registry=registry)
        self.counters = {field: Counter(name, doc, ["model_name", "tier", *extra], registry=registry)
                         for field, (name, doc) in _COUNTERS.items()}
        self.errors = Counter("conveyor_kv_tier_errors", "Stored KV blocks found unreadable (truncated, corrupt, "
                              "another model's) and recomputed.", ["model_name", *extra], registry=registry)
        self.transfers = Counter("conveyor_kv_transfers", "Requests whose prompt KV came from a prefill engine, by "
                                 "outcome: arrived, or timed_out (the rest computed).",
                                 ["model_name", "outcome", *extra], registry=registry)
        self.transfer_bytes = Counter("conveyor_kv_transfer_bytes", "Bytes of prompt KV that came from prefill "
                                      "engines.", ["model_name", *extra], registry=registry)
        self.transfer_seconds = Counter("conveyor_kv_transfer_wait_seconds", "Seconds requests waited for their "
                                        "prompt KV from a prefill engine (divide by conveyor_kv_transfers_total "
                                        "for the mean per request).", ["model_name", *extra], registry=registry)
        # per replica: the cumulative values last seen, to turn them into increments
        self._seen: list[dict[tuple[str, str], float]] = [{} for _ in range(num_replicas)]

    def engine_ready(self, replica: int) -> None:
        """A new engine counts from zero."""
        self._seen[replica] = {}

    def observe(self, stats: ConnectorStats, replica: int) -> None:
        replica_label = [str(replica)] if self.num_replicas > 1 else []
        for tier, n in stats.blocks.items():
            self.blocks.labels(self.model_name, tier, *replica_label).set(n)
        for tier, n in stats.capacity_blocks.items():
            self.capacity.labels(self.model_name, tier, *replica_label).set(n)
        seen = self._seen[replica]
        for field, counter in self.counters.items():
            for tier, now in getattr(stats, field).items():
                counter.labels(self.model_name, tier, *replica_label).inc(max(0, now - seen.get((field, tier), 0)))
                seen[field, tier] = now
        self.errors.labels(self.model_name, *replica_label).inc(max(0, stats.num_errors - seen.get(("errors", ""), 0)))
        seen["errors", ""] = stats.num_errors
        for outcome, now in stats.transfers.items():
            self.transfers.labels(self.model_name, outcome, *replica_label).inc(
                max(0, now - seen.get(("transfers", outcome), 0)))
            seen["transfers", outcome] = now
        for key, counter, now in (("bytes", self.transfer_bytes, stats.transfer_bytes),
                                  ("seconds", self.transfer_seconds, stats.transfer_seconds)):
            counter.labels(self.model_name, *replica_label).inc(max(0, now - seen.get(("transfer", key), 0)))
            seen["transfer", key] = now
