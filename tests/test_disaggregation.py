"""Prefill/decode disaggregation: ``PDClient`` over stand-in engines (where each request goes, what each engine
is asked, what happens when one fails), the ``tiers`` connector holding a decode engine's request until a
prefill engine's blocks are stored (with the fake model of test_kv_tiers), the config's checks, and real
``conveyor serve`` runs with one and two prefill engines against colocated serving."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing

import anyio
import msgspec
import openai
import pytest

from conveyor.config import ConfigError, load_config
from conveyor.engine.client import EngineUnavailable
from conveyor.engine.pd_client import TRANSFER_PREFIX, PDClient, remove_orphans, transfer_config
from conveyor.engine.router import Router
from conveyor.messages import EngineRequest, KVTransfer, RequestOutput
from conveyor.request import Request, RequestStatus
from conveyor.sampling import SamplingParams
from tests.conftest import CHAT_PROMPTS
from tests.factories import assert_no_leak
from tests.server import Server, http_config
from tests.test_data_parallel import BLOCK, FakeReplica, model_name, prompt
from tests.test_kv_tiers import Engine


class RecordingReplica(FakeReplica):
    """A stand-in engine that keeps every request it is given, whole."""

    def __init__(self, pid: int):
        super().__init__(pid)
        self.requests: dict[str, EngineRequest] = {}

    def _submit(self, request: EngineRequest) -> None:
        super()._submit(request)
        self.requests[request.request_id] = request

    def refuse(self, request_id: str, status: int) -> None:
        self._publish([RequestOutput(request_id, finish_reason="error", error="no", error_status=status)], None)


def request(request_id: str, tokens: list[int]) -> EngineRequest:
    return EngineRequest(request_id, tokens, SamplingParams(max_tokens=4, temperature=0, logprobs=2))


async def test_a_request_prefills_on_one_engine_then_decodes_on_another_with_its_blocks_handed_over():
    prefill, decode = RecordingReplica(100), RecordingReplica(200)
    client = PDClient([prefill, decode], 1, transfer_timeout=7.0, router=Router(2, block_size=BLOCK))
    results: dict[str, list[RequestOutput]] = {}

    async def consume(req: EngineRequest) -> None:
        outputs = results.setdefault(req.request_id, [])
        try:
            async with aclosing(client.generate(req)) as stream:
                async for output in stream:
                    outputs.append(output)
        except EngineUnavailable as e:
            outputs.append(RequestOutput(req.request_id, finish_reason="error", error=str(e), error_status=503))

    async def until(predicate) -> None:
        with anyio.fail_after(10):
            while not predicate():
                await anyio.sleep(0.001)

    def ended(request_id: str) -> RequestOutput | None:
        outputs = results.get(request_id)
        return outputs[-1] if outputs and outputs[-1].finish_reason is not None else None

    async with anyio.create_task_group() as tg:
        await tg.start(client.run)
        assert client.roles == ["prefill", "decode"]

        # the prompt first goes to the prefill engine, as a request for one token and nothing else
        tg.start_soon(consume, request("a", prompt(1, 9)))
        await until(lambda: "a" in prefill.requests)
        sent = prefill.requests["a"]
        assert sent.prompt_token_ids == prompt(1, 9) and sent.kv_transfer is None
        assert (sent.params.max_tokens, sent.params.logprobs) == (1, None)
        assert client.replica_of("a") == 0 and "a" not in decode.requests
        # its token is dropped; the request itself then goes to the decode engine, with the prompt's full blocks
        # before its last token to wait for
        prefill.emit("a", 99, "length")
        await until(lambda: "a" in decode.requests)
        assert decode.requests["a"] == msgspec.structs.replace(request("a", prompt(1, 9)),
                                                                kv_transfer=KVTransfer(2, 7.0))
        assert client.replica_of("a") == 1
        decode.emit("a", 5)
        decode.emit("a", 6, "stop")
        await until(lambda: ended("a"))
        assert [o.new_token_ids for o in results["a"]] == [[5], [6]]

        # a prompt without a full block before its last token goes straight to a decode engine
        tg.start_soon(consume, request("short", prompt(2, BLOCK)))
        await until(lambda: "short" in decode.requests)
        assert "short" not in prefill.requests and decode.requests["short"].kv_transfer is None

        # refused (429) or aborted on the prefill engine: ended as on one engine, never decoded
        tg.start_soon(consume, request("refused", prompt(3, 9)))
        await until(lambda: "refused" in prefill.requests)
        prefill.refuse("refused", 429)
        await until(lambda: ended("refused"))
        assert ended("refused").error_status == 429
        tg.start_soon(consume, request("aborted", prompt(4, 9)))
        await until(lambda: "aborted" in prefill.requests)
        client.abort("aborted")
        await until(lambda: ended("aborted"))
        assert ended("aborted").finish_reason == "abort" and prefill.aborted == ["aborted"]
        assert "refused" not in decode.requests and "aborted" not in decode.requests

        # the prefill engine dies with the prompt on it: the decode engine computes it, with nothing to wait for
        tg.start_soon(consume, request("orphan", prompt(5, 9)))
        await until(lambda: "orphan" in prefill.requests)
        prefill.die()
        await until(lambda: "orphan" in decode.requests)
        assert decode.requests["orphan"].kv_transfer is None
        # while it is down, prompts go to the decode engine directly
        tg.start_soon(consume, request("while-down", prompt(6, 9)))
        await until(lambda: "while-down" in decode.requests)
        assert "while-down" not in prefill.requests and decode.requests["while-down"].kv_transfer is None
        prefill.restart()
        tg.start_soon(consume, request("back", prompt(7, 9)))
        await until(lambda: "back" in prefill.requests)

        # the decode engine dies: its requests end with 503, and with no decode engine new ones get 503 at once
        decode.die()
        await until(lambda: ended("orphan") and ended("while-down"))
        assert ended("orphan").error_status == 503 and ended("while-down").error_status == 503
        assert not client.alive
        prefill.emit("back", 1, "length")
        await until(lambda: ended("back"))
        assert ended("back").error_status == 503
        with pytest.raises(EngineUnavailable, match="no decode engine"):
            async with aclosing(client.generate(request("late", prompt(8, 9)))) as stream:
                await stream.__anext__()
        assert client.num_in_flight == 0
        await client.shutdown()


def test_a_decode_engine_holds_a_request_until_the_prefill_engines_blocks_are_stored(tmp_path):
    """Two fake engines on one directory: the decode engine's requests wait at the connector's gate, computing
    nothing, until the prefill engine's blocks are on disk; then they load them and compute only the tail, with
    the replies of an engine that computed everything. A transfer that never comes times out and is computed."""
    prompts = [list(range(100 * (i + 1), 100 * (i + 1) + 10 + 3 * i)) for i in range(4)]
    expected = Engine(num_blocks=64, host_blocks=None).run(prompts)
    producer = Engine(num_blocks=64, host_blocks=64, disk_dir=str(tmp_path))
    consumer = Engine(num_blocks=64, host_blocks=64, disk_dir=str(tmp_path))
    blocks = [(len(p) - 1) // BLOCK for p in prompts]
    requests = [Request(f"r{i}", p, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), 512,
                        kv_transfer=KVTransfer(n, timeout=60)) for i, (p, n) in enumerate(zip(prompts, blocks))]
    for r in requests:
        consumer.scheduler.add(r)
    for _ in range(3):
        consumer.step()
    assert all(r.status == RequestStatus.WAITING_FOR_KV for r in requests) and consumer.computed == 0
    assert not consumer.scheduler.wants_idle()  # (waiting for another engine does not stall this one's steps)

    producer.run(prompts, max_tokens=1)
    producer.connector.flush()  # (the engine goes idle: the last blocks go out without another step)
    producer.worker.close()  # (the writer thread has written them)
    for _ in range(100):
        if not consumer.scheduler.has_unfinished():
            break
        consumer.step()
    assert [r.output_token_ids for r in requests] == expected
    assert consumer.computed == sum(len(p) - n * BLOCK for p, n in zip(prompts, blocks))
    stats = consumer.connector.stats()
    assert stats.transfers == {"arrived": 4} and stats.transfer_bytes == sum(blocks) * consumer.connector.block_bytes
    assert stats.hit_tokens["disk"] == sum(blocks) * BLOCK and stats.num_errors == 0
    assert_no_leak(consumer.kvcache)

    # blocks that never come: the request waits out its timeout, then computes its whole prompt
    late = Request("late", list(range(5000, 5013)), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                   512, kv_transfer=KVTransfer(3, timeout=0.05))
    computed = consumer.computed
    consumer.scheduler.add(late)
    consumer.step()
    assert late.status == RequestStatus.WAITING_FOR_KV
    time.sleep(0.06)
    for _ in range(20):
        consumer.step()
    assert late.is_finished and consumer.computed - computed == 13
    assert consumer.connector.stats().transfers == {"arrived": 4, "timed_out": 1}
    assert_no_leak(consumer.kvcache)


def test_the_config_names_what_disaggregation_needs(tmp_path):
    with pytest.raises(ConfigError, match=r"\[parallel\] prefill_engines = 1, decode_engines = 0: set both"):
        load_config(None, {"parallel.prefill_engines": 1})
    with pytest.raises(ConfigError, match=r"data_parallel_size = 2 with prefill_engines.*allowed: data_parallel"):
        load_config(None, {"parallel.prefill_engines": 1, "parallel.decode_engines": 1,
                           "parallel.data_parallel_size": 2})
    both = {"parallel.prefill_engines": 2, "parallel.decode_engines": 1}
    # no connector: the tiers connector on a new directory in shared memory, removed by the caller
    engines, directory = transfer_config(load_config(None, both))
    try:
        assert engines.connector.plugin == "tiers" and engines.connector.options.disk_dir == str(directory)
        assert directory.is_dir() and 0 < engines.connector.options.disk_gb <= 32
    finally:
        directory.rmdir()
    # the tiers connector with a directory of its own (or [parallel] kv_transfer_dir): that directory, kept
    mine = {**both, "connector.plugin": "tiers", "connector.disk_dir": str(tmp_path), "connector.host_gb": 0.5}
    engines, directory = transfer_config(load_config(None, mine))
    assert directory is None and engines.connector.options.disk_dir == str(tmp_path)
    assert engines.connector.options.host_gb == 0.5


def test_a_new_server_removes_the_transfer_directories_of_killed_ones(tmp_path):
    """A server killed by SIGKILL leaves its transfer directory behind (in shared memory: its blocks hold RAM); the
    next one to make a directory removes those whose process is gone, and keeps those of live processes."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"{TRANSFER_PREFIX}{dead.pid}-abc"
    (stale / "disk").mkdir(parents=True)
    (stale / "disk" / "block.bin").write_bytes(b"kv")
    live = tmp_path / f"{TRANSFER_PREFIX}{os.getpid()}-def"
    live.mkdir()
    unrelated = tmp_path / f"{TRANSFER_PREFIX}cache-ghi"
    unrelated.mkdir()
    assert remove_orphans(tmp_path) == [stale]
    assert not stale.exists() and live.is_dir() and unrelated.is_dir()
    # where the servers make them: transfer_config itself sweeps before it makes its own
    config = load_config(None, {"parallel.prefill_engines": 1, "parallel.decode_engines": 1})
    _, first = transfer_config(config)
    orphan = first.parent / f"{TRANSFER_PREFIX}{dead.pid}-jkl"
    orphan.mkdir()
    try:
        assert first.name.startswith(f"{TRANSFER_PREFIX}{os.getpid()}-")
        _, second = transfer_config(config)
        assert not orphan.exists() and first.is_dir() and second.is_dir()
        second.rmdir()
    finally:
        first.rmdir()
        shutil.rmtree(orphan, ignore_errors=True)


