"""The runner's input buffers (``conveyor.worker.inputs``) and the sampler's parameter buffers, against the
inputs written out token by token in Python: over random steps one after another in the same buffers (so that
what a longer step left behind is there), with growth past their first size, and every token as a decode."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.attention.backend import DecodeTables, PrefillTables
from conveyor.messages import ScheduledRequest, StepInput
from conveyor.sampling import SamplingParams
from conveyor.worker.inputs import InputBuffers
from conveyor.worker.sampler import SamplingBuffers

BLOCK = 4
CPU = torch.device("cpu")


class Recorder:
    """A backend stand-in that keeps the plans it is given."""

    prefills_as_decodes = False
    storage = None

    def plan_decodes(self, tables):
        return tables

    def plan_prefills(self, tables):
        return tables


@st.composite
def steps(draw):
    """A step: decodes (one token) first, then prompt chunks, each with its own blocks (ids from a pool of 40)."""
    num_decodes = draw(st.integers(0, 5))
    num_chunks = draw(st.integers(0 if num_decodes else 1, 4))
    requests = []
    for i in range(num_decodes + num_chunks):
        start = draw(st.integers(0, 30))
        n = 1 if i < num_decodes else draw(st.integers(1, 12))
        table = draw(st.lists(st.integers(0, 39), min_size=-(-(start + n) // BLOCK), max_size=-(-(start + n) // BLOCK) + 2))
        tokens = draw(st.lists(st.integers(0, 1000), min_size=n, max_size=n))
        requests.append(ScheduledRequest(f"r{i}", start, tokens, table, SamplingParams()))
    return StepInput(requests, num_decodes)


def expected(step: StepInput, every_token: bool):
    ids, positions, slots, tables, context = [], [], [], [], []
    for r in step.requests:
        for j, token in enumerate(r.token_ids):
            p = r.start + j
            ids.append(token)
            positions.append(p)
            slots.append(r.block_ids[p // BLOCK] * BLOCK + p % BLOCK)
            if every_token:
                tables.append(r.block_ids)
                context.append(p + 1)
        if not every_token:
            tables.append(r.block_ids)
            context.append(r.start + len(r.token_ids))
    return ids, positions, slots, tables, context


def assert_tables(plan_tables: torch.Tensor, tables: list[list[int]], context: list[int]) -> None:
    """Each row's blocks that its context reaches are its own (what lies past them is any block of the pool)."""
    assert plan_tables.is_contiguous() and plan_tables.dtype == torch.int32
    for row, table, keys in zip(plan_tables.tolist(), tables, context):
        blocks = -(-keys // BLOCK)
        assert row[:blocks] == table[:blocks]


@settings(max_examples=150, deadline=None)
@given(st.lists(steps(), min_size=1, max_size=5), st.booleans())
def test_each_step_reads_its_own_inputs_from_the_buffers(sequence, every_token):
    buffers = InputBuffers(BLOCK, CPU, tokens=4, rows=2, width=2)
    backend = Recorder()
    backend.prefills_as_decodes = every_token
    for step in sequence:
        ids, positions, slots, tables, context = expected(step, every_token)
        inputs = buffers.prepare(step, backend)
        assert inputs.input_ids.tolist() == ids
        assert inputs.positions.tolist() == positions
        attention = inputs.attention
        assert attention.slot_mapping.tolist() == slots
        decodes = len(ids) if every_token else step.num_decodes
        plan = attention.decode_plan
        assert (plan is None) == (decodes == 0)
        if plan is not None:
            assert isinstance(plan, DecodeTables) and plan.context_lens.tolist() == context[:decodes]
            assert_tables(plan.tables, tables[:decodes], context[:decodes])
        chunks = step.requests[step.num_decodes :]
        prefill = attention.prefill_plan
        assert (prefill is None) == (every_token or not chunks)
        if prefill is not None:
            assert isinstance(prefill, PrefillTables)
            lens = [len(r.token_ids) for r in chunks]
            assert prefill.lens.tolist() == lens and prefill.starts.tolist() == [r.start for r in chunks]
            assert prefill.rows.tolist() == [step.num_decodes + sum(lens[:i]) for i in range(len(lens))]
            assert prefill.max_len == max(lens)
            assert_tables(prefill.tables, tables[step.num_decodes :], context[step.num_decodes :])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(st.sampled_from([0.5, 1.0, 1.5]), st.sampled_from([0, 1, 40]),
                                                    st.sampled_from([0.25, 0.9, 1.0]), st.sampled_from([0.0, 0.125])),
                         min_size=1, max_size=80), min_size=1, max_size=3))
def test_the_sampled_rows_parameters_come_back_as_tensors(sequence):
    """Each filter is a tensor of the rows' values where a row uses it and None where none does, step after
    step in the same buffers (the second step of 80 rows grows them)."""
    buffers = SamplingBuffers(CPU, rows=8)
    for rows in sequence:
        params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in rows]
        tensors = buffers.tensors(params)
        for got, values, unused in [
            (tensors.temperature, [p.temperature for p in params], 1.0),
            (tensors.top_k, [p.top_k for p in params], 0),
            (tensors.top_p, [p.top_p for p in params], 1.0),
            (tensors.min_p, [p.min_p for p in params], 0.0),
        ]:
            if all(v == unused for v in values):
                assert got is None
            else:
                assert got.flatten().tolist() == torch.tensor(values, dtype=got.dtype).tolist()
