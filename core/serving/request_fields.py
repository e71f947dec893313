"""Request fields an API does not have, counted on /metrics: a typo such as ``max_tokns``, or another server's
extension such as llama.cpp's ``n_predict``, would otherwise change nothing, unseen."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

# distinct names that get a label of their own (clients choose the names): the rest count as "(other)"
MAX_FIELD_LABELS = 64


class UnknownFields:
    """``conveyor_request_unknown_fields_total{field}``."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        self.model_name = model_name
        self.counter = Counter(
            "conveyor_request_unknown_fields", "Request fields that are not part of the API, by name (ignored, or "
            "refused with a 400 under strict_requests).", ["model_name", "field"], registry=registry,
        )
        self.labels: set[str] = set()

    def count(self, name: str) -> bool:
        """Count one; True the first time this name is seen (to log it once), within MAX_FIELD_LABELS names."""
        first = name not in self.labels
        if first and len(self.labels) < MAX_FIELD_LABELS:
            self.labels.add(name)
        self.counter.labels(self.model_name, name if name in self.labels else "(other)").inc()
        return first and name in self.labels