# ---------------------------------------------------------------- real servers: SmolLM2, one host

NUM_REQUESTS = 40
# more of the same mix, for the failure cases (prompts no engine has seen before them)
NUM_SPARE = 16
SYSTEM = "You are a careful assistant. Answer in one short sentence and use plain words. " * 3


def prompts() -> list[str]:
    """Mixed: a quarter long (a document to summarize), half sharing a system prompt, the rest short and
    distinct; every one longer than a block (each prefills on a prefill engine)."""
    mixed = []
    for i in range(NUM_REQUESTS + NUM_SPARE):
        question = CHAT_PROMPTS[i % len(CHAT_PROMPTS)]
        if i % 4 == 0:
            mixed.append(f"Document {i}: " + "The river rose in spring and the town moved to the hills. " * (6 + i % 5)
                         + "Summarize it.")
        elif i % 2:
            mixed.append(f"{SYSTEM}\nQuestion {i}: {question}\nAnswer:")
        else:
            mixed.append(f"Question {i}, asked by a student of history and of the natural sciences: {question}")
    return mixed


async def complete(server: Server, indices) -> dict[int, tuple[str, str] | int]:
    """Greedy completions of ``prompts()[i]`` for each index, all at once: (text, finish reason), or the HTTP
    status of an error."""
    texts = prompts()
    model = model_name(server)

    async def one(client: openai.AsyncOpenAI, i: int):
        try:
            response = await client.completions.create(model=model, prompt=texts[i], max_tokens=4 + i % 8,
                                                       temperature=0)
        except openai.APIStatusError as e:
            return i, e.status_code
        return i, (response.choices[0].text, response.choices[0].finish_reason)

    async with openai.AsyncOpenAI(base_url=f"{server.http}/v1", api_key="unused", max_retries=0,
                                  timeout=600) as client:
        return dict(await asyncio.gather(*(one(client, i) for i in indices)))


