"""The engine on SmolLM2 at fp32: a busy mixed batch gives the tokens each request gives alone,
whatever the KV layout, chunking or memory pressure; the prefix cache saves prefill work."""

from __future__ import annotations

import random
from contextlib import aclosing

import anyio
import pytest

from conveyor import LLM, SamplingParams
from conveyor.messages import EngineRequest
from tests.helpers import assert_same_or_near_tie

pytestmark = pytest.mark.slow

TOPICS = ["rivers", "volcanoes", "bread", "bicycles", "owls", "glass", "tides", "chess", "copper", "maps", "tea", "moss"]
SENTENCE = "Here is some background about {t}: people have studied {t} for a long time, and there is much to say. "


def mixed_workload(count: int = 32, seed: int = 0):
    """Chat prompts of 30 to ~260 tokens, outputs of 4 to 16 tokens, greedy with top-5 logprobs."""
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(count):
        topic = TOPICS[i % len(TOPICS)]
        background = SENTENCE.format(t=topic) * rng.randint(0, 10)
        prompts.append([{"role": "user", "content": f"{background}Tell me one fact about {topic}."}])
        params.append(SamplingParams(max_tokens=rng.randint(4, 16), temperature=0, logprobs=5))
    return prompts, params


@pytest.fixture(scope="module")
def workload():
    return mixed_workload()


@pytest.fixture(scope="module")
def alone(llm_fp32, workload):
    """Each request of the workload run by itself."""
    prompts, params = workload
    return [llm_fp32.generate([p], [sp])[0] for p, sp in zip(prompts, params)]


def make_llm(**overrides) -> LLM:
    return LLM(overrides={"model.dtype": "float32", "quant.plugin": "none", **overrides})


@pytest.mark.parametrize(
    "label, overrides",
    [
        ("paged, whole prompts", {"scheduler.max_num_batched_tokens": 8192, "kvcache.enable_prefix_caching": False}),
        ("paged, chunked prefill", {"scheduler.max_num_batched_tokens": 64}),
        ("contiguous", {"kvcache.plugin": "contiguous", "kvcache.reserve": "request", "scheduler.max_num_batched_tokens": 256}),
        ("paged, preempting", {"kvcache.num_blocks": 60, "kvcache.block_size": 16, "scheduler.max_num_batched_tokens": 256}),
        # batches larger than the workload: the engine waits while they collect, then runs them to completion
        ("static batch", {"scheduler.plugin": "static", "scheduler.batch_size": 64, "scheduler.max_wait_ms": 300}),
        ("dynamic batch", {"scheduler.plugin": "dynamic", "scheduler.max_batch_size": 64, "scheduler.window_ms": 50}),
    ],
)
def test_busy_batch_gives_the_same_tokens_as_alone(workload, alone, label, overrides):
    prompts, params = workload
    llm = make_llm(**overrides)
    together = llm.generate(prompts, params)
    for i, (a, b) in enumerate(zip(together, alone)):
        assert_same_or_near_tie(a, b, f"{label}, request {i}")
    if label == "paged, preempting":
        assert llm.engine.scheduler.stats().num_preemptions > 0
    assert llm.engine.kvcache.usage() == 0.0  # everything finished: every block is free again


def run_engine(engine, requests: list[EngineRequest]):
    """Submit and step to the end; return token ids by request and the step stats."""
    for request in requests:
        engine.add_request(request)
    tokens = {r.request_id: [] for r in requests}
    stats = []
    while engine.has_unfinished():
        outputs, step = engine.step()
        stats.append(step)
        for output in outputs:
            tokens[output.request_id].extend(output.new_token_ids)
    return tokens, stats


def test_steps_report_which_request_holds_which_kv_blocks(llm_fp32, monkeypatch):
    """The owner map the dashboard draws: the step after the last request ends carries an empty one; with the
    interval at 0 every step carries one, naming the running requests, whose blocks are exactly those the cache
    counts as taken, and in which a prefix computed before is the same blocks for all of them."""
    from conveyor.engine import core as engine_core

    engine = llm_fp32.engine
    prefix = [1000 + i for i in range(48)]  # three full blocks of 16
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    _, warm = run_engine(engine, [EngineRequest("owner-warm", [*prefix, 7], params)])
    assert warm[-1].kv_owners is not None and warm[-1].kv_owners.request_ids == []
    monkeypatch.setattr(engine_core, "KV_OWNERS_EVERY_S", 0.0)
    _, steps = run_engine(engine, [EngineRequest(f"owner-{i}", [*prefix, 50 + i, 60 + i], params) for i in range(3)])
    for step in steps:
        owners = step.kv_owners
        held = {b for blocks in owners.block_ids for b in blocks if b < step.kv.num_blocks}
        assert len(held) == step.kv.num_blocks - step.kv.num_free_blocks
        assert len(owners.request_ids) == step.scheduler.num_running
    first = steps[0].kv_owners
    assert sorted(first.request_ids) == ["owner-0", "owner-1", "owner-2"]
    shared = first.block_ids[0][:3]
    assert len(set(shared)) == 3 and all(blocks[:3] == shared for blocks in first.block_ids)
    assert steps[-1].kv_owners.request_ids == []


