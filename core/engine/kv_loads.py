"""Blocks a KV connector could not load: the connector's worker side says which it could not fill
(``KVConnectorWorker.apply``), and the requests that read them start over from their last good block."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conveyor.kvcache import KVCacheManager
    from conveyor.messages import RunnerOutput
    from conveyor.request import Request
    from conveyor.scheduler import ScheduledBatch, Scheduler

logger = logging.getLogger("conveyor")


def check_loads(kvcache: KVCacheManager, loads: dict[int, bytes], batch: ScheduledBatch,
                result: RunnerOutput | None) -> list[tuple[Request, int]]:
    """The blocks of ``loads`` (a step's: ``KVCacheManager.take_loads``) that the worker side could not fill (all of
    them when the step failed, ``result`` None) hold garbage: the pool forgets them (``KVCacheManager.loads_failed``),
    and a request of the step that holds one gets no token from it (it read them).

    Returns:
        Those requests, each with how many of its tokens are still good (before its first such block): ``restart``
        them once the step is recorded.
    """
    if not loads:  # (every step without a connector's loads: nothing to look at)
        return []
    failed = loads.keys() & (set(result.kv_load_failed) if result is not None else loads.keys())
    if not failed:
        return []
    logger.warning("KV connector: %d blocks could not be loaded; the requests that hold them compute them",
                   len(failed))
    kvcache.loads_failed({block: loads[block] for block in failed})
    restarts = []
    for i, request in enumerate(batch.requests if result is not None else ()):
        # (only this step's requests can hold them: nothing is scheduled on top of a step that loads)
        blocks = () if request.is_finished else kvcache.block_ids(request)
        first = next((j for j, block in enumerate(blocks) if block in failed), None)
        if first is None:
            continue
        # (a request that loads is in its first step: no drafts, no prompt logprobs, which load nothing)
        result.sampled[i] = result.logprobs[i] = None
        if result.embeddings:
            result.embeddings[i] = None
        restarts.append((request, first * kvcache.block_size))
    return restarts


def restart(scheduler: Scheduler, restarts: list[tuple[Request, int]]) -> None:
    """Each request back to the queue with only its good tokens computed (``check_loads``' list)."""
    for request, num_good in restarts:
        if request.is_finished:
            continue
        # (the layout registers a request's full computed blocks as it frees them: none from the bad one on)
        request.num_computed_tokens = min(request.num_computed_tokens, num_good)
        request.num_cached_tokens = min(request.num_cached_tokens, num_good)
        scheduler.preempt(request)