def serve(tmp_path, name: str, *overrides: str) -> Server:
    (tmp_path / name).mkdir()
    # batch-invariant kernels: a request's tokens do not depend on what it was batched with, nor on which engine
    # computed its prompt's KV
    return Server(http_config(), tmp_path / name,
                  overrides=["engine.num_threads=1", "engine.batch_invariant=true", *overrides]).start()


def engine_pid(server: Server, replica: int) -> int:
    return int(re.findall(rf"engine process (\d+) ready in [\d.]+ s \(replica {replica}\)", server.output)[-1])


def assert_every_block_free(server: Server, replicas) -> None:
    for r in map(str, replicas):
        server.wait_for(lambda r=r: server.metric("conveyor_kv_cache_free_blocks", replica=r)
                        == server.metric("conveyor_kv_cache_blocks", replica=r), what=f"replica {r}'s blocks free")


def transfers(server: Server, outcome: str) -> float:
    try:
        return server.metric("conveyor_kv_transfers_total", outcome=outcome)
    except KeyError:
        return 0.0


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    server = serve(tmp_path_factory.mktemp("colocated"), "one")
    try:
        return asyncio.run(complete(server, range(NUM_REQUESTS + NUM_SPARE)))
    finally:
        assert server.stop() == 0, server.output


@pytest.mark.slow
def test_two_prefill_engines_and_one_decode_engine_serve_the_greedy_tokens_of_one_engine(colocated, tmp_path):
    server = serve(tmp_path, "2p1d", "parallel.prefill_engines=2", "parallel.decode_engines=1")
    try:
        assert re.search(r"Prefill/decode: 2 prefill engines \(pids \d+, \d+\) and 1 decode engines", server.output)
        assert asyncio.run(complete(server, range(NUM_REQUESTS))) == {i: colocated[i] for i in range(NUM_REQUESTS)}
        # every prompt's blocks came from a prefill engine in time, and both prefill engines took prompts
        assert transfers(server, "arrived") == NUM_REQUESTS and transfers(server, "timed_out") == 0
        assert server.metric("conveyor_kv_tier_hit_tokens_total", tier="disk", replica="2") > 0
        assert all(server.metric("conveyor_replica_requests_total", replica=r) > 0 for r in "01")
        assert server.metric("conveyor_replica_requests_total", replica="2") == NUM_REQUESTS
        assert server.metric("conveyor_engine_role", replica="2", role="decode") == 1
        assert_every_block_free(server, range(3))
        assert server.metric("conveyor_role_requests_running", role="decode") == 0
    finally:
        assert server.stop() == 0, server.output


