"""Every way a request ends, on SmolLM2 through the frontend: the scheduler's record of the end (the request's
``finish_reason``, which only the scheduler writes) equals what the client sees."""

from __future__ import annotations

import json
from contextlib import aclosing

import anyio
import pytest

from conveyor.engine.core import EngineCore
from conveyor.request import Request
from conveyor.sampling import SamplingParams, StructuredOutput
from conveyor.transport import RequestError
from tests.test_structured import CITY_POPULATION, POPULATION_PROMPT

pytestmark = pytest.mark.slow

HELLO = [{"role": "user", "content": "Say hello in one short sentence."}]
GREEDY = {"temperature": 0.0}


async def client_view(llm, prompt_ids: list[int], params: SamplingParams, request_id: str,
                      leave_after: int | None = None) -> tuple[str, bool]:
    """The finish reason the frontend's client sees ("abort" for one that leaves after ``leave_after`` chunks with
    tokens; "error" for one that fails), and whether the last chunk says its answer was closed."""
    chunks, seen = llm.frontend.generate(prompt_ids, params, request_id=request_id), 0
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                seen += bool(chunk.token_ids)
                if chunk.finish_reason is not None:
                    return chunk.finish_reason, chunk.grammar_closed
                if leave_after is not None and seen >= leave_after:
                    return "abort", False
    except RequestError:
        return "error", False
    raise AssertionError(f"{request_id}: the stream ended without a finish reason")


def test_the_scheduler_records_every_end_as_the_client_sees_it(llm_fp32, monkeypatch):
    """eos, a stop id, a stop string (which only the frontend sees), length, a grammar closed as max_tokens ran
    out, an embedding, a client that left, a language that does not compile and a step that failed: each
    request's end as the scheduler recorded it is the client's."""
    engine: EngineCore = llm_fp32.engine
    free_before = engine.kvcache.num_free_blocks
    [free] = llm_fp32.generate([HELLO], SamplingParams(max_tokens=64, **GREEDY))
    assert free.finish_reason == "stop" and len(free.token_ids) > 4  # (it ends by itself, at end of sequence)
    hello = llm_fp32.encode(HELLO)
    ask = llm_fp32.encode(POPULATION_PROMPT)
    city = StructuredOutput(json=json.dumps(CITY_POPULATION))
    cases = {  # request id: (prompt, params, the end the scheduler must record, leave after)
        "eos": (hello, SamplingParams(max_tokens=64, **GREEDY), "stop", None),
        "stop-id": (hello, SamplingParams(max_tokens=64, stop_token_ids=[free.token_ids[3]], **GREEDY), "stop", None),
        # (no length to end it first, however far the engine runs ahead of the frontend's detokenizing)
        "stop-string": (hello, SamplingParams(max_tokens=None, ignore_eos=True, stop=[free.text[6:10]], **GREEDY),
                        "stop", None),
        "length": (hello, SamplingParams(max_tokens=3, **GREEDY), "length", None),
        "closed": (ask, SamplingParams(max_tokens=20, structured=city, **GREEDY), "length", None),
        "pooling": (hello, SamplingParams(max_tokens=1, pooling="last", **GREEDY), "stop", None),
        "abort": (hello, SamplingParams(max_tokens=None, ignore_eos=True, **GREEDY), "abort", 2),
        "refused": (hello, SamplingParams(max_tokens=8, structured=StructuredOutput(regex="(")), "error", None),
    }
    recorded: dict[str, Request] = {}
    add = engine.scheduler.add

    def remember(request: Request) -> None:
        recorded[request.request_id] = request
        add(request)

    monkeypatch.setattr(engine.scheduler, "add", remember)
    seen: dict[str, tuple[str, bool]] = {}

    async def run(request_id: str, prompt, params, leave_after) -> None:
        seen[request_id] = await client_view(llm_fp32, prompt, params, request_id, leave_after)

    async def serve() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(llm_fp32.client.run)
            with anyio.fail_after(300):
                async with anyio.create_task_group() as requests:
                    for request_id, (prompt, params, _, leave_after) in cases.items():
                        requests.start_soon(run, request_id, prompt, params, leave_after)
                # a step that fails ends its requests with an error (the engine goes on)
                collect = engine.executor.collect

                def fail():
                    collect()
                    raise RuntimeError("a step that failed")

                monkeypatch.setattr(engine.executor, "collect", fail)
                await run("failed", hello, SamplingParams(max_tokens=8, **GREEDY), None)
                monkeypatch.setattr(engine.executor, "collect", collect)
                await run("after", hello, SamplingParams(max_tokens=2, **GREEDY), None)
                while engine.has_unfinished():
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()

    anyio.run(serve)
    expected = {request_id: case[2] for request_id, case in cases.items()} | {"failed": "error", "after": "length"}
    assert {request_id: reason for request_id, (reason, _) in seen.items()} == expected
    assert {request_id: request.finish_reason.value for request_id, request in recorded.items()} == expected
    assert [request_id for request_id, (_, closed) in seen.items() if closed] == ["closed"]
    assert recorded["closed"].closing
    assert recorded["stop-string"].num_tokens < recorded["stop-string"].max_total_tokens  # (not run to its length)
    assert engine.scheduler.requests == {} and engine.kvcache.num_free_blocks == free_before
