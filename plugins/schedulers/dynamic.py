"""``dynamic``: batches collected over a time window, each run to completion.

A batch opens when a request arrives and closes after ``window_ms`` or at
``max_batch_size`` requests, whichever comes first; then it runs until its
slowest request is done, while new arrivals wait for the next window.
"""

from __future__ import annotations

from conveyor.plugins.schedulers.declarations import DynamicOptions
from conveyor.plugins.schedulers.static import RunToCompletionScheduler


class DynamicScheduler(RunToCompletionScheduler):
    """Dynamic batching: whatever arrived within a time window, run to completion."""

    name = "dynamic"
    Options = DynamicOptions

    @classmethod
    def max_running(cls, options: DynamicOptions) -> int:
        return options.max_batch_size

    def __init__(self, options: DynamicOptions, kvcache, max_model_len: int):
        super().__init__(options, kvcache, max_model_len)
        self.max_batch_size = options.max_batch_size
        self.max_wait_s = options.window_ms / 1000
