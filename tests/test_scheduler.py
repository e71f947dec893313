"""The continuous scheduler, driven with small factories and a fake runner (no model)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from conveyor.plugins.schedulers.continuous import ContinuousOptions, ContinuousScheduler
from conveyor.request import RequestRejected, RequestStatus
from tests.factories import create_kvcache, create_request, fake_step, run_to_completion


def create_scheduler(num_blocks: int = 64, block_size: int = 4, max_model_len: int = 256, **options):
    kvcache = create_kvcache(num_blocks, block_size, max_model_len)
    return ContinuousScheduler(ContinuousOptions(**options), kvcache, max_model_len)


def test_token_budget_and_chunked_prefill():
    scheduler = create_scheduler(max_num_batched_tokens=10)
    long, short = create_request(23, max_tokens=3), create_request(4, max_tokens=3)
    scheduler.add(long)
    scheduler.add(short)
    batch, _ = fake_step(scheduler)
    assert list(zip(batch.requests, batch.num_tokens)) == [(long, 10)]
    batch, _ = fake_step(scheduler)
    assert list(zip(batch.requests, batch.num_tokens)) == [(long, 10)]
    batch, outputs = fake_step(scheduler)  # last 3 prompt tokens, then the short prompt fills the budget
    assert sorted(zip([r.request_id for r in batch.requests], batch.num_tokens)) == sorted(
        [(long.request_id, 3), (short.request_id, 4)]
    )
    assert {o.request_id for o in outputs} == {long.request_id, short.request_id}
    batch, _ = fake_step(scheduler)  # both decode now: one token each, decodes first
    assert batch.num_tokens == [1, 1] and batch.num_decodes == 2


def test_long_prefill_threshold_caps_each_chunk():
    scheduler = create_scheduler(max_num_batched_tokens=100, long_prefill_token_threshold=8)
    a, b = create_request(20), create_request(20)
    scheduler.add(a)
    scheduler.add(b)
    batch, _ = fake_step(scheduler)
    assert batch.num_tokens == [8, 8]


def test_max_num_seqs_limits_the_batch():
    scheduler = create_scheduler(max_num_seqs=2)
    for _ in range(5):
        scheduler.add(create_request(3, max_tokens=5))
    batch, _ = fake_step(scheduler)
    assert len(batch) == 2
    assert scheduler.stats().num_waiting == 3


def test_out_of_blocks_preempts_the_newest_and_everything_still_finishes():
    # 10 blocks of 4 tokens; three requests that each grow to 16 tokens (4 blocks) cannot all fit.
    scheduler = create_scheduler(num_blocks=10, block_size=4)
    requests = [create_request(8, max_tokens=8) for _ in range(3)]
    for r in requests:
        scheduler.add(r)
    finished = run_to_completion(scheduler)
    assert sorted(finished) == sorted(r.request_id for r in requests)
    assert scheduler.stats().num_preemptions >= 1
    assert all(len(r.output_token_ids) == 8 for r in requests)
    assert scheduler.kvcache.num_free_blocks == 10


def test_priority_policy_runs_urgent_requests_first_and_preempts_the_least_urgent():
    scheduler = create_scheduler(num_blocks=6, block_size=4, policy="priority", max_num_seqs=8)
    low = create_request(8, max_tokens=8, priority=5, request_id="low")
    scheduler.add(low)
    fake_step(scheduler)
    high = create_request(8, max_tokens=8, priority=0, request_id="high")
    scheduler.add(high)
    finished = run_to_completion(scheduler)
    assert finished == ["high", "low"]
    assert scheduler.stats().num_preemptions >= 1


def test_admission_rejects_what_can_never_run():
    scheduler = create_scheduler(num_blocks=4, block_size=4, max_model_len=64, max_waiting=2)
    with pytest.raises(RequestRejected, match="max_model_len=64 leaves no room"):
        scheduler.add(create_request(64, max_model_len=64))
    with pytest.raises(RequestRejected, match="needs 30 tokens of KV cache but the whole cache holds 16"):
        scheduler.add(create_request(20, max_tokens=10, max_model_len=64))
    scheduler.add(create_request(2, max_model_len=64))
    scheduler.add(create_request(2, max_model_len=64))
    with pytest.raises(RequestRejected, match=r"waiting queue is full \(max_waiting=2\)") as info:
        scheduler.add(create_request(2, max_model_len=64))
    assert info.value.status == 429
    assert scheduler.stats().num_rejected == 3


def test_abort_frees_blocks_wherever_the_request_is():
    scheduler = create_scheduler(num_blocks=16, max_num_seqs=1)
    running, waiting = create_request(10, max_tokens=20), create_request(10, max_tokens=20)
    scheduler.add(running)
    scheduler.add(waiting)
    fake_step(scheduler)
    assert running.status == RequestStatus.RUNNING and scheduler.kvcache.num_free_blocks < 16
    outputs = scheduler.abort([running.request_id, waiting.request_id, "unknown"])
    assert [(o.request_id, o.finish_reason) for o in outputs] == [
        (running.request_id, "abort"),
        (waiting.request_id, "abort"),
    ]
    assert scheduler.kvcache.num_free_blocks == 16
    assert not scheduler.has_unfinished()


@settings(max_examples=40, deadline=None)
@given(
    prompts=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12)), min_size=1, max_size=12),
    budget=st.integers(1, 48),
    num_blocks=st.integers(13, 40),
    max_num_seqs=st.integers(1, 6),
)
def test_any_workload_completes_within_budget_without_leaking(prompts, budget, num_blocks, max_num_seqs):
    """A brute-force check of the invariants on random workloads."""
    scheduler = create_scheduler(
        num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs
    )
    requests = [create_request(p, max_tokens=m) for p, m in prompts]
    for r in requests:
        scheduler.add(r)
    for _ in range(10_000):
        if not scheduler.has_unfinished():
            break
        batch, _ = fake_step(scheduler)
        assert batch.total_tokens <= budget
        assert len(batch) <= max_num_seqs
        assert all(n == 1 for n in batch.num_tokens[: batch.num_decodes])
    assert all(len(r.output_token_ids) == m for r, (_, m) in zip(requests, prompts))
    assert scheduler.kvcache.num_free_blocks == num_blocks
