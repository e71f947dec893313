"""A worker's rows (conveyor.worker.rows): a decode step writes into them only its new blocks and new tokens,
the step's inputs gathered from them are those of the whole tables, and a removed request's row goes to the
next request with nothing of the old one (generator, logit bias, pooled sums, table) left in it."""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from conveyor.engine.deltas import SentRequests
from conveyor.messages import ScheduledRequest, StepInput
from conveyor.request import Request
from conveyor.sampling import SamplingParams
from conveyor.worker.inputs import InputBuffers
from conveyor.worker.rows import BatchRows
from conveyor.worker.sampler import Sampler, SamplingBuffers
from tests.test_inputs import CPU, Recorder

BLOCK = 16


def step_of(sent: SentRequests, requests: list[Request], tables: list[list[int]], finished=()) -> StepInput:
    """The engine's next step for ``requests`` (each computing its last token), through msgpack."""
    sent.forget(list(finished))
    entries = []
    for request, table in zip(requests, tables):
        entry = ScheduledRequest(request.request_id, request.num_tokens - 1, [request.all_token_ids()[-1]],
                                 sample=True)
        sent.fill(entry, request, table, request.params.has_penalties)
        entries.append(entry)
    data = msgspec.msgpack.encode(StepInput(entries, len(entries), list(finished)))
    return msgspec.msgpack.decode(data, type=StepInput)


