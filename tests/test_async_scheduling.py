"""Async scheduling (``[engine] async_scheduling``): while the worker runs step N the engine schedules step N+1,
whose input for a decoding request is the token step N samples (the worker feeds it in). Against the same
engine with it off: the same tokens and logprobs, bit for bit in batch-invariant mode, for 64 mixed requests
with stop strings, a JSON schema, penalties, prompt logprobs, prompts in chunks and preemption; for n-gram
drafts; and for requests aborted while their steps are in flight, with every KV block free after."""

from __future__ import annotations

import json
import random

import pytest

from conveyor import LLM
from conveyor.config import ConfigError, load_config
from conveyor.engine.core import EngineCore
from conveyor.messages import EngineRequest
from conveyor.sampling import SamplingParams, StructuredOutput
from tests.conftest import CHAT_PROMPTS
from tests.helpers import assert_same_or_near_tie
from tests.test_batch_invariant import PROMPTS, assert_identical, workload
from tests.test_parallel import tiny_llama  # noqa: F401 - a fixture

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "population": {"type": "integer"}},
        "required": ["city", "population"], "additionalProperties": False}


class Follows:
    """Counts the step entries whose input the worker fed in itself (what async scheduling adds)."""

    def __init__(self, engine: EngineCore):
        self.count = 0
        submit = engine.executor.submit

        def counted(step):
            self.count += sum(entry.follows for entry in step.requests)
            submit(step)

        engine.executor.submit = counted


def run(mode: str, overrides: dict, requests: list) -> tuple[list, int, bool]:
    """The requests at once; their completions, the entries that followed a step in flight, and whether every
    KV block was free after (``run.counters``: the scheduler's counters)."""
    with LLM(overrides={"engine.async_scheduling": mode, **overrides}) as llm:
        assert llm.engine.async_scheduling == (mode == "on")
        follows = Follows(llm.engine)
        completions = llm.generate([prompt for prompt, _ in requests], [params for _, params in requests])
        kv = llm.engine.kvcache
        run.counters = llm.engine.scheduler.counters
        return completions, follows.count, kv.num_free_blocks == kv.num_blocks


def test_64_mixed_requests_are_bit_identical_with_steps_overlapped():
    """The fidelity prompts and the batch-invariance workload (greedy and seeded, logprobs, prompt logprobs; fillers
    with stop strings), a JSON schema and a repetition penalty, 64 requests in steps of at most 64 tokens on a KV
    cache too small for all: every token and logprob of the greedy and seeded requests equal with async
    scheduling on and off; a good share of the steps' entries followed a step in flight; the schema's reply
    parses."""
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    fidelity = [([{"role": "user", "content": p}], SamplingParams(max_tokens=12, temperature=0, logprobs=2))
                for p in CHAT_PROMPTS]
    special = [
        ([{"role": "user", "content": "Give an example of a city as JSON."}],
         SamplingParams(max_tokens=40, temperature=0, logprobs=1, structured=StructuredOutput(json=json.dumps(CITY)))),
        ([{"role": "user", "content": "List fruits, many times."}],
         SamplingParams(max_tokens=24, temperature=0, logprobs=1, repetition_penalty=1.3)),
    ]
    requests = fidelity + special
    requests += workload(chats, 8, 64 - len(requests), chats)
    overrides = {"engine.batch_invariant": True, "scheduler.max_num_batched_tokens": 64, "kvcache.num_blocks": 32}
    sync, none, sync_free = run("off", overrides, requests)
    overlapped, follows, overlapped_free = run("on", overrides, requests)
    assert none == 0 and follows > sum(p.max_tokens for _, p in requests) / 4
    assert sync_free and overlapped_free
    # (the fillers sample without a seed of their own: from the engine's generator, in the order steps draw)
    watched = [i for i, (_, p) in enumerate(requests) if p.temperature == 0 or p.seed is not None]
    assert len(watched) > 40
    assert_identical([sync[i] for i in watched], [overlapped[i] for i in watched])
    assert [sync[i].finish_reason for i in watched] == [overlapped[i].finish_reason for i in watched]
    assert [sync[i].text for i in watched] == [overlapped[i].text for i in watched]
    json.loads(overlapped[len(fidelity)].text)


