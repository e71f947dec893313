"""Prefill and decode engines on /metrics: each replica's role, and the queues of each role together."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Gauge

from conveyor.messages import StepStats


class RoleMetrics:
    """``conveyor_engine_role{replica, role}`` (1 per replica: join it to any per-replica series) and the requests
    running and waiting on all engines of a role, as of each one's latest step."""

    def __init__(self, registry: CollectorRegistry, model_name: str, roles: Sequence[str]):
        self.model_name = model_name
        self.roles = list(roles)
        info = Gauge("conveyor_engine_role", "1 for each engine replica, labeled with its role (prefill, decode).",
                     ["model_name", "replica", "role"], registry=registry)
        for replica, role in enumerate(self.roles):
            info.labels(model_name, str(replica), role).set(1)
        self.running = Gauge("conveyor_role_requests_running", "Requests running on the engines of a role.",
                             ["model_name", "role"], registry=registry)
        self.waiting = Gauge("conveyor_role_requests_waiting", "Requests waiting (queued or held for their KV) on "
                             "the engines of a role.", ["model_name", "role"], registry=registry)
        # per replica: (running, waiting) as of its latest step
        self._queues = [(0, 0)] * len(self.roles)

    def observe(self, stats: StepStats, replica: int) -> None:
        self._queues[replica] = (stats.scheduler.num_running, stats.scheduler.num_waiting)
        role = self.roles[replica]
        mine = [queues for queues, other in zip(self._queues, self.roles) if other == role]
        self.running.labels(self.model_name, role).set(sum(running for running, _ in mine))
        self.waiting.labels(self.model_name, role).set(sum(waiting for _, waiting in mine))

    def engine_ready(self, replica: int) -> None:
        """A new engine process starts with empty queues."""
        self._queues[replica] = (0, 0)