@pytest.mark.slow
def test_one_prefill_engine_killed_or_a_decode_engine_killed_loses_no_request(colocated, tmp_path):
    server = serve(tmp_path, "1p1d", "parallel.prefill_engines=1", "parallel.decode_engines=1")
    first = range(NUM_REQUESTS)
    try:
        assert asyncio.run(complete(server, first)) == {i: colocated[i] for i in first}
        assert transfers(server, "arrived") == len(first)
        assert_every_block_free(server, range(2))

        # the prefill engine killed with prompts on it (held still, so that none is done first): each is computed
        # on the decode engine, with the tokens it would have had
        held = range(NUM_REQUESTS, NUM_REQUESTS + 8)
        with ThreadPoolExecutor(1) as pool:
            os.kill(engine_pid(server, 0), signal.SIGSTOP)
            running = pool.submit(asyncio.run, complete(server, held))
            server.wait_for(lambda: server.metric("conveyor_replica_requests_in_flight", replica="0") == len(held),
                            what="the prompts on the held prefill engine")
            os.kill(engine_pid(server, 0), signal.SIGKILL)
            assert running.result(timeout=300) == {i: colocated[i] for i in held}
        assert transfers(server, "arrived") == len(first)  # (the decode engine waited for nothing)
        server.wait_for(lambda: server.metric("conveyor_engine_alive", replica="0") == 1, timeout=180,
                        what="the prefill engine to restart")

        # the decode engine killed with requests on it: they end with 503; after its restart, requests are served
        # (prefilled on the prefill engine again). (While no decode engine runs a new request gets 503: the
        # stand-in test above holds that still; here a fast restart would race it.)
        on_decode = range(NUM_REQUESTS + 8, NUM_REQUESTS + 12)
        with ThreadPoolExecutor(1) as pool:
            os.kill(engine_pid(server, 1), signal.SIGSTOP)
            running = pool.submit(asyncio.run, complete(server, on_decode))
            server.wait_for(lambda: server.metric("conveyor_replica_requests_in_flight", replica="1")
                            == len(on_decode), what="the requests on the held decode engine")
            os.kill(engine_pid(server, 1), signal.SIGKILL)
            assert running.result(timeout=300) == {i: 503 for i in on_decode}
        server.wait_for(lambda: server.metric("conveyor_engine_alive", replica="1") == 1, timeout=180,
                        what="the decode engine to restart")
        rest = range(NUM_REQUESTS + 12, NUM_REQUESTS + NUM_SPARE)
        assert asyncio.run(complete(server, rest)) == {i: colocated[i] for i in rest}
        assert transfers(server, "arrived") > len(first) and transfers(server, "timed_out") == 0
        assert_every_block_free(server, range(2))
    finally:
        assert server.stop() == 0, server.output
