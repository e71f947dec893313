"""A step sends the workers only what changed of each request (conveyor.engine.deltas): through the msgpack encoding
the mp and Ray executors use, a worker's rows (conveyor.worker.rows) hold every request whole, whatever happened
to it between steps (tables grown, replaced after a preemption or changed at the front behind a sliding window,
outputs grown under penalties, requests ended and their ids used again)."""

from __future__ import annotations

import copy

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.engine.deltas import SentRequests
from conveyor.messages import ScheduledRequest, StepInput
from conveyor.request import Request
from conveyor.sampling import SamplingParams
from conveyor.worker.rows import BatchRows


def make_request(request_id: str, prompt_len: int, penalties: bool) -> Request:
    params = SamplingParams(max_tokens=500, repetition_penalty=1.3 if penalties else 1.0, temperature=0.5,
                            seed=len(request_id))
    return Request(request_id, list(range(3, 3 + prompt_len)), params, 10_000)


def whole(request: Request, table: list[int], sample: bool) -> ScheduledRequest:
    """The entry as it was before deltas: everything, every step."""
    entry = ScheduledRequest(request.request_id, request.num_tokens - 1, [request.all_token_ids()[-1]], list(table),
                             request.params, sample=sample)
    if sample and request.params.has_penalties:
        entry.prompt_token_ids, entry.output_token_ids = list(request.prompt_token_ids), list(request.output_token_ids)
    return entry


def send(sent: SentRequests, held: BatchRows, steps: list[tuple[Request, list[int], bool]],
         finished: list[str]) -> tuple[StepInput, int]:
    """One step from the engine's side to a worker's, through msgpack; what the worker sees, each entry with
    its whole table from the worker's rows, and the bytes."""
    sent.forget(finished)
    entries = []
    for request, table, sample in steps:
        entry = ScheduledRequest(request.request_id, request.num_tokens - 1, [request.all_token_ids()[-1]],
                                 sample=sample)
        sent.fill(entry, request, table, sample and request.params.has_penalties)
        entries.append(entry)
    data = msgspec.msgpack.encode(StepInput(entries, len(entries), finished))
    step = msgspec.msgpack.decode(data, type=StepInput)
    held.apply(step)
    for entry in step.requests:
        entry.block_ids, entry.block_offset = held.table(entry), 0
    return step, len(data)


events = st.lists(
    st.tuples(
        st.integers(0, 5),  # which request
        st.sampled_from(["grow", "grow", "grow", "preempt", "slide", "finish", "skip"]),
        st.booleans(),  # samples this step
    ),
    min_size=1, max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(events=events, penalties=st.lists(st.booleans(), min_size=6, max_size=6))
def test_every_worker_entry_equals_the_whole_entry(events, penalties):
    sent, held = SentRequests(), BatchRows(rows=2, width=1)
    requests: dict[int, Request] = {}
    tables: dict[int, list[int]] = {}
    generation = [0] * 6
    on_workers: set[int] = set()
    next_block = iter(range(10**6))
    for index, what, sample in events:
        finished = []
        if index not in requests:
            requests[index] = make_request(f"r{index}", 5 + index, penalties[index])
            tables[index] = [next(next_block) for _ in range(1 + index % 3)]
        request, table = requests[index], tables[index]
        if what == "grow":
            table.append(next(next_block))
            request.output_token_ids.append(7 + len(request.output_token_ids) % 11)
        elif what == "preempt":  # a new table; sometimes the prefix cache gives back its first block
            tables[index] = table = table[:1] * (len(table) % 2) + [next(next_block) for _ in range(2)]
        elif what == "slide":  # the leading block falls behind the window: the spare block stands in for it
            table[0] = -1
        elif what == "finish":  # it ends; the same id comes back at once with another prompt
            finished.append(request.request_id)
            generation[index] += 1
            requests[index] = make_request(request.request_id, 4 + generation[index], not penalties[index])
            tables[index] = table = [next(next_block)]
            request = requests[index]
        expected = [whole(request, table, sample)]
        steps = [(request, table, sample)]
        if what == "skip":  # a step without it: what the workers hold stays
            continue
        step, _ = send(sent, held, steps, finished)
        assert step.requests == expected
        on_workers.add(index)
    assert len(held) == len(sent) == len(on_workers)  # (one each: an ended request is forgotten on both sides)


def test_a_decode_costs_the_same_bytes_at_any_context_length():
    """64 decodes: after the first step, a step's message does not grow with the requests' contexts (their
    tables and parameters stay on the workers), where sending everything grows with them: at 1,000-token
    contexts (63 blocks of 16) it is more than 10x smaller."""
    sizes, whole_sizes = [], []
    for context_blocks in (4, 63, 500):
        sent, held = SentRequests(), BatchRows()
        requests = [make_request(f"q{i}", 16 * context_blocks, True) for i in range(64)]
        tables = [[1000 * i + b for b in range(context_blocks)] for i in range(64)]
        send(sent, held, [(r, t, True) for r, t in zip(requests, tables)], [])
        for r in requests:
            r.output_token_ids.append(9)
        _, size = send(sent, held, [(r, t, True) for r, t in zip(requests, tables)], [])
        sizes.append(size)
        everything = StepInput([whole(r, t, True) for r, t in zip(requests, tables)], 64)
        whole_sizes.append(len(msgspec.msgpack.encode(everything)))
    # (only the widths of two integers grow: the position and the table's length, 1 to 3 bytes each in msgpack)
    assert max(sizes) - min(sizes) <= 64 * 4, sizes
    assert whole_sizes[0] < whole_sizes[1] < whole_sizes[2], whole_sizes
    assert sizes[1] * 10 < whole_sizes[1], (sizes, whole_sizes)


def test_a_worker_that_does_not_hold_a_request_says_so():
    step = StepInput([ScheduledRequest("stranger", 4, [1], [2])], 1)
    try:
        BatchRows().apply(copy.deepcopy(step))
    except KeyError as e:
        assert "stranger" in str(e)
    else:
        raise AssertionError("an entry without parameters for an unknown request was taken")