def test_ngram_drafts_give_the_same_tokens_with_steps_overlapped():
    """Speculative decoding (n-gram) with async scheduling: a request whose step checks drafts is not followed,
    and one with drafts proposed while its next step was in flight waits for that step (its drafts go in the
    one after): drafts are still checked and accepted, and the greedy tokens equal those with it off (up to a near
    tie)."""
    rng = random.Random(3)
    text = "The cat sat on the mat. The dog sat on the log. "
    requests = [([{"role": "user", "content": f"Repeat this {rng.randint(2, 4)} times: {text * rng.randint(1, 3)}"}],
                 SamplingParams(max_tokens=rng.randint(10, 40), temperature=0, logprobs=5, ignore_eos=True))
                for _ in range(12)]
    overrides = {"engine.speculative": "ngram", "model.dtype": "float32"}
    sync, _, sync_free = run("off", overrides, requests)
    overlapped, follows, overlapped_free = run("on", overrides, requests)
    assert follows > 0 and sync_free and overlapped_free
    assert run.counters.num_accepted_tokens > 0
    # (without batch invariance, which n-gram drafts cannot run under, steps of other shapes may flip a near tie;
    # in float32 that is all they can flip)
    for i, (a, b) in enumerate(zip(sync, overlapped)):
        assert_same_or_near_tie(a, b, f"request {i}")


def engine_run(mode: str, aborted: set[str], abort_at: int) -> tuple[dict[str, list[int]], dict[str, str], bool]:
    """24 requests through the engine core itself; ``aborted`` ended at step ``abort_at`` (steps in flight under
    async scheduling). Returns each request's tokens and finish reason, and whether every KV block was free."""
    config = load_config(None, {"engine.async_scheduling": mode, "engine.batch_invariant": True,
                                "scheduler.max_num_batched_tokens": 64, "kvcache.num_blocks": 24})
    engine = EngineCore(config)
    try:
        rng = random.Random(5)
        for i in range(24):
            prompt = [rng.randrange(100, 20_000) for _ in range(rng.randint(5, 90))]
            length = 60 if f"r{i}" in aborted else rng.randint(4, 30)
            params = SamplingParams(max_tokens=length, temperature=0, ignore_eos=True)
            engine.add_request(EngineRequest(f"r{i}", prompt, params))
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(24)}
        reasons: dict[str, str] = {}
        steps = 0
        while engine.has_unfinished():
            steps += 1
            outputs, _ = engine.step()
            if steps == abort_at:
                outputs += engine.abort(sorted(aborted))
            for output in outputs:
                tokens[output.request_id] += output.new_token_ids
                if output.finish_reason:
                    reasons[output.request_id] = output.finish_reason
        kv = engine.kvcache
        return tokens, reasons, kv.num_free_blocks == kv.num_blocks
    finally:
        engine.shutdown()


@pytest.mark.parametrize("abort_at", [4, 30])
def test_requests_aborted_while_steps_are_in_flight_end_and_the_rest_are_unchanged(abort_at):
    """Six of 24 requests aborted mid-way (prompt chunks and decodes in flight; preemption on a small cache):
    they end as aborts, the others give the tokens they give with async scheduling off, and no block leaks."""
    aborted = {f"r{i}" for i in (0, 3, 7, 11, 16, 22)}
    sync, sync_reasons, sync_free = engine_run("off", aborted, abort_at)
    overlapped, reasons, free = engine_run("on", aborted, abort_at)
    assert sync_free and free
    for ends in (sync_reasons, reasons):
        assert {r for r, why in ends.items() if why == "abort"} == aborted
        assert len(ends) == 24
    for request_id in sync:
        if request_id not in aborted:
            assert overlapped[request_id] == sync[request_id], request_id