def test_a_decode_step_writes_only_its_new_blocks_and_tokens():
    """64 requests with 1,000-token prompts decode 40 steps under a repetition penalty: after the first step
    each step writes into the rows one token a request and a block for each request whose context crosses into
    a new block (what rewriting the rows whole would write is over 60 blocks a request), and the step's inputs
    gathered from the rows are those of the whole tables."""
    params = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.2, seed=3)
    requests = [Request(f"r{i}", list(range(1, 1001 + i)), params, 4096) for i in range(64)]
    blocks = iter(range(10**6))
    tables = [[next(blocks) for _ in range(-(-r.num_tokens // BLOCK))] for r in requests]
    sent, rows = SentRequests(), BatchRows(rows=8, width=4)
    buffers, whole_buffers = InputBuffers(BLOCK, CPU), InputBuffers(BLOCK, CPU)
    rows.apply(step_of(sent, requests, tables))
    for _ in range(40):
        new_blocks = 0
        for request, table in zip(requests, tables):
            request.output_token_ids.append(request.num_tokens % 97)
            if -(-request.num_tokens // BLOCK) > len(table):
                table.append(next(blocks))
                new_blocks += 1
        step = step_of(sent, requests, tables)
        written_blocks, written_tokens = rows.written_blocks, rows.written_tokens
        rows.apply(step)
        assert rows.written_blocks - written_blocks == new_blocks
        assert rows.written_tokens - written_tokens == len(requests)
        inputs = buffers.prepare(step, Recorder(), rows)
        whole = StepInput([msgspec.structs.replace(e, block_ids=table, block_offset=0)
                           for e, table in zip(step.requests, tables)], step.num_decodes)
        expected = whole_buffers.prepare(whole, Recorder())
        assert torch.equal(inputs.attention.slot_mapping, expected.attention.slot_mapping)
        plan, expected_plan = inputs.attention.decode_plan, expected.attention.decode_plan
        assert torch.equal(plan.context_lens, expected_plan.context_lens)
        for got, table in zip(plan.tables.tolist(), tables):
            assert got[: len(table)] == table
    assert all(entry.output_token_ids == request.output_token_ids for entry, request in zip(step.requests, requests))


def test_a_removed_requests_row_goes_to_the_next_request_with_nothing_of_it_left():
    seeded = SamplingParams(temperature=1.0, seed=5, logit_bias={3: 50.0})
    plain = SamplingParams(temperature=0.5, top_k=4)
    rows = BatchRows()
    sampler = Sampler(rows=rows)
    rows.apply(StepInput([ScheduledRequest("a", 0, [1], [7, 8], seeded, sample=True),
                          ScheduledRequest("b", 0, [1], [9], plain, sample=True)], 2))
    logits = torch.zeros(2, 16)
    sampler.sample(logits.clone(), [ScheduledRequest("a", 1, [2], params=seeded, sample=True),
                                    ScheduledRequest("b", 1, [2], params=plain, sample=True)])
    held = rows.row(ScheduledRequest("a", 1, [2]))
    held.sums = (torch.ones(4), 3)  # (as a "mean" pooling chunk leaves them)
    assert held.generator is not None and held.bias is not None
    index = held.index

    fresh = SamplingParams(temperature=1.0, seed=5)
    step = StepInput([ScheduledRequest("c", 0, [1], [4], fresh, sample=True)], 1, finished_request_ids=["a"])
    rows.apply(step)
    c = rows.row(step.requests[0])
    assert len(rows) == 2 and c.index == index
    assert c.generator is None and c.bias is None and c.sums is None
    assert rows.table(step.requests[0]) == [4]
    assert rows.temperature[index] == 1.0 and rows.top_k[index] == 0
    # c's seeded draw starts its own generator afresh: the same draw as a request of that seed alone
    alone = Sampler().sample(torch.randn(1, 16, generator=torch.Generator().manual_seed(0)),
                             [ScheduledRequest("z", 0, [1], params=fresh, sample=True)])[0]
    ours = sampler.sample(torch.randn(1, 16, generator=torch.Generator().manual_seed(0)), [step.requests[0]])[0]
    assert ours == alone


def test_a_request_id_back_with_other_parameters_gets_a_fresh_row():
    """A sampler on its own (no step applied first) keeps nothing of an earlier request of the same id: not its
    temperature, bias or generator."""
    sampler = Sampler()
    first = SamplingParams(temperature=0.5, seed=1, logit_bias={3: 50.0})
    sampler.sample(torch.zeros(1, 16), [ScheduledRequest("a", 0, [1], params=first, sample=True)])
    held = sampler.rows.row(ScheduledRequest("a", 1, [2], params=first))
    assert held.generator is not None and held.bias is not None
    second = SamplingParams(temperature=1.0, logit_bias={5: 50.0})
    token = sampler.sample(torch.zeros(1, 16), [ScheduledRequest("a", 0, [1], params=second, sample=True)])[0][0]
    assert token == 5  # (the bias of the second request, not the first's)
    again = sampler.rows.row(ScheduledRequest("a", 1, [2], params=second))
    assert again.generator is None and sampler.rows.temperature[again.index] == 1.0


def test_the_sampling_parameters_gathered_by_row_are_those_of_the_requests():
    """Rows' parameters gathered in any order, some rows removed and reused, come back as the parameters of the
    requests in that order would."""
    choices = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
               for t in (0.5, 1.0) for k in (0, 7) for p in (0.9, 1.0) for m in (0.0, 0.1)]
    rng = np.random.default_rng(1)
    rows = BatchRows(rows=4)
    entries = [ScheduledRequest(f"q{i}", 0, [1], [i], choices[i % len(choices)]) for i in range(40)]
    rows.apply(StepInput(entries, len(entries)))
    rows.remove([f"q{i}" for i in range(0, 40, 3)])
    entries = [e for i, e in enumerate(entries) if i % 3] + [
        ScheduledRequest(f"n{i}", 0, [1], [i], choices[-1 - i]) for i in range(10)]
    rows.apply(StepInput(entries[-10:], 10))
    order = [entries[i] for i in rng.permutation(len(entries))]
    gathered = SamplingBuffers(CPU).take(rows, rows.index(order))
    expected = SamplingBuffers(CPU).tensors([e.params for e in order])
    for name in ("temperature", "top_k", "top_p", "min_p"):
        assert torch.equal(getattr(gathered, name), getattr(expected, name)), name
