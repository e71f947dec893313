"""Data parallelism: the router's policy, ``DPClient`` over stand-in replicas, per-replica metrics, and a real
``conveyor serve`` with two engine replicas against one with a single engine."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing

import anyio
import anyio.abc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conveyor.bench.doctor import examine
from conveyor.engine.client import EngineClient, EngineUnavailable
from conveyor.engine.dp_client import DPClient
from conveyor.engine.router import ReplicaLoad, Router
from conveyor.messages import EngineReady, EngineRequest, KVCacheStats, RequestOutput, SchedulerStats, StepStats
from conveyor.request import RequestRejected
from conveyor.sampling import SamplingParams
from conveyor.serving.metrics import ServerMetrics
from tests.conftest import CHAT_PROMPTS
from tests.server import Server, http_config
from tests.test_parallel import PROMPTS, tiny_llama, tiny_single  # noqa: F401 - fixtures
from tests.test_parallel_faults import serve_split

BLOCK = 4
IDLE = ReplicaLoad()


def busy(num_requests: int, kv_usage: float = 0.0) -> ReplicaLoad:
    return ReplicaLoad(num_running=num_requests, num_in_flight=num_requests, kv_usage=kv_usage)


def prompt(prefix: int, length: int) -> list[int]:
    """Token ids: ``prefix`` picks the leading tokens shared with other prompts of that prefix."""
    return [prefix * 1000 + i for i in range(length)]


# ---------------------------------------------------------------- the router's policy


def test_prefix_hashes_cover_full_blocks_and_chain():
    router = Router(2, block_size=BLOCK)
    a = router.prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = router.prefix_hashes([1, 2, 3, 4, 5, 6, 7, 0, 9, 10])
    assert len(a) == 2 and len(b) == 2  # the partial last block is not hashed
    assert a[0] == b[0] and a[1] != b[1]
    # a block is known by everything before it: the same second block after a different first one differs
    c = router.prefix_hashes([0, 2, 3, 4, 5, 6, 7, 8])
    assert c[1] != a[1]
    assert router.prefix_hashes([1, 2, 3]) == []


def test_least_loaded_replica_wins_without_a_prefix():
    router = Router(3, block_size=BLOCK)
    hashes = router.prefix_hashes(prompt(1, 16))
    loads = [ReplicaLoad(num_running=3, num_waiting=1, num_in_flight=4), busy(1), busy(2)]
    assert router.choose(hashes, loads) == 1
    # requests routed there and not in its stats yet count too
    loads[1] = ReplicaLoad(num_running=1, num_in_flight=5)
    assert loads[1].num_requests == 5
    assert router.choose(hashes, loads) == 2
    # equal requests: the lower KV usage wins; then the lower index
    assert router.choose(hashes, [busy(2, kv_usage=0.8), busy(2, kv_usage=0.2), busy(2, kv_usage=0.8)]) == 1
    assert router.choose(hashes, [busy(2), busy(2), busy(2)]) == 0
    # a replica that is down takes nothing
    assert router.choose(hashes, [None, busy(7), None]) == 1
    with pytest.raises(ValueError, match="no replica is live"):
        router.choose(hashes, [None, None, None])


def test_the_prefix_holder_wins_unless_clearly_overloaded():
    router = Router(3, block_size=BLOCK, max_imbalance=8, max_ratio=1.5)
    router.record(1, router.prefix_hashes(prompt(7, 40)))
    router.record(2, router.prefix_hashes(prompt(7, 8)))  # a shorter match
    hashes = router.prefix_hashes(prompt(7, 30) + [5, 5, 5, 5, 5])
    assert router.num_matched_blocks(1, hashes) == 7
    assert router.num_matched_blocks(2, hashes) == 2
    assert router.num_matched_blocks(0, hashes) == 0
    # the longest match wins over an idle replica and over a shorter match
    assert router.choose(hashes, [IDLE, busy(3), IDLE]) == 1
    # busier, but not by more than max_imbalance requests: still the holder
    assert router.choose(hashes, [IDLE, busy(8), IDLE]) == 1
    # more than max_imbalance over an idle replica: overloaded, the least loaded one takes it
    assert router.choose(hashes, [IDLE, busy(20), busy(4)]) == 0
    # far ahead in requests but within max_ratio times the least loaded: still the holder
    assert router.choose(hashes, [busy(20), busy(29), busy(25)]) == 1
    # ... and past both thresholds: not
    assert router.choose(hashes, [busy(20), busy(31), busy(25)]) == 0
    # the holder down: the rest as if it had never served the prefix (the shorter match)
    assert router.choose(hashes, [IDLE, None, busy(3)]) == 2


def test_equal_matches_go_to_the_least_loaded_holder():
    router = Router(3, block_size=BLOCK)
    shared = router.prefix_hashes(prompt(3, 12))
    router.record(0, shared)
    router.record(2, shared)
    assert router.choose(shared, [busy(4), IDLE, busy(2)]) == 2


def test_forget_and_the_lru_bound():
    router = Router(2, block_size=BLOCK, capacity=6)
    long = router.prefix_hashes(prompt(1, 16))  # 4 blocks
    router.record(0, long)
    router.record(0, router.prefix_hashes(prompt(2, 12)))  # 3 more: the least recently used one goes
    assert router.num_matched_blocks(0, router.prefix_hashes(prompt(2, 12))) == 3
    # the longest prefix went first; the shorter ones of the same prompt remain
    assert router.num_matched_blocks(0, long) == 3
    router.forget(0, capacity=100)
    assert router.num_matched_blocks(0, long) == 0


def test_simulated_traffic_keeps_prefix_groups_together_and_replicas_balanced():
    """A brute-force run of the policy: 4 groups of prompts that share a long prefix (a few-shot template
    each), 8 requests per group in flight on 2 replicas. Each group should stay on one replica (its prefix
    is computed once), yet the replicas end up equally busy."""
    router = Router(2, block_size=16)
    in_flight = [0, 0]
    placed: dict[int, set[int]] = {}
    for i in range(32):
        group = i % 4
        tokens = prompt(group, 200) + [90_000 + i] * 20
        hashes = router.prefix_hashes(tokens)
        replica = router.choose(hashes, [ReplicaLoad(num_in_flight=n) for n in in_flight])
        router.record(replica, hashes)
        in_flight[replica] += 1
        placed.setdefault(group, set()).add(replica)
    assert all(len(replicas) == 1 for replicas in placed.values()), placed
    assert in_flight == [16, 16]
    # without shared prefixes the policy is plain least load: alternate
    router = Router(2, block_size=16)
    in_flight = [0, 0]
    for i in range(10):
        hashes = router.prefix_hashes(prompt(100 + i, 64))
        replica = router.choose(hashes, [ReplicaLoad(num_in_flight=n) for n in in_flight])
        router.record(replica, hashes)
        in_flight[replica] += 1
    assert in_flight == [5, 5]


# ---------------------------------------------------------------- DPClient over stand-in replicas


class FakeReplica(EngineClient):
    """An engine client without an engine: it records what it gets and emits what a test tells it to."""

    def __init__(self, pid: int):
        super().__init__()
        self.pid = pid
        self.submitted: list[str] = []
        self.aborted: list[str] = []
        self._stop = anyio.Event()

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        ready = self.restart()
        task_status.started(ready)
        await self._stop.wait()
        self.alive = False

    def restart(self) -> EngineReady:
        ready = EngineReady(self.pid, 256, 50, BLOCK, 3.0, 0.1)
        self._ready(ready)
        return ready

    async def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()

    def _submit(self, request: EngineRequest) -> None:
        self.submitted.append(request.request_id)

    def _abort(self, request_ids: list[str], at_stop_string: bool = False) -> None:
        self.aborted += request_ids
        self._publish([RequestOutput(r, finish_reason="abort") for r in request_ids], None)

    def emit(self, request_id: str, token: int, finish_reason: str | None = None) -> None:
        stats = StepStats(1, 0.0, SchedulerStats(num_running=len(self._streams)), KVCacheStats(usage=0.5))
        self._publish([RequestOutput(request_id, [token], finish_reason=finish_reason)], stats)

    def die(self) -> None:
        self.alive = False
        self._streams.fail_all("the engine process exited", 503)


def request(request_id: str, tokens: list[int]) -> EngineRequest:
    return EngineRequest(request_id, tokens, SamplingParams(max_tokens=4, temperature=0))


@pytest.mark.parametrize("replicas", [1, 2])
async def test_the_one_id_check_is_the_engine_clients(replicas):
    """A request id already streaming is refused where the streams are handed out (one engine's client, or the
    data-parallel client over several), before any engine sees it; the first request's stream goes on."""
    engines = [FakeReplica(100 + i) for i in range(replicas)]
    client = engines[0] if replicas == 1 else DPClient(engines, Router(replicas, block_size=BLOCK))
    tokens = []

    async def first():
        async with aclosing(client.generate(request("same", [1, 2, 3]))) as outputs:
            tokens.extend([o.new_token_ids async for o in outputs])

    async with anyio.create_task_group() as tg:
        await tg.start(client.run)
        tg.start_soon(first)
        with anyio.fail_after(10):
            while not any(e.submitted for e in engines):
                await anyio.sleep(0.01)
        with pytest.raises(RequestRejected, match="request id 'same' is already in use"):
            async with aclosing(client.generate(request("same", [4, 5, 6]))) as second:
                await anext(second)
        next(e for e in engines if e.submitted).emit("same", 7, "stop")
        with anyio.fail_after(10):
            while not tokens:
                await anyio.sleep(0.01)
        assert tokens == [[7]]
        assert [rid for e in engines for rid in e.submitted] == ["same"]
        await client.shutdown()
        tg.cancel_scope.cancel()