def test_a_failed_step_fails_its_own_requests_not_those_of_the_step_in_flight_after_it(tiny_llama):  # noqa: F811
    """The worker raises on the step holding request "bad"'s last prompt chunk while the next step (scheduled
    meanwhile) takes "bad"'s sampled token and starts "late": "bad" and the other request of the failed step end
    with its error, "late" gives the tokens it gives alone, and no block leaks. (The next step fed "bad" the -1 of
    a token never sampled, and its embedding failed it, "late" too.)"""
    overrides = {"model.path": str(tiny_llama), "model.dtype": "float32", "model.max_model_len": 128,
                 "kvcache.memory_gb": 0.05, "scheduler.max_num_batched_tokens": 20, "engine.async_scheduling": "on"}
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with LLM(overrides=overrides) as llm:
        (alone,) = llm.generate([list(range(30, 35))], params)
        engine = llm.engine
        runner = engine.executor.worker.runner
        execute, failed = runner.execute, []

        def fail_once(step):
            if any(e.request_id == "bad" for e in step.requests) and not failed:
                failed.append([e.request_id for e in step.requests])
                raise ValueError("injected failure")
            return execute(step)

        runner.execute = fail_once
        for request_id, prompt in (("bad", range(10, 20)), ("good", range(20, 30)), ("late", range(30, 35))):
            engine.add_request(EngineRequest(request_id, list(prompt), params))
        ends, tokens = {}, {}
        for _ in range(50):
            if not engine.has_unfinished():
                break
            outputs, _ = engine.step()
            for output in outputs:
                tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
                if output.finish_reason:
                    ends[output.request_id] = (output.finish_reason, output.error)
        assert failed == [["bad", "good"]]
        assert ends["bad"][0] == ends["good"][0] == "error" and "injected failure" in ends["bad"][1]
        assert ends["late"] == ("length", None) and tokens["late"] == alone.token_ids
        assert engine.kvcache.num_free_blocks == engine.kvcache.num_blocks


def test_async_scheduling_on_with_pipeline_stages_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size = 2 cannot run with \[engine\] async_scheduling"):
        load_config(None, {"engine.async_scheduling": "on", "parallel.pipeline_parallel_size": 2})
    assert load_config(None, {"engine.async_scheduling": "on", "parallel.tensor_parallel_size": 2})
    assert load_config(None, {"parallel.pipeline_parallel_size": 2}).engine.async_scheduling == "auto"


@pytest.mark.slow
def test_tensor_parallel_workers_take_the_tokens_their_driver_fed_in(tiny_llama):  # noqa: F811
    """TP=2 over the mp executor: with steps overlapped, the driver's sampled tokens reach its peer (a rank that
    took its own stale token would embed another input and the two halves of every matmul would disagree):
    greedy tokens and logprobs equal those with async scheduling off, with prompts in chunks and most decode
    entries following a step in flight."""
    prompts = [[5, 17, 3, 88, 41, 2, 9, 60, 1, 33], [60, 1, 33, 97], [7] * 12, list(range(40, 70))]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3)
    results = {}
    for mode in ("off", "on"):
        overrides = {"model.path": str(tiny_llama), "model.dtype": "float32", "model.max_model_len": 128,
                     "parallel.tensor_parallel_size": 2, "kvcache.memory_gb": 0.05,
                     "scheduler.max_num_batched_tokens": 16, "engine.async_scheduling": mode}
        with LLM(overrides=overrides) as llm:
            assert llm.engine.async_scheduling == (mode == "on")
            follows = Follows(llm.engine)
            results[mode] = (llm.generate(prompts, params), follows.count)
    (sync, _), (overlapped, count) = results["off"], results["on"]
    assert count >= len(prompts) * params.max_tokens // 2
    for a, b in zip(overlapped, sync):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.top_ids == y.top_ids
            assert x.top_logprobs == pytest.approx(y.top_logprobs, abs=1e-4)
