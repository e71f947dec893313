"""The server's one-line status while busy (``[server] status_interval``): running and waiting requests, KV usage,
and the token rates since the last line."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conveyor.serving.dashboard import DashboardFeed


class StatusLine:
    """What ``ServerMetrics`` counts, said in one line; the counts are its (``first_token``, ``next_token``)."""

    dashboard: DashboardFeed
    _num_prompt_tokens: int
    _num_generation_tokens: int
    # (when, prompt tokens, generated tokens) at the last line
    _last_report: tuple[float, int, int]

    @property
    def active_since_status_line(self) -> bool:
        """Whether tokens came since the last status line."""
        _, prompt, generation = self._last_report
        return (prompt, generation) != (self._num_prompt_tokens, self._num_generation_tokens)

    def status_line(self) -> str:
        """One line: running, waiting, KV usage (summed and averaged over replicas), token rates since the last."""
        now = time.monotonic()
        prompt, generation = self._num_prompt_tokens, self._num_generation_tokens
        then, last_prompt, last_generation = self._last_report
        self._last_report = (now, prompt, generation)
        elapsed = max(now - then, 1e-9)
        seen = [stats for stats in self.dashboard.latest if stats is not None]
        running = sum(stats.scheduler.num_running for stats in seen)
        waiting = sum(stats.scheduler.num_waiting for stats in seen)
        usage = sum(stats.kv.usage for stats in seen) / len(seen) if seen else 0.0
        return (
            f"running {running}, waiting {waiting}, KV {usage:.1%}, "
            f"prompt {(prompt - last_prompt) / elapsed:.1f} tok/s, "
            f"generation {(generation - last_generation) / elapsed:.1f} tok/s"
        )