async def test_dp_client_routes_streams_aborts_and_survives_a_dead_replica():
    replicas = [FakeReplica(100), FakeReplica(101)]
    client = DPClient(replicas, Router(2, block_size=BLOCK))
    readies, stats_seen = [], []
    client.ready_observers.append(readies.append)
    client.replica_stats_observers.append(lambda stats, replica: stats_seen.append(replica))
    assert not client.alive
    results: dict[str, list[RequestOutput]] = {}

    async def consume(req: EngineRequest, leave_after: int | None = None) -> None:
        outputs = results.setdefault(req.request_id, [])
        async with aclosing(client.generate(req)) as stream:
            async for output in stream:
                outputs.append(output)
                if leave_after is not None and len(outputs) >= leave_after:
                    break

    async def until(predicate) -> None:
        with anyio.fail_after(10):
            while not predicate():
                await anyio.sleep(0.001)

    async with anyio.create_task_group() as tg:
        first = await tg.start(client.run)
        assert first.pid == 100
        assert sorted(r.pid for r in readies) == [100, 101]  # each replica's EngineReady, once
        assert client.alive and client.max_model_len == 256

        # distinct prompts alternate between the idle replicas, as each counts the one before it
        for i in range(4):
            tg.start_soon(consume, request(f"r{i}", prompt(i, 8)))
        await until(lambda: client.num_in_flight == 4)
        assert replicas[0].submitted == ["r0", "r2"] and replicas[1].submitted == ["r1", "r3"]
        assert [client.replica_of(f"r{i}") for i in range(4)] == [0, 1, 0, 1]
        with pytest.raises(RequestRejected):
            async with aclosing(client.generate(request("r1", prompt(9, 8)))) as stream:
                await stream.__anext__()

        # outputs stream back from the replica that has the request; the observers learn which replica stepped
        replicas[1].emit("r1", 11)
        replicas[0].emit("r0", 10, "length")
        await until(lambda: len(results["r0"]) == 1 and len(results["r1"]) == 1)
        assert client.num_in_flight == 3
        assert [o.new_token_ids for o in results["r0"]] == [[10]] and results["r0"][-1].finish_reason == "length"
        assert [o.new_token_ids for o in results["r1"]] == [[11]]
        assert stats_seen == [1, 0]

        # the same prefix follows the replica that served it (r3's prompt went to replica 1)
        tg.start_soon(consume, request("r3-again", prompt(3, 12)))
        await until(lambda: "r3-again" in replicas[1].submitted)

        # an abort goes to the replica that has the request, and ends its stream
        client.abort("r2")
        await until(lambda: results["r2"] and results["r2"][-1].finish_reason == "abort")
        assert replicas[0].aborted == ["r2"] and replicas[1].aborted == []

        # replica 0 dies: its requests fail, the other's keep going, and new requests all go to replica 1
        tg.start_soon(consume, request("on-0", prompt(20, 8)))
        await until(lambda: client.replica_of("on-0") == 0)
        replicas[0].die()
        await until(lambda: results["on-0"] and results["on-0"][-1].finish_reason == "error")
        assert results["on-0"][-1].error_status == 503
        assert client.alive
        for i in range(3):
            tg.start_soon(consume, request(f"while-down-{i}", prompt(30 + i, 8)))
        await until(lambda: all(client.replica_of(f"while-down-{i}") == 1 for i in range(3)))
        replicas[1].emit("r1", 12, "stop")
        await until(lambda: results["r1"][-1].finish_reason == "stop")

        # back after its restart: it takes requests again, and its old prefixes are forgotten
        replicas[0].restart()
        assert sorted(r.pid for r in readies) == [100, 100, 101]
        assert client.router.num_matched_blocks(0, client.router.prefix_hashes(prompt(0, 8))) == 0
        tg.start_soon(consume, request("after", prompt(40, 8)))
        await until(lambda: client.replica_of("after") == 0)

        # nothing alive: 503 at once
        client.abort_all()
        await until(lambda: client.num_in_flight == 0)
        replicas[0].die()
        replicas[1].die()
        assert not client.alive
        with pytest.raises(EngineUnavailable):
            async with aclosing(client.generate(request("late", prompt(50, 8)))) as stream:
                await stream.__anext__()
        await client.shutdown()


