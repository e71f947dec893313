"""KV connectors with the real SmolLM2: multi-turn chats on a pool too small for their histories give the
same greedy tokens with the tiers off, with the host tier, and after a restart from the disk tier (in a worker
process of its own), through the example third-party connector package, and through a connector that fails
to load blocks; the counters say where the prefixes came from."""

from __future__ import annotations

import importlib
import subprocess
import sys
import time

import msgspec
import pytest

from conveyor.hookspecs import hookimpl
from conveyor.entrypoints.llm import LLM
from conveyor.plugins.connector.tier_store import LOAD, TierWorker
from conveyor.plugins.connector.tiers import TieredConnector
from conveyor.sampling import SamplingParams
from tests.conftest import REPO
from tests.factories import assert_no_leak

POOL = {"kvcache.num_blocks": 24, "kvcache.block_size": 16}
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def chat(llm: LLM, num: int = 4, turns: int = 3) -> list[list[int]]:
    """``num`` conversations with distinct long system prompts, ``turns`` turns each, every turn resending
    the history with the reply and a new question; every reply's token ids, in order."""
    histories = [llm.encode(f"You are assistant number {c}. " + f"Rule {c}: answer briefly and kindly. " * 12)
                 for c in range(num)]
    replies = []
    for turn in range(turns):
        for history in histories:
            history += llm.encode(f" Question {turn}: what is {turn} plus {len(history)}?")
            (completion,) = llm.generate([history], GREEDY)
            history += completion.token_ids
            replies.append(completion.token_ids)
    return replies


@pytest.fixture(scope="module")
def plain_replies():
    with LLM(overrides=POOL) as llm:
        return chat(llm)


def test_the_host_and_disk_tiers_load_evicted_histories_and_the_replies_do_not_change(plain_replies, tmp_path):
    tiers = {**POOL, "connector.plugin": "tiers", "connector.host_gb": 0.1, "connector.disk_dir": str(tmp_path)}
    with LLM(overrides=tiers) as llm:
        assert chat(llm) == plain_replies
        stats = llm.engine.connector.stats()
        assert stats.hit_tokens["host"] > 0 and stats.hit_tokens["disk"] == 0 and stats.num_errors == 0
        assert stats.blocks["disk"] == stats.blocks["host"] > POOL["kvcache.num_blocks"]
    # a new engine, its worker in a process of its own, finds the histories on disk
    with LLM(overrides={**tiers, "parallel.executor": "mp"}) as llm:
        assert chat(llm) == plain_replies
        stats = llm.engine.connector.stats()
        assert stats.hit_tokens["disk"] > 0 and stats.num_errors == 0


def test_a_third_party_connector_package_serves_the_same_replies_across_a_restart(plain_replies, tmp_path,
                                                                                   monkeypatch):
    """examples/conveyor-kv-sqlite, pip-installed and found through its entry point: the histories the pool
    lost come back from its SQLite file, in the first server and in a second one on the same file."""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(REPO / "examples" / "conveyor-kv-sqlite")],
                   check=True, capture_output=True, timeout=300)
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    sqlite = {**POOL, "connector.plugin": "sqlite", "connector.path": str(tmp_path / "kv.sqlite")}
    hits = []
    for _ in range(2):
        with LLM(overrides=sqlite) as llm:
            assert type(llm.engine.connector).__module__ == "conveyor_kv_sqlite"
            assert chat(llm) == plain_replies
            hits.append(llm.engine.connector.stats().hit_tokens["sqlite"])
    assert 0 < hits[0] < hits[1]  # (the second server finds every history's blocks, its first turns' too)


class FlakyTierWorker(TierWorker):
    """The host tier's worker side, failing the second, fourth, ... block of each step's loads: it fills the
    block with noise (what a store that lost or mangled it might leave there) and says so."""

    def apply(self, payload: bytes) -> list[int]:
        failed = list(super().apply(payload) or [])
        ops = msgspec.msgpack.decode(payload, type=list[tuple[int, int, int, bytes]])
        for block in [block for kind, block, _, _ in ops if kind == LOAD][1::2]:
            for tensor in self._blocks(block):
                tensor.normal_(0.0, 100.0)
            failed.append(block)
        return failed


