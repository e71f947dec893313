"""How the server's metrics are declared: each series in one registry with the ``model_name`` label, and those that
describe one engine once per replica."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# seconds; fine at the low end where CPU decode steps live, up to minutes for long requests
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
# seconds, 1-2-5 per decade: from one collective on a fast link (0.1 ms) to a long prefill on CPU workers (10 s)
PARALLEL_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0,
                    5.0, 10.0)
# a share of the step (0..1)
FRACTION_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class Series:
    """Declares series in ``registry``, each labeled with ``model_name``."""

    def __init__(self, registry: CollectorRegistry, model_name: str, num_replicas: int):
        self.registry = registry
        self.model_name = model_name
        self.num_replicas = num_replicas

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, doc, ["model_name"], registry=self.registry, buckets=buckets).labels(self.model_name)

    def gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, ["model_name"], registry=self.registry).labels(self.model_name)

    def counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, ["model_name"], registry=self.registry).labels(self.model_name)

    def per_engine(self, kind: type[Gauge | Counter], name: str, doc: str) -> list:
        """One child per replica: unlabeled with one engine, else labeled ``replica="i"``."""
        if self.num_replicas == 1:
            return [kind(name, doc, ["model_name"], registry=self.registry).labels(self.model_name)]
        parent = kind(name, doc, ["model_name", "replica"], registry=self.registry)
        return [parent.labels(self.model_name, str(i)) for i in range(self.num_replicas)]