# ---------------------------------------------------------------- per-replica metrics


def samples(metrics: ServerMetrics, name: str) -> dict[str, float]:
    """replica label -> value of one metric ("" for no replica label)."""
    text = metrics.render(True, 0).decode()
    return {
        s.labels.get("replica", ""): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def step(running: int, finished: int, aborted: int = 0, usage: float = 0.25) -> StepStats:
    return StepStats(1, 0.0, SchedulerStats(num_running=running, num_waiting=1, num_finished=finished,
                                            num_aborted=aborted),
                     KVCacheStats(usage=usage, num_blocks=50, num_free_blocks=40), num_decode_tokens=running)


def test_metrics_carry_a_replica_label_with_several_replicas():
    down = {1}
    routed = [7, 2]  # requests the frontend routed to each replica that have not ended
    metrics = ServerMetrics("tiny", 2, replica_alive=lambda i: i not in down, replica_in_flight=routed.__getitem__)
    for replica in (0, 1):
        metrics.engine_ready(EngineReady(1, 256, 50, 16, 3.0, 1.0), replica)
    metrics.engine_step(step(running=3, finished=2), 0)
    metrics.engine_step(step(running=1, finished=5, aborted=1, usage=0.75), 1)
    assert samples(metrics, "conveyor_num_requests_running") == {"0": 3, "1": 1}
    assert samples(metrics, "conveyor_num_requests_waiting") == {"0": 1, "1": 1}
    assert samples(metrics, "conveyor_kv_cache_usage_ratio") == {"0": 0.25, "1": 0.75}
    assert samples(metrics, "conveyor_kv_cache_blocks") == {"0": 50, "1": 50}
    assert samples(metrics, "conveyor_engine_alive") == {"0": 1, "1": 0}
    assert samples(metrics, "conveyor_replica_requests_total") == {"0": 2, "1": 6}
    assert samples(metrics, "conveyor_replica_requests_in_flight") == {"0": 7, "1": 2}
    assert samples(metrics, "conveyor_engine_steps_total") == {"0": 1, "1": 1}
    # engine counters become increments per replica: a restarted replica counts from zero again
    metrics.engine_ready(EngineReady(2, 256, 50, 16, 3.0, 1.0), 1)
    metrics.engine_step(step(running=1, finished=1), 1)
    metrics.engine_step(step(running=0, finished=4), 0)
    assert samples(metrics, "conveyor_replica_requests_total") == {"0": 4, "1": 7}
    assert samples(metrics, "conveyor_engine_restarts_total") == {"0": 0, "1": 1}
    assert samples(metrics, "conveyor_engine_aborted_requests_total") == {"": 1}  # global
    assert samples(metrics, "conveyor_engine_step_seconds_count") == {"": 3}  # global: the steps that ran tokens
    # the status line sums the queues and averages the KV usage
    assert metrics.status_line().startswith("running 1, waiting 2, KV 25.0%")


def test_one_engine_has_no_replica_label():
    metrics = ServerMetrics("tiny")
    metrics.engine_step(step(running=3, finished=2))
    text = metrics.render(True, 0).decode()
    assert "replica" not in text
    assert samples(metrics, "conveyor_num_requests_running") == {"": 3}


# ---------------------------------------------------------------- a real server with two engine replicas

NUM_REQUESTS = 24
SYSTEM = ("You are a patient teacher. Answer in one short sentence, use simple words, and never use lists. "
          "If the question is about numbers, show the result first.")


def conversations() -> list[list[dict[str, str]]]:
    """Mixed prompts: half share a long system prompt (prefix affinity has something to hold), half differ."""
    convs = []
    for i in range(NUM_REQUESTS):
        question = CHAT_PROMPTS[i % len(CHAT_PROMPTS)]
        if i % 2:
            convs.append([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
        else:
            convs.append([{"role": "user", "content": f"Question {i}: {question}"}])
    return convs


async def stream_all(server: Server, model: str) -> list[dict]:
    """Every conversation at once, streamed, greedy; per request its tokens, top-5 logprobs and finish reason."""

    async def one(client: openai.AsyncOpenAI, index: int, messages) -> dict:
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=8 + index % 9, temperature=0, stream=True,
            logprobs=True, top_logprobs=5,
        )
        result = {"tokens": [], "top": [], "finish_reasons": []}
        async for chunk in stream:
            for choice in chunk.choices:
                for entry in (choice.logprobs.content or []) if choice.logprobs else []:
                    result["tokens"].append(entry.token)
                    result["top"].append({t.token: t.logprob for t in entry.top_logprobs})
                if choice.finish_reason is not None:
                    result["finish_reasons"].append(choice.finish_reason)
        return result

    async with openai.AsyncOpenAI(base_url=f"{server.http}/v1", api_key="unused", max_retries=0,
                                  timeout=600) as client:
        return await asyncio.gather(*(one(client, i, m) for i, m in enumerate(conversations())))


def model_name(server: Server) -> str:
    return httpx.get(f"{server.http}/v1/models").json()["data"][0]["id"]


def serve(tmp_path, name: str, data_parallel_size: int) -> Server:
    # the dequantized float32 model: the two servers batch the requests differently, and the packed default
    # rounds activations to int8 per 32 values, which turns float32's last-bit differences between batchings
    # into whole rounding steps (logprobs apart by up to ~0.1 on this test's prompts, run to run, one engine)
    overrides = ["engine.num_threads=1", "model.dtype=float32", "quant.plugin=none",
                 f"parallel.data_parallel_size={data_parallel_size}"]
    return Server(http_config(), tmp_path / name, overrides=overrides)


def chat(server: Server, model: str, messages: list[dict[str, str]]) -> httpx.Response:
    return httpx.post(f"{server.http}/v1/chat/completions", timeout=120,
                      json={"model": model, "messages": messages, "max_tokens": 4, "temperature": 0})


def finished(server: Server) -> float:
    """Requests the frontend has seen end, whatever the reason (0 before the first)."""
    try:
        return server.metric("conveyor_requests_total")
    except KeyError:
        return 0.0


def assert_same_greedy(dp: dict, single: dict, label: str) -> None:
    """Equal token for token, or the first difference is a near tie (each token in the other's top 5, logprobs
    within 0.01): the two servers batch the requests differently."""
    for i, (x, y) in enumerate(zip(dp["tokens"], single["tokens"])):
        if x == y:
            continue
        a, b = dp["top"][i], single["top"][i]
        assert y in a and x in b, f"{label}: token {i} differs ({x!r} vs {y!r}) outside each other's top 5"
        gap = max(abs(a[x] - a[y]), abs(b[x] - b[y]))
        assert gap < 0.01, f"{label}: token {i} differs ({x!r} vs {y!r}) with a logprob gap of {gap:.4f}"
        return
    assert dp["tokens"] == single["tokens"], f"{label}: one is a prefix of the other"
    assert dp["finish_reasons"] == single["finish_reasons"], label


@pytest.mark.slow
def test_two_replicas_serve_every_stream_like_one_engine(tmp_path):
    for name in ("single", "dp"):
        (tmp_path / name).mkdir()
    single_server = serve(tmp_path, "single", 1).start()
    try:
        single = asyncio.run(stream_all(single_server, model_name(single_server)))
        assert "replica" not in httpx.get(f"{single_server.http}/metrics").text
    finally:
        assert single_server.stop() == 0, single_server.output

    server = serve(tmp_path, "dp", 2).start()
    try:
        assert "Data parallel: 2 engine replicas" in server.output
        assert len(set(re.findall(r"engine process (\d+) ready", server.output))) == 2
        # replica 0's engine held still while the requests come: it cannot finish any, so the router must
        # send the others to replica 1, however fast the device
        replica0 = int(re.search(r"engine process (\d+) ready in [\d.]+ s \(replica 0\)", server.output).group(1))
        name = model_name(server)
        with ThreadPoolExecutor(1) as pool:
            os.kill(replica0, signal.SIGSTOP)
            try:
                running = pool.submit(asyncio.run, stream_all(server, name))
                # (in flight or already done: replica 1 may finish its share before the last one arrives)
                server.wait_for(lambda: server.metric("conveyor_num_requests_in_flight") + finished(server)
                                == NUM_REQUESTS, timeout=120, what="every request routed")
                # the doctor, meanwhile: replica 0 holds requests and runs no step (replica 1 runs its own, or
                # has finished them), so the replicas are called imbalanced, replica 0 the one behind
                doctor = examine(server.http, 2.0)
            finally:
                os.kill(replica0, signal.SIGCONT)
            results = running.result()
        assert doctor.verdict == "dp_imbalance", doctor.window
        evidence = doctor.findings[0].evidence
        assert evidence["lagging_replica"] == 0 and evidence["replica_steps_min"] == 0, evidence
        assert evidence["replica_requests_max"] >= 4, evidence
        for index, (dp, one) in enumerate(zip(results, single)):
            # none lost: each stream ends with exactly one finish reason
            assert len(dp["finish_reasons"]) == 1 and dp["tokens"], f"request {index}: {dp}"
            assert_same_greedy(dp, one, f"request {index}")
        # both replicas served, by their own engines' counts, and together all of the requests
        served = [server.metric("conveyor_replica_requests_total", replica=r) for r in ("0", "1")]
        assert all(n > 0 for n in served), served
        server.wait_for(lambda: sum(server.metric("conveyor_replica_requests_total", replica=r) for r in "01")
                        == NUM_REQUESTS, what=f"{NUM_REQUESTS} requests ended in the engines")
        assert server.metric("conveyor_requests_total") == NUM_REQUESTS
        assert server.metric("conveyor_num_requests_in_flight") == 0
        assert [server.metric("conveyor_engine_alive", replica=r) for r in "01"] == [1, 1]

        # prefix affinity: one after another, chats with a long system prompt of their own all go to the replica
        # that served the first (the loads are equal between them: nothing else runs)
        def served_by() -> list[float]:
            return [server.metric("conveyor_replica_requests_total", replica=r) for r in "01"]

        before = served_by()
        system = "You are a careful guide to the birds of the northern forests. " * 8
        for i in range(4):
            chat(server, name, [{"role": "system", "content": system}, {"role": "user", "content": f"Bird {i}?"}])
            server.wait_for(lambda done=i + 1: sum(served_by()) == sum(before) + done, what="the request to end")
        assert sorted(b - a for a, b in zip(before, served_by())) == [0, 4]

        # replica 0's engine killed: the server keeps answering from replica 1 while it restarts
        replica0 = int(re.findall(r"engine process (\d+) ready in [\d.]+ s \(replica 0\)", server.output)[-1])
        os.kill(replica0, signal.SIGKILL)
        server.wait_for(lambda: server.metric("conveyor_engine_alive", replica="0") == 0, what="replica 0 down")
        before = served_by()
        for i in range(3):
            assert chat(server, name, [{"role": "user", "content": f"Count to {i + 2}."}]).status_code == 200
        server.wait_for(lambda: served_by()[1] == before[1] + 3, what="replica 1 to serve the three")
        server.wait_for(lambda: server.metric("conveyor_engine_alive", replica="0") == 1, timeout=180,
                        what="replica 0 to restart")
        assert server.metric("conveyor_engine_restarts_total", replica="0") == 1
        assert server.metric("conveyor_engine_restarts_total", replica="1") == 0
    finally:
        assert server.stop() == 0, server.output


@pytest.mark.slow
def test_two_replicas_of_a_model_split_over_two_workers_each(tiny_llama, tiny_single, tmp_path):  # noqa: F811
    """data_parallel_size = 2 with tensor_parallel_size = 2: two engines with two workers each, and each replica
    computes what one unsplit worker does. Both engines are held still while two requests arrive, so the router
    sends the second to the other replica (the first is in flight on its pick), however fast the device."""
    server = serve_split(tiny_llama, tmp_path, data_parallel_size=2, tensor_parallel_size=2)
    try:
        workers = re.findall(r"workers ready: (.*)", server.output)
        assert len(workers) == 2 and all(len(re.findall(r"rank \d+ pid \d+", line)) == 2 for line in workers)
        engines = [int(pid) for pid in re.findall(r"engine process (\d+) ready in [\d.]+ s", server.output)]
        replies: list[httpx.Response] = []

        def complete(prompt: list[int]) -> None:
            body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            replies.append(httpx.post(f"{server.http}/v1/completions", json=body, timeout=120))

        with ThreadPoolExecutor(2) as pool:
            for pid in engines:
                os.kill(pid, signal.SIGSTOP)
            try:
                # (shorter than a KV block: no prefix for the router to follow)
                done = [pool.submit(complete, PROMPTS[i]) for i in (0, 1)]
                server.wait_for(lambda: server.metric("conveyor_num_requests_in_flight") == 2, what="both in flight")
            finally:
                for pid in engines:
                    os.kill(pid, signal.SIGCONT)
            for future in done:
                future.result()
        texts = sorted(r.json()["choices"][0]["text"] for r in replies)
        assert texts == sorted(c.text for c in tiny_single[:2])
        server.wait_for(lambda: [server.metric("conveyor_replica_requests_total", replica=r) for r in "01"]
                        == [1, 1], what="each replica to count one request")
    finally:
        assert server.stop() == 0, server.output
