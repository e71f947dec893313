"""Small factories for scheduler and KV cache tests: no model, no weights."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from conveyor.scheduling.gates import AdmissionGate
from conveyor.kvcache import KVCacheSpec
from conveyor.messages import RequestOutput, RunnerOutput
from conveyor.plugins.kvcache.paged import PagedKVCache, PagedOptions
from conveyor.request import Request, RequestStatus
from conveyor.sampling import SamplingParams
from conveyor.scheduler import ScheduledBatch, Scheduler

_ids = itertools.count()


def create_spec(max_model_len: int = 256, num_layers: int = 1, num_kv_heads: int = 1, head_dim: int = 4,
                sliding_window: int = 0) -> KVCacheSpec:
    return KVCacheSpec(num_layers, num_kv_heads, head_dim, "float32", max_model_len, sliding_window=sliding_window)


def create_kvcache(num_blocks: int = 64, block_size: int = 4, max_model_len: int = 256,
                   sliding_window: int = 0) -> PagedKVCache:
    return PagedKVCache(PagedOptions(block_size=block_size, num_blocks=num_blocks),
                        create_spec(max_model_len, sliding_window=sliding_window))


def create_request(
    prompt_len: int, max_tokens: int = 4, max_model_len: int = 256, priority: int = 0, request_id: str | None = None
) -> Request:
    return Request(
        request_id or f"r{next(_ids)}",
        list(range(1, prompt_len + 1)),
        SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
        max_model_len,
        priority=priority,
    )


def next_token(request: Request) -> int:
    """A fake model: the next token is a fixed function of every token so far."""
    tokens = request.all_token_ids()
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) * 2654435761) % 50_000


def ran(scheduler: Scheduler, batch: ScheduledBatch, sampled: list[int | None], **output) -> list[RequestOutput]:
    """The engine's side of a step the workers ran at once: ``batch`` submitted, then its results (the ``sampled``
    tokens, no logprobs, and any other ``RunnerOutput`` fields) recorded; what the requests produced."""
    scheduler.submitted(batch)
    return scheduler.update(batch, RunnerOutput(sampled, [None] * len(sampled), **output))


def fake_step(scheduler: Scheduler, model=next_token):
    """One engine step with a fake runner: the gates release what they let go (the outputs start with the
    requests they refused), then each request at the end of its known tokens gets model(request)."""
    refused = scheduler.release()
    batch = scheduler.schedule()
    sampled = [
        model(r) if r.num_computed_tokens + n == r.num_tokens else None
        for r, n in zip(batch.requests, batch.num_tokens)
    ]
    return batch, refused + ran(scheduler, batch, sampled)


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> list[str]:
    """Step until nothing is left; return request ids in the order they finished."""
    finished: list[str] = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return finished
        _, outputs = fake_step(scheduler)
        finished.extend(o.request_id for o in outputs if o.finish_reason)
    raise AssertionError(f"not finished after {max_steps} steps")


def assert_no_leak(kvcache) -> None:
    """Every block is free again and no reference is left."""
    assert kvcache.num_free_blocks == kvcache.num_blocks
    if hasattr(kvcache, "ref_counts"):
        assert not any(kvcache.ref_counts) and not kvcache.tables
    else:
        assert not kvcache.slabs


class Countdown(AdmissionGate):
    """A gate that holds the requests ``hold`` picks for ``steps`` releases each, then lets them go, or ends
    those ``refuse`` picks with an error."""

    def __init__(self, status: RequestStatus, hold: Callable[[Request], bool], steps: int = 2,
                 refuse: Callable[[Request], bool] = lambda request: False):
        self.status = status
        self.hold, self.steps, self.refuse = hold, steps, refuse
        self.left: dict[str, int] = {}
        self.forgotten: list[str] = []
        self.idle_seen: list[bool] = []

    def holds(self, request: Request) -> bool:
        if not self.hold(request):
            return False
        self.left[request.request_id] = self.steps
        return True

    def release(self, held: list[Request], idle: bool) -> tuple[list[Request], list[tuple[Request, str]]]:
        self.idle_seen.append(idle)
        ready, refused = [], []
        for request in held:
            self.left[request.request_id] -= 1
            if self.left[request.request_id] > 0:
                continue
            if self.refuse(request):
                refused.append((request, f"{request.request_id} refused"))
            else:
                ready.append(request)
        return ready, refused

    def forget(self, request: Request) -> None:
        self.forgotten.append(request.request_id)
        self.left.pop(request.request_id, None)
