"""The continuous scheduler, driven with small factories and a fake runner (no model)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.messages import RunnerOutput
from conveyor.plugins.kvcache.contiguous import ContiguousKVCache, ContiguousOptions
from conveyor.plugins.kvcache.paged import block_digest
from conveyor.plugins.schedulers.continuous import ContinuousOptions, ContinuousScheduler
from conveyor.plugins.schedulers.dynamic import DynamicOptions, DynamicScheduler
from conveyor.plugins.schedulers.static import StaticOptions, StaticScheduler
from conveyor.request import Request, RequestRejected, RequestStatus
from conveyor.sampling import SamplingParams
from tests.factories import (
    Countdown,
    assert_no_leak,
    create_kvcache,
    create_request,
    create_spec,
    fake_step,
    next_token,
    ran,
    run_to_completion,
)


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


def test_a_stop_token_among_accepted_drafts_caches_only_the_requests_own_blocks():
    """Speculative decoding: seven drafts accepted, the first of them a stop token. The request ends with that
    token, and the prefix cache then holds exactly the full blocks of its own tokens (digests computed here), not
    blocks reaching into the drafts after the stop."""
    scheduler = create_scheduler(block_size=4)
    request = Request("r", list(range(1, 8)), SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[99]), 256)
    scheduler.add(request)
    ran(scheduler, scheduler.schedule(), [50])
    drafts = [99, 51, 52, 53, 54, 55, 56]
    request.draft_token_ids = list(drafts)
    batch = scheduler.schedule()
    assert batch.num_tokens == [1 + len(drafts)]
    (output,) = ran(scheduler, batch, [57], accepted=[drafts])
    assert output.finish_reason == "stop" and output.new_token_ids == [99]
    tokens = [*range(1, 8), 50, 99]
    digests, parent = set(), b""
    for start in range(0, len(tokens) - len(tokens) % 4, 4):
        parent = block_digest(parent, tokens[start : start + 4])
        digests.add(parent)
    assert set(scheduler.kvcache.cached) == digests
    assert_no_leak(scheduler.kvcache)


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
    finished, preempted_steps = [], 0
    while scheduler.has_unfinished():
        running = list(scheduler.running)
        _, outputs = fake_step(scheduler)
        finished += [o.request_id for o in outputs if o.finish_reason]
        victims = {r for r in running if r.status == RequestStatus.PREEMPTED}
        if victims:
            preempted_steps += 1
            # the newest admitted go first: the victims are the last ones of the running list
            assert victims == set(running[len(running) - len(victims):])
    assert preempted_steps >= 1
    assert sorted(finished) == sorted(r.request_id for r in requests)
    assert scheduler.stats().num_preemptions >= preempted_steps
    assert all(len(r.output_token_ids) == 8 for r in requests)
    assert_no_leak(scheduler.kvcache)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_and_resumption_produce_the_same_tokens(prefix_caching):
    def outputs(num_blocks: int):
        kvcache = create_kvcache(num_blocks, 4)
        kvcache.options.enable_prefix_caching = prefix_caching
        scheduler = ContinuousScheduler(ContinuousOptions(max_num_batched_tokens=16), kvcache, 256)
        requests = [create_request(5 + 3 * i, max_tokens=12 + i, request_id=f"p{i}") for i in range(6)]
        for r in requests:
            scheduler.add(r)
        run_to_completion(scheduler)
        assert_no_leak(kvcache)
        return {r.request_id: r.output_token_ids for r in requests}, scheduler.stats().num_preemptions

    roomy, no_preemptions = outputs(200)
    tight, preemptions = outputs(12)
    assert no_preemptions == 0 and preemptions > 0
    assert tight == roomy


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


def test_static_batches_wait_for_a_full_batch_and_nobody_joins():
    kvcache = create_kvcache()
    scheduler = StaticScheduler(StaticOptions(batch_size=3, max_wait_ms=1000), kvcache, 256)
    now = [0.0]
    scheduler.clock = lambda: now[0]
    first = [create_request(4, max_tokens=m) for m in (2, 5, 3)]
    for r in first[:2]:
        scheduler.add(r)
    assert len(scheduler.schedule()) == 0  # 2 of 3, and nobody waited a second yet
    scheduler.add(first[2])
    batch, _ = fake_step(scheduler)
    assert set(batch.requests) == set(first)
    late = create_request(4, max_tokens=2)
    scheduler.add(late)
    steps = 0
    while not all(r.is_finished for r in first):
        batch, _ = fake_step(scheduler)
        assert late not in batch.requests
        steps += 1
    # max_tokens 2, 5, 3: after the prefill step, decode steps run 3, 2, 1 and 1 requests in 3 slots
    assert steps == 4
    assert scheduler.stats().num_wasted_slots == 0 + 1 + 2 + 2
    assert len(scheduler.schedule()) == 0  # `late` waits for two more, or for max_wait
    now[0] = 1.5
    batch, _ = fake_step(scheduler)
    assert batch.requests == [late]


def test_dynamic_batches_close_after_the_window():
    scheduler = DynamicScheduler(DynamicOptions(max_batch_size=8, window_ms=50), create_kvcache(), 256)
    now = [10.0]
    scheduler.clock = lambda: now[0]
    a, b = create_request(3, max_tokens=4), create_request(6, max_tokens=1)
    scheduler.add(a)
    now[0] += 0.03
    scheduler.add(b)
    assert len(scheduler.schedule()) == 0  # the window opened by `a` is still open
    now[0] += 0.03
    batch, _ = fake_step(scheduler)
    assert set(batch.requests) == {a, b}
    c = create_request(3)
    scheduler.add(c)
    now[0] += 1.0
    while not a.is_finished:
        batch, _ = fake_step(scheduler)
        assert c not in batch.requests
    # the batch had two slots; `b` finished at the prefill and left its slot idle for 3 steps
    assert scheduler.stats().num_wasted_slots == 3
    batch, _ = fake_step(scheduler)
    assert batch.requests == [c]


def test_static_batch_only_takes_what_fits_together():
    kvcache = create_kvcache(num_blocks=10, block_size=4)  # 40 tokens
    scheduler = StaticScheduler(StaticOptions(batch_size=4, max_wait_ms=0), kvcache, 256)
    requests = [create_request(8, max_tokens=8) for _ in range(4)]  # 16 tokens = 4 blocks each
    for r in requests:
        scheduler.add(r)
    batch, _ = fake_step(scheduler)
    assert len(batch) == 2
    run_to_completion(scheduler)
    assert all(len(r.output_token_ids) == 8 for r in requests)
    assert_no_leak(kvcache)


def build(kind: str, kv: str, num_blocks: int, budget: int):
    kvcache = (
        create_kvcache(num_blocks, 4)
        if kv == "paged"
        else ContiguousKVCache(ContiguousOptions(num_tokens=num_blocks * 4, reserve="request"), create_spec())
    )
    if kind == "static":
        return StaticScheduler(StaticOptions(batch_size=3, max_wait_ms=0, max_num_batched_tokens=budget), kvcache, 256)
    if kind == "dynamic":
        return DynamicScheduler(DynamicOptions(max_batch_size=4, window_ms=0, max_num_batched_tokens=budget), kvcache, 256)
    policy = "priority" if kind == "priority" else "fcfs"
    return ContinuousScheduler(
        ContinuousOptions(max_num_batched_tokens=budget, max_num_seqs=5, policy=policy, max_waiting=6), kvcache, 256
    )


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["continuous", "priority", "static", "dynamic"]),
    kv=st.sampled_from(["paged", "contiguous"]),
    events=st.lists(
        st.one_of(
            st.tuples(st.just("add"), st.integers(1, 60), st.integers(1, 10), st.integers(0, 3), st.booleans()),
            st.tuples(st.just("abort"), st.integers(0, 30)),
            st.tuples(st.just("step"), st.integers(1, 4)),
        ),
        max_size=40,
    ),
    num_blocks=st.integers(8, 40),
    budget=st.integers(1, 64),
)
def test_random_arrivals_and_aborts_always_end_and_never_leak(kind, kv, events, num_blocks, budget):
    """Every request ends (stop/length/abort) or is rejected, exactly when the layout's capacity (counted here)
    cannot hold it (400) or the queue (waiting, or held at a gate) is full (429), with that reason; a gate
    holds the requests of priority 2 and 3 for three steps and refuses those of priority 3 (they end with an
    error); all memory comes back."""
    scheduler = build(kind, kv, num_blocks, budget)
    gate = Countdown(RequestStatus.WAITING_FOR_GRAMMAR, lambda r: r.priority >= 2, steps=3,
                     refuse=lambda r: r.priority == 3)
    scheduler.add_gate(gate)
    # the whole cache in tokens: blocks of 4 (paged); slabs of 16-token granules over num_blocks x 4 tokens
    capacity = 4 * num_blocks if kv == "paged" else 16 * -(-num_blocks * 4 // 16)
    granule = 4 if kv == "paged" else 16
    max_waiting = 6 if kind in ("continuous", "priority") else 1024
    shared = list(range(500, 520))  # a common prefix, for the prefix cache
    added, rejected, ended = [], {}, {}

    def step():
        batch, outputs = fake_step(scheduler)
        assert batch.total_tokens <= budget
        for o in outputs:
            if o.finish_reason:
                assert o.request_id not in ended
                ended[o.request_id] = o.finish_reason

    for event in events:
        if event[0] == "add":
            _, length, max_tokens, priority, share = event
            request = create_request(length, max_tokens=max_tokens, priority=priority)
            if share:
                request.prompt_token_ids = (shared + request.prompt_token_ids)[:length]
            needed = length + max_tokens  # (max_model_len 256 is never the limit here)
            queued = sum(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED, gate.status) for r in added)
            if -(-needed // granule) * granule > capacity:
                expected = (400, f"the request needs {needed} tokens of KV cache but the whole cache holds {capacity}")
            elif queued >= max_waiting:
                expected = (429, f"the waiting queue is full (max_waiting={max_waiting})")
            else:
                expected = None
            try:
                scheduler.add(request)
                added.append(request)
                assert expected is None, f"admitted, expected {expected}"
            except RequestRejected as e:
                assert (e.status, str(e)) == expected
                rejected[request.request_id] = str(e)
        elif event[0] == "abort" and added:
            victim = added[event[1] % len(added)]
            for o in scheduler.abort([victim.request_id]):
                assert o.finish_reason == "abort"
                ended[o.request_id] = "abort"
        else:
            for _ in range(event[1]):
                step()
    for _ in range(5_000):
        if not scheduler.has_unfinished():
            break
        step()
    assert not scheduler.has_unfinished() and not gate.left
    for request in added:
        reason = ended[request.request_id]
        assert reason in ("stop", "length", "abort", "error")
        if request.priority == 3:  # refused at the gate, or aborted before; it never ran
            assert reason in ("error", "abort") and not request.output_token_ids and request.num_computed_tokens == 0
        else:
            assert reason != "error"
        assert request.request_id in gate.forgotten
        if ended[request.request_id] == "length":
            assert len(request.output_token_ids) == request.params.max_tokens
    assert_no_leak(scheduler.kvcache)


def test_pipelined_batches_share_the_requests_and_never_preempt_one_in_flight():
    """Two batches in flight (pipeline parallelism): disjoint, about half the requests each; when memory
    runs out, a request in flight is not preempted (the one asking waits); the results equal one at a time."""
    scheduler = create_scheduler(num_blocks=12, block_size=4, max_num_batched_tokens=64)
    scheduler.overlap(pipeline_depth=2, async_steps=False)
    requests = [create_request(6, max_tokens=12) for _ in range(4)]
    for request in requests:
        scheduler.add(request)
    in_flight = []
    finished = []
    for _ in range(400):
        if not scheduler.has_unfinished():
            break
        while len(in_flight) < 2:
            batch = scheduler.schedule()
            if not batch.requests:
                break
            assert not any(r.in_flight for r in batch.requests), "a request in two batches at once"
            assert len(batch) <= 2
            scheduler.submitted(batch)
            in_flight.append(batch)
        assert all(r.status == RequestStatus.RUNNING for b in in_flight for r in b.requests), "in flight, preempted"
        batch = in_flight.pop(0)
        sampled = [tokens_of(r, n) for r, n in zip(batch.requests, batch.num_tokens)]
        output = RunnerOutput(sampled, [None] * len(batch))
        finished += [o.request_id for o in scheduler.update(batch, output) if o.finish_reason]
    assert sorted(finished) == sorted(r.request_id for r in requests)
    assert scheduler.stats().num_preemptions > 0  # 4 x 18 tokens do not fit in 12 blocks of 4: memory ran out
    reference = create_scheduler(num_blocks=64, block_size=4)
    alone = [create_request(6, max_tokens=12) for _ in range(4)]
    for request in alone:
        reference.add(request)
    run_to_completion(reference)
    assert [r.output_token_ids for r in requests] == [r.output_token_ids for r in alone]
    assert_no_leak(scheduler.kvcache)


def tokens_of(request, n: int) -> int | None:
    return next_token(request) if request.num_computed_tokens + n == request.num_tokens else None