class FlakyTiers(TieredConnector):
    name = "flaky-tiers"
    Worker = FlakyTierWorker


@hookimpl
def conveyor_register_connectors(register):
    register(FlakyTiers)


@pytest.mark.parametrize("setup", [{}, {"engine.async_scheduling": "on"},
                                   {"scheduler.plugin": "static", "scheduler.max_wait_ms": 0}],
                         ids=["continuous", "steps overlapped", "static"])
def test_blocks_the_worker_side_cannot_load_are_computed_and_the_replies_do_not_change(setup, plain_replies,
                                                                                        tmp_path):
    """A connector (this module's, named in the config's plugins) whose worker side fails half the blocks it
    loads: the engine computes them, and what follows them, instead of reading the noise left there; the
    requests keep the blocks loaded before them. Also under async scheduling (no step goes on top of one that
    loads) and with a scheduler that runs batches to completion (which takes the requests back too). The
    replies are those without a connector, failures and hits were both counted, and no block is left held."""
    config = tmp_path / "flaky.toml"
    config.write_text('plugins = ["tests.test_kv_tiers_serving"]\n\n[connector]\nplugin = "flaky-tiers"\n'
                      'host_gb = 0.1\n')
    with LLM(config, overrides={**POOL, **setup}) as llm:
        assert type(llm.engine.connector) is FlakyTiers
        assert chat(llm) == plain_replies
        stats = llm.engine.connector.stats()
        assert stats.num_errors > 0 and stats.hit_tokens["host"] > stats.num_errors * POOL["kvcache.block_size"]
        assert llm.engine.scheduler.stats().num_preemptions > 0  # (each request that read one started over)
        assert_no_leak(llm.engine.kvcache)


@pytest.mark.parametrize("ending", ["abort", "stop token, steps overlapped"])
def test_the_blocks_of_the_last_request_reach_the_disk_without_another_request(ending, tmp_path):
    """A 78-token prompt's fifth block fills at its third step. The request then ends: aborted there (as the
    frontend does on a stop string), or by a stop token sampled there under async scheduling (a step scheduled
    ahead is in flight). With nothing else to run, the engine still carries out the connector's work: all five
    blocks reach the disk tier (the fifth was left for a next request that might never come)."""
    from conveyor.config import load_config
    from conveyor.engine.core import EngineCore
    from conveyor.messages import EngineRequest, MessageType

    overlapped = ending != "abort"
    prompt = list(range(300, 378))
    with LLM() as llm:  # (the tokens it gives: the third, as a stop token, ends the request there)
        (probe,) = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0))
    assert len(set(probe.token_ids)) == 3
    config = load_config(None, {"connector.plugin": "tiers", "connector.host_gb": 0.1,
                                "connector.disk_dir": str(tmp_path), "kvcache.block_size": 16,
                                "engine.async_scheduling": "on" if overlapped else "off"})
    engine = EngineCore(config)
    try:
        stop = [probe.token_ids[2]] if overlapped else []
        engine.add_request(EngineRequest("last", prompt, SamplingParams(max_tokens=50, temperature=0,
                                                                        stop_token_ids=stop)))
        got = []
        while engine.has_unfinished():
            got += [t for output in engine.step()[0] for t in output.new_token_ids]
            if not overlapped and len(got) == 3:
                engine.apply([(MessageType.ABORT, ["last"])])
                break
        assert got == probe.token_ids
        deadline = time.monotonic() + 60  # (a thread of the worker's writes the files)
        while len(list(tmp_path.rglob("*.kv"))) < 5 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(list(tmp_path.rglob("*.kv"))) == 5
    finally:
        engine.shutdown()