def test_the_running_count_is_the_batch_a_step_ran_until_none_is_left(llm_fp32):
    """A step's stats are read after its finished requests leave and before the next step admits: the running
    count is still the batch the step ran (requests that each gave a token in it), not one fewer for each that
    just ended (with requests ending every step, a full batch read as one short in every sample); after the last
    request, 0."""
    engine = llm_fp32.engine
    lengths = [2, 4, 7]
    requests = [EngineRequest(f"count-{n}", [300 + n, 17, 42, 9], SamplingParams(max_tokens=n, temperature=0,
                                                                             ignore_eos=True)) for n in lengths]
    for request in requests:
        engine.add_request(request)
    counts, gave = [], []
    while engine.has_unfinished():
        outputs, step = engine.step()
        if step is not None:
            counts.append(step.scheduler.num_running)
            gave.append(len({o.request_id for o in outputs if o.new_token_ids}))
    assert counts[-1] == 0
    assert counts[:-1] == gave[:-1] and sorted(set(gave[:-1])) == [1, 2, 3]


def test_shared_system_prompt_hits_the_prefix_cache(llm_fp32, tokenizer):
    system = "You are a meticulous assistant for a museum of natural history. " * 12
    conversations = [
        [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}: name an animal."}]
        for i in range(6)
    ]
    ids = [tokenizer.encode_chat(c) for c in conversations]
    params = SamplingParams(max_tokens=6, temperature=0)

    def requests(tag: str):
        eos = sorted(tokenizer.eos_token_ids)
        return [EngineRequest(f"{tag}-{i}", prompt, params, eos_token_ids=eos) for i, prompt in enumerate(ids)]

    uncached_llm = make_llm(**{"kvcache.enable_prefix_caching": False})
    reference, plain_stats = run_engine(uncached_llm.engine, requests("plain"))
    engine = llm_fp32.engine
    hits_before = engine.kvcache.stats().num_prefix_hit_tokens
    first, warm_stats = run_engine(engine, requests("warm")[:1])
    rest, cached_stats = run_engine(engine, requests("cached")[1:])
    hits = engine.kvcache.stats().num_prefix_hit_tokens - hits_before
    shared_tokens = len(tokenizer.encode_chat([{"role": "system", "content": system}], add_generation_prompt=False))
    assert hits >= 5 * (shared_tokens // 16) * 16 > 5 * 100
    computed_plain = sum(s.num_prefill_tokens for s in plain_stats)
    # (the warm request's own steps too: an earlier test may have left some of its prefix in the shared engine)
    computed_cached = sum(s.num_prefill_tokens for s in warm_stats + cached_stats)
    assert computed_plain - computed_cached == hits
    assert [first["warm-0"]] + [rest[f"cached-{i}"] for i in range(1, 6)] == [reference[f"plain-{i}"] for i in range(6)]


async def test_inproc_client_streams_aborts_and_rejects(llm_fp32, tokenizer):
    """The in-process engine client under the event loop: identical requests stream identical tokens, a client
    that leaves aborts its request at once (long before it could finish), a request the engine cannot take
    ends with a 400, and every step's stats describe the step."""
    engine, client = llm_fp32.engine, llm_fp32.client
    free_before = engine.kvcache.num_free_blocks
    aborted_before = engine.scheduler.stats().num_aborted
    steps = []
    client.stats_observers.append(steps.append)
    question = [{"role": "user", "content": "Count from one to twenty in words."}]
    prompt = tokenizer.encode_chat(question)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    [expected] = await anyio.to_thread.run_sync(llm_fp32.generate, [question], greedy)  # (its own event loop)
    # until max_model_len: thousands of tokens, far more than any device makes before the abort arrives
    endless = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)

    async def collect(request_id: str, params: SamplingParams, stop_after: int | None = None, ids=prompt):
        tokens, last = [], None
        async with aclosing(client.generate(EngineRequest(request_id, ids, params))) as stream:
            async for output in stream:
                tokens.extend(output.new_token_ids)
                last = output
                if stop_after is not None and len(tokens) >= stop_after:
                    break  # the client goes away
        return tokens, last

    results = {}
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(client.run)

            async def run(name, *args):
                results[name] = await collect(name, *args)

            tg.start_soon(run, "a", greedy)
            tg.start_soon(run, "b", greedy)
            tg.start_soon(run, "leaver", endless, 3)
            tg.start_soon(run, "too-long", SamplingParams(max_tokens=4), None,
                          list(range(1, engine.max_model_len + 1)))
            with anyio.fail_after(120):
                while len(results) < 4 or engine.has_unfinished():
                    await anyio.sleep(0.05)
            tg.cancel_scope.cancel()
    finally:
        client.stats_observers.remove(steps.append)
    assert results["a"][0] == results["b"][0] == expected.token_ids
    assert results["a"][1].finish_reason == "length"
    assert len(results["leaver"][0]) == 3
    assert engine.scheduler.stats().num_aborted == aborted_before + 1  # ended by the abort, not by its length
    rejected = results["too-long"][1]
    assert rejected.finish_reason == "error" and rejected.error_status == 400
    assert f"max_model_len={engine.max_model_len}" in rejected.error
    assert engine.kvcache.num_free_blocks == free_before  # the leaver's blocks came back
    ran = [s for s in steps if s.num_prefill_tokens + s.num_decode_tokens]
    assert sum(s.num_decode_tokens for s in ran) >= 2 * 11  # a and b decoded 11 tokens each
    assert min(s.kv.num_free_blocks for s in ran) < free_before  # blocks were in use during the run
    assert all(s.kv.num_blocks == engine.kvcache.num_blocks for s in steps)
    assert all(s.forward_time > 0 for s in ran)
    assert steps[-1].kv.num_free_blocks == free_before  # the snapshot after the abort shows the blocks back
