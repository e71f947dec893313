"""Admission gates: requests the scheduler holds before they may run (an adapter loading, a grammar compiling).

The scheduler keeps a held request among its ``requests``: the one id check and the one abort path see it,
the queue bound counts it, and it runs only once every gate let it go.
"""

from __future__ import annotations

import pytest

from conveyor.request import RequestRejected, RequestStatus
from tests.factories import Countdown, assert_no_leak, create_request, fake_step, run_to_completion
from tests.test_scheduler import create_scheduler


def test_a_held_request_waits_its_turn_then_runs_to_the_end():
    scheduler = create_scheduler()
    gate = Countdown(RequestStatus.WAITING_FOR_GRAMMAR, lambda r: r.request_id == "held", steps=3)
    scheduler.add_gate(gate)
    held, free = create_request(5, request_id="held"), create_request(5, request_id="free")
    scheduler.add(held)
    scheduler.add(free)
    assert held.status == RequestStatus.WAITING_FOR_GRAMMAR and free.status == RequestStatus.WAITING
    assert scheduler.stats().num_waiting == 2
    for _ in range(2):  # the gate holds it for two releases: only the other one runs
        batch, _ = fake_step(scheduler)
        assert batch.requests == [free]
    batch, _ = fake_step(scheduler)  # the third release lets it go: it runs in the same step
    assert held in batch.requests and held.status == RequestStatus.RUNNING
    run_to_completion(scheduler)
    assert len(held.output_token_ids) == 4 and held.is_finished
    assert gate.forgotten.count("held") == 1  # told once, as it ended
    assert_no_leak(scheduler.kvcache)


def test_the_queue_bound_counts_held_requests():
    scheduler = create_scheduler(max_waiting=3)
    scheduler.add_gate(Countdown(RequestStatus.WAITING_FOR_ADAPTER, lambda r: r.request_id in ("h1", "h2")))
    for request_id in ("h1", "h2", "w"):
        scheduler.add(create_request(4, request_id=request_id))
    with pytest.raises(RequestRejected, match=r"the waiting queue is full \(max_waiting=3\)") as e:
        scheduler.add(create_request(4))
    assert e.value.status == 429


def test_an_abort_ends_a_held_request_and_tells_its_gate():
    scheduler = create_scheduler()
    gate = Countdown(RequestStatus.WAITING_FOR_ADAPTER, lambda r: r.request_id == "a", steps=100)
    scheduler.add_gate(gate)
    request = create_request(4, request_id="a")
    scheduler.add(request)
    fake_step(scheduler)
    [output] = scheduler.abort(["a"])
    assert (output.request_id, output.finish_reason, output.num_prompt_tokens) == ("a", "abort", 4)
    assert gate.forgotten == ["a"] and not scheduler.has_unfinished()
    assert scheduler.stats().num_waiting == 0 and scheduler.stats().num_aborted == 1
    assert scheduler.abort(["a"]) == []  # ended once
    assert not fake_step(scheduler)[0].requests


def test_gates_pass_in_order_and_a_refused_request_ends_with_400():
    """A request held by the first gate reaches the second only once the first lets it go, and past the last
    one it gets an empty output (the engine took it: a frontend may send a response's status); a request the
    second refuses ends with its error and the HTTP status 400, counted as rejected."""
    scheduler = create_scheduler()
    first = Countdown(RequestStatus.WAITING_FOR_ADAPTER, lambda r: r.request_id in ("both", "bad"), steps=1)
    second = Countdown(RequestStatus.WAITING_FOR_GRAMMAR, lambda r: r.request_id in ("both", "bad"), steps=2, refuse=lambda r: r.request_id == "bad")
    scheduler.add_gate(first)
    scheduler.add_gate(second)
    both, bad = create_request(4, request_id="both"), create_request(4, request_id="bad")
    scheduler.add(both)
    scheduler.add(bad)
    assert not second.left  # not at the second gate yet
    batch, outputs = fake_step(scheduler)  # the first lets both go; the second holds them (one release)
    assert not batch.requests and not outputs
    assert both.status == bad.status == RequestStatus.WAITING_FOR_GRAMMAR
    batch, outputs = fake_step(scheduler)
    assert batch.requests == [both]
    accepted, refusal = outputs[:2]  # (the gates' outputs come first)
    assert (accepted.request_id, accepted.new_token_ids, accepted.finish_reason, accepted.error) == (
        "both", [], None, None)
    assert (refusal.request_id, refusal.finish_reason, refusal.error, refusal.error_status) == (
        "bad", "error", "bad refused", 400)
    assert bad.is_finished and "bad" not in scheduler.requests
    assert scheduler.stats().num_rejected == 1 and scheduler.stats().num_aborted == 0
    run_to_completion(scheduler)
    assert_no_leak(scheduler.kvcache)


def test_release_tells_the_gates_whether_the_workers_are_idle():
    scheduler = create_scheduler()
    gate = Countdown(RequestStatus.WAITING_FOR_ADAPTER, lambda r: r.request_id == "a", steps=5)
    scheduler.add_gate(gate)
    scheduler.add(create_request(4, request_id="a"))
    scheduler.release(idle=False)
    scheduler.release(idle=True)
    assert gate.idle_seen == [False, True]
    assert not scheduler.wants_idle()  # (the base gate never asks)
