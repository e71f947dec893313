"""The ``tiers`` KV connector without a model: a fake forward pass writes into a real pool (``KVStorage``) the
keys and values a function of each position's tokens gives, and checks, before every step, that every position
a request has computed (by itself, shared from the prefix cache, or loaded from a tier) holds exactly that.
The connector's worker side runs in-process over that pool, as a worker runs it."""

from __future__ import annotations

import logging
import os
import struct
import time
from types import SimpleNamespace

import pytest
import torch

from conveyor.attention.storage import KVStorage
from conveyor.config import ConfigError, load_config
from conveyor.connector import build_connector
from conveyor.kvcache import KVCacheSpec
from conveyor.messages import ConnectorStats, EngineReady, KVCacheStats, SchedulerStats, StepStats
from conveyor.plugins.connector.tier_store import HEADER, TierWorker, block_dir
from conveyor.plugins.connector.tiers import TieredConnector, TiersOptions
from conveyor.plugins.kvcache.paged import PagedKVCache, PagedOptions, block_digest
from conveyor.plugins.schedulers.continuous import ContinuousOptions, ContinuousScheduler
from conveyor.plugins.schedulers.static import StaticOptions, StaticScheduler
from conveyor.registry import PluginRegistry
from conveyor.request import Request
from conveyor.sampling import SamplingParams
from conveyor.serving.metrics import ServerMetrics
from tests.factories import assert_no_leak, next_token, ran

BLOCK = 4
SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", max_model_len=512)
BLOCK_BYTES = BLOCK * SPEC.bytes_per_token


def expected_kv(tokens: list[int], position: int) -> torch.Tensor:
    """The fake model's key (and, negated, value) at ``position``: [layers, kv_heads, head_dim], a function of
    every token up to it."""
    seed = hash(tuple(tokens[: position + 1])) % 2**31
    return torch.rand(SPEC.num_layers, SPEC.num_kv_heads, SPEC.head_dim, generator=torch.Generator().manual_seed(seed))


class Engine:
    """A scheduler, a paged pool with the tiers, and the pool's tensors, stepped by a fake model."""

    def __init__(self, num_blocks: int, host_blocks: int | None, disk_dir: str = "", disk_blocks: int = 1000,
                 fingerprint: str = "f" * 24, max_num_seqs: int = 256, ranks: int = 1, static: bool = False):
        self.kvcache = PagedKVCache(PagedOptions(block_size=BLOCK, num_blocks=num_blocks), SPEC)
        self.storage = KVStorage(self.kvcache.layout, torch.device("cpu"))
        if static:  # (batches run to completion)
            self.scheduler = StaticScheduler(StaticOptions(max_num_batched_tokens=64, batch_size=max_num_seqs,
                                                           max_wait_ms=0), self.kvcache, 512)
        else:
            self.scheduler = ContinuousScheduler(ContinuousOptions(max_num_batched_tokens=64,
                                                                   max_num_seqs=max_num_seqs), self.kvcache, 512)
        self.connector = self.worker = None
        if host_blocks is not None:
            options = TiersOptions(host_gb=host_blocks * BLOCK_BYTES / 2**30, disk_dir=disk_dir,
                                   disk_gb=disk_blocks * BLOCK_BYTES / 2**30)
            self.connector = TieredConnector(options, self.kvcache.layout, fingerprint,
                                             lambda payload: [worker.call(payload) for worker in self.workers])
            # (tensor parallelism's workers, each with its rank's files: here over the same pool)
            self.workers = [TierWorker(options, self.storage, rank, self.connector.setup) for rank in range(ranks)]
            self.worker = self.workers[0]
            self.kvcache.attach(self.connector)
            self.scheduler.add_gate(self.connector)
        self.computed = 0  # prompt tokens the fake model computed

    def step(self) -> list:
        refused = self.scheduler.release(idle=True)
        batch = self.scheduler.schedule()
        if self.connector is not None and (payload := self.connector.take_payload()):
            for worker in self.workers:
                worker.apply(payload)
        sampled = []
        for request, n in zip(batch.requests, batch.num_tokens):
            tokens, start = request.all_token_ids(), request.num_computed_tokens
            blocks = self.kvcache.block_ids(request)
            for position in range(start + n):
                slot = blocks[position // BLOCK] * BLOCK + position % BLOCK
                if position < start:  # (what the step's attention would read: computed before, or loaded)
                    got = self.storage.k[:, :, slot]
                    assert torch.equal(got, expected_kv(tokens, position)), (request.request_id, position)
                    assert torch.equal(self.storage.v[:, :, slot], -got)
                else:
                    self.storage.k[:, :, slot] = expected_kv(tokens, position)
                    self.storage.v[:, :, slot] = -expected_kv(tokens, position)
            self.computed += min(n, max(request.num_prompt_tokens - start, 0))
            sampled.append(next_token(request) if start + n == request.num_tokens else None)
        return refused + ran(self.scheduler, batch, sampled)

    def run(self, prompts: list[list[int]], max_tokens: int = 3) -> list[list[int]]:
        """Serve the prompts together; each one's output tokens."""
        requests = [Request(f"q{id(prompt)}-{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                          ignore_eos=True), 512)
                    for i, prompt in enumerate(prompts)]
        for request in requests:
            self.scheduler.add(request)
        for _ in range(1000):
            if not self.scheduler.has_unfinished():
                return [r.output_token_ids for r in requests]
            self.step()
        raise AssertionError("not finished")


def conversations(engine: Engine, num: int = 6, turns: int = 3, system: int = 24) -> list[list[int]]:
    """``num`` chats with distinct system prompts, ``turns`` turns each, every turn resending the history with
    the reply and a new message; the replies, in order."""
    histories = [list(range(1000 * (c + 1), 1000 * (c + 1) + system)) for c in range(num)]
    replies = []
    for turn in range(turns):
        for c, history in enumerate(histories):
            history += [7 + turn, 8 + c, 9]
            (reply,) = engine.run([history])
            history += reply
            replies.append(reply)
    return replies


def test_histories_the_pool_evicted_come_back_from_the_host_tier_with_the_keys_and_values_they_had():
    plain, tiered = Engine(num_blocks=16, host_blocks=None), Engine(num_blocks=16, host_blocks=256)
    assert conversations(tiered) == conversations(plain)
    stats = tiered.connector.stats()
    assert stats.hit_tokens["host"] > 0 and stats.hit_tokens["disk"] == 0
    assert tiered.computed + stats.hit_tokens["host"] == plain.computed
    assert tiered.kvcache.stats().num_prefix_hit_tokens - plain.kvcache.stats().num_prefix_hit_tokens \
        == stats.hit_tokens["host"]
    assert stats.read_bytes["host"] == stats.hit_tokens["host"] // BLOCK * BLOCK_BYTES
    assert_no_leak(tiered.kvcache)


def test_a_load_from_a_host_slot_that_lacks_the_block_is_reported_and_leaves_the_device_block_alone():
    """A worker whose host slot does not hold the block a load asks for (its copy lost) copies nothing into the
    pool and names the block from ``apply``; told so (``load_failed``), the scheduler side drops the block from
    the host tier and counts an error. A load its slot does hold is copied and not named."""
    engine = Engine(num_blocks=16, host_blocks=64)
    prompt = list(range(500, 524))
    engine.run([prompt])
    first, second = engine.kvcache.prefix_digests(Request("p", prompt + [1], SamplingParams(), 512))[:2]
    engine.worker.slot_keys[engine.connector.host[first]] = b""
    block = engine.kvcache.num_blocks - 1
    rows = slice(block * BLOCK, (block + 1) * BLOCK)
    engine.storage.k[:, :, rows] = 7.0
    engine.connector.load(first, block)
    assert engine.worker.apply(engine.connector.take_payload()) == [block]
    assert bool((engine.storage.k[:, :, rows] == 7.0).all())
    engine.connector.load_failed(first, block)
    assert first not in engine.connector.host and engine.connector.stats().num_errors == 1
    engine.connector.load(second, block)
    assert engine.worker.apply(engine.connector.take_payload()) == []
    for offset in range(BLOCK):
        assert torch.equal(engine.storage.k[:, :, block * BLOCK + offset], expected_kv(prompt, BLOCK + offset))


def test_a_host_tier_smaller_than_the_histories_drops_the_least_recent_blocks_and_stays_exact():
    small, large = Engine(num_blocks=12, host_blocks=20), Engine(num_blocks=12, host_blocks=256)
    assert conversations(small, num=2, turns=4) == conversations(large, num=2, turns=4)
    stats = small.connector.stats()
    assert stats.blocks["host"] == 20 and stats.written_bytes["host"] > 20 * BLOCK_BYTES  # (full, and it dropped)
    assert 0 < stats.hit_tokens["host"] <= large.connector.stats().hit_tokens["host"]


def test_a_waiting_request_keeps_the_host_copies_of_its_prefix_while_others_run():
    """The pool has lost P's blocks, the host tier holds them; A (P's prompt and more) waits behind X, whose
    blocks would push P's out of the host tier (its least recently used): A keeps them, and loads them."""
    engine = Engine(num_blocks=12, host_blocks=20, max_num_seqs=1)
    p = list(range(500, 524))
    for prompt in (p, list(range(600, 624)), list(range(700, 724))):  # (6 blocks each: P's leave the pool)
        engine.run([prompt])
    assert not engine.kvcache.is_cached(engine.kvcache.prefix_digests(Request("p", p + [1], SamplingParams(), 512))[0])
    before = engine.connector.stats().hit_tokens["host"]
    engine.run([list(range(800, 830)), p + [1, 2, 3]], max_tokens=8)  # (X first, then A, one at a time)
    assert engine.connector.stats().hit_tokens["host"] - before == 24  # (P's six blocks)
    assert not engine.connector.pinned and not engine.connector.pins


def test_the_disk_tier_survives_a_restart_and_skips_truncated_corrupt_and_foreign_files(tmp_path, caplog):
    first = Engine(num_blocks=16, host_blocks=256, disk_dir=str(tmp_path))
    replies = conversations(first, turns=2)
    first.worker.close()  # (as a worker that stops: its queued writes finish)
    files = sorted(block_dir(str(tmp_path), "f" * 24, 0).glob("*.kv"))
    assert len(files) == first.connector.stats().blocks["disk"] > 6
    assert all(f.stat().st_size == HEADER.size + BLOCK_BYTES for f in files)

    # a server that starts again finds the blocks on disk: the same histories load instead of computing
    again = Engine(num_blocks=16, host_blocks=256, disk_dir=str(tmp_path))
    assert again.connector.stats().blocks["disk"] == len(files)
    assert conversations(again, turns=2) == replies
    stats = again.connector.stats()
    assert stats.hit_tokens["disk"] > 0 and stats.num_errors == 0
    assert again.computed < first.computed

    # the first blocks of three chats: one file cut short, one with a flipped byte, one from another model
    directory = block_dir(str(tmp_path), "f" * 24, 0)
    truncated, corrupt, foreign = (directory / f"{block_digest(b'', list(range(1000 * c, 1000 * c + 4))).hex()}.kv"
                                   for c in (1, 2, 3))
    truncated.write_bytes(truncated.read_bytes()[:-5])
    data = bytearray(corrupt.read_bytes())
    data[HEADER.size + 3] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    data = bytearray(foreign.read_bytes())
    struct.pack_into("32s", data, 6, b"e" * 24)
    foreign.write_bytes(bytes(data))
    caplog.set_level(logging.WARNING, logger="conveyor")
    third = Engine(num_blocks=16, host_blocks=256, disk_dir=str(tmp_path))
    assert conversations(third, turns=2) == replies  # (every position still checked against the fake model)
    assert third.connector.stats().num_errors == 3
    warnings = "\n".join(r.getMessage() for r in caplog.records if "KV disk tier: skipped" in r.getMessage())
    assert "truncated" in warnings and "corrupt (checksum mismatch)" in warnings
    assert "written for another model" in warnings
    assert third.computed > again.computed


def test_engines_on_one_directory_find_the_blocks_the_other_wrote_after_they_started(tmp_path):
    """Two engines (data-parallel replicas) started together on one disk directory: the histories one computed
    are read by the other from disk, and their replies are the same."""
    one = Engine(num_blocks=16, host_blocks=64, disk_dir=str(tmp_path))
    other = Engine(num_blocks=16, host_blocks=64, disk_dir=str(tmp_path))
    replies = conversations(one, turns=2)
    one.worker.close()
    assert other.connector.stats().blocks["disk"] == 0  # (it indexed the directory before they were written)
    assert conversations(other, turns=2) == replies
    assert other.connector.stats().hit_tokens["disk"] > 0 and other.computed < one.computed


def test_batches_run_to_completion_wait_for_the_blocks_the_disk_tier_fetches(tmp_path):
    """The static scheduler (whose batches are admitted as a whole) on a disk tier another engine wrote: a batch
    member whose prefix is on disk waits at the connector's gate while it is read, then runs; the replies are
    those of the engine that computed them."""
    first = Engine(num_blocks=16, host_blocks=64, disk_dir=str(tmp_path))
    replies = conversations(first, turns=2)
    first.worker.close()
    batched = Engine(num_blocks=64, host_blocks=64, disk_dir=str(tmp_path), static=True, max_num_seqs=2)
    assert conversations(batched, turns=2) == replies
    assert batched.connector.stats().hit_tokens["disk"] > 0 and batched.computed < first.computed
    assert_no_leak(batched.kvcache)


def test_with_several_workers_a_block_is_on_disk_only_when_every_ranks_file_is(tmp_path):
    """Two workers (tensor parallelism) each write their rank's file of every block. A block one rank's file is
    missing for (a prefill engine's write not done yet, a file removed) is not indexed at start-up nor found
    later: it is computed, not fetched and failed on that rank; the replies are the same."""
    first = Engine(num_blocks=16, host_blocks=256, disk_dir=str(tmp_path), ranks=2)
    replies = conversations(first, turns=2)
    for worker in first.workers:
        worker.close()
    rank0, rank1 = (block_dir(str(tmp_path), "f" * 24, rank) for rank in (0, 1))
    names = sorted(p.name for p in rank0.glob("*.kv"))
    assert names == sorted(p.name for p in rank1.glob("*.kv")) and len(names) > 6
    missing = names[::2]
    for name in missing:
        (rank1 / name).unlink()
    again = Engine(num_blocks=16, host_blocks=256, disk_dir=str(tmp_path), ranks=2)
    assert again.connector.stats().blocks["disk"] == len(names) - len(missing)
    (rank1 / names[1]).unlink()  # (after start-up: indexed, so fetched, failed on rank 1 and computed)
    assert conversations(again, turns=2) == replies
    stats = again.connector.stats()
    assert stats.hit_tokens["disk"] > 0 and stats.num_errors <= 1
    assert_no_leak(again.kvcache)


def test_start_up_removes_old_files_of_blocks_a_rank_lacks_and_left_temporary_files(tmp_path):
    """What no index holds would never be trimmed: a block's files some rank lacks (on rank 0 only, or on rank 1
    only) and temporary files a stopped writer left go at start-up once an hour old; newer ones stay (another
    engine on the directory may be writing them); whole blocks stay indexed."""
    first = Engine(num_blocks=16, host_blocks=256, disk_dir=str(tmp_path), ranks=2)
    conversations(first, turns=2)
    for worker in first.workers:
        worker.close()
    rank0, rank1 = (block_dir(str(tmp_path), "f" * 24, rank) for rank in (0, 1))
    names = sorted(p.name for p in rank0.glob("*.kv"))
    only0, only1, recent = names[0], names[1], names[2]
    for rank, name in ((rank1, only0), (rank0, only1), (rank1, recent)):
        (rank / name).unlink()
    left = rank1 / "abc.tmp"
    left.write_bytes(b"half a block")
    hour_ago = time.time() - 2 * 3600
    for path in (rank0 / only0, rank1 / only1, left):
        os.utime(path, (hour_ago, hour_ago))
    again = Engine(num_blocks=16, host_blocks=256, disk_dir=str(tmp_path), ranks=2)
    assert not (rank0 / only0).exists() and not (rank1 / only1).exists() and not left.exists()
    assert (rank0 / recent).exists()  # (written just now: perhaps a write under way)
    assert again.connector.stats().blocks["disk"] == len(names) - 3


def test_a_rank_directory_that_cannot_be_listed_removes_nothing(tmp_path, monkeypatch):
    """Unlisted, a rank's directory would make every block look incomplete: nothing is removed then."""
    from conveyor.plugins.connector import tiers

    first = Engine(num_blocks=16, host_blocks=256, disk_dir=str(tmp_path), ranks=2)
    conversations(first, turns=1)
    for worker in first.workers:
        worker.close()
    rank0, rank1 = (block_dir(str(tmp_path), "f" * 24, rank) for rank in (0, 1))
    kept = sorted(rank0.glob("*.kv"))
    hour_ago = time.time() - 2 * 3600
    for path in kept:
        os.utime(path, (hour_ago, hour_ago))
    scandir = os.scandir

    def refused(path):
        if str(path) == str(rank1):
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(tiers.os, "scandir", refused)
    assert tiers._remove_orphans(rank0.parent, time.time()) == 0
    assert sorted(rank0.glob("*.kv")) == kept and kept


def test_another_fingerprint_finds_nothing_and_the_disk_budget_drops_the_oldest_files(tmp_path):
    first = Engine(num_blocks=16, host_blocks=256, disk_dir=str(tmp_path), disk_blocks=10)
    conversations(first, turns=2)
    first.worker.close()
    directory = block_dir(str(tmp_path), "f" * 24, 0)
    assert len(list(directory.glob("*.kv"))) == first.connector.stats().blocks["disk"] == 10
    smaller = Engine(num_blocks=16, host_blocks=256, disk_dir=str(tmp_path), disk_blocks=4)  # (a lower budget)
    smaller.worker.apply(smaller.connector.take_payload())
    smaller.worker.close()
    assert len(list(directory.glob("*.kv"))) == smaller.connector.stats().blocks["disk"] == 4
    other = Engine(num_blocks=16, host_blocks=256, disk_dir=str(tmp_path), fingerprint="e" * 24)
    assert other.connector.stats().blocks["disk"] == 0
    conversations(other, turns=1)
    assert other.connector.stats().hit_tokens == {"host": 0, "disk": 0}


@pytest.mark.parametrize("host_blocks", [None, 64])
def test_preemption_under_the_tiers_recomputes_exactly(host_blocks):
    engine = Engine(num_blocks=10, host_blocks=host_blocks)
    prompts = [list(range(100 * (i + 1), 100 * (i + 1) + 13)) for i in range(4)]
    outputs = engine.run(prompts, max_tokens=12)
    assert outputs == Engine(num_blocks=64, host_blocks=None).run(prompts, max_tokens=12)
    assert engine.scheduler.stats().num_preemptions > 0
    assert_no_leak(engine.kvcache)


def test_the_tiers_reach_metrics_as_increments_and_a_restarted_engine_counts_from_zero():
    metrics = ServerMetrics("m")

    def step(hits: int, errors: int) -> None:
        connector = ConnectorStats(blocks={"host": 5, "disk": 9}, capacity_blocks={"host": 10, "disk": 20},
                                   hit_tokens={"host": hits, "disk": 2 * hits}, read_bytes={"host": 10 * hits},
                                   num_errors=errors)
        metrics.engine_step(StepStats(1, 0.0, SchedulerStats(), KVCacheStats(), connector=connector))

    def value(name: str, **labels) -> float:
        return metrics.registry.get_sample_value(name, {"model_name": "m", **labels})

    step(hits=4, errors=1)
    step(hits=6, errors=1)
    metrics.engine_ready(EngineReady(1, 64, 8, 4, 1.0, 0.0))  # (a new engine: its counters start again)
    step(hits=3, errors=2)
    assert value("conveyor_kv_tier_hit_tokens_total", tier="host") == 6 + 3
    assert value("conveyor_kv_tier_hit_tokens_total", tier="disk") == 12 + 6
    assert value("conveyor_kv_tier_read_bytes_total", tier="host") == 60 + 30
    assert value("conveyor_kv_tier_errors_total") == 1 + 2
    assert value("conveyor_kv_tier_blocks", tier="disk") == 9
    assert value("conveyor_kv_tier_capacity_blocks", tier="host") == 10


def test_a_connector_needs_a_layout_that_finds_blocks_by_digest_and_no_draft_model(tmp_path):
    toml = tmp_path / "server.toml"
    toml.write_text('[connector]\nplugin = "tiers"\n\n[engine]\nspeculative = "draft"\ndraft_model = "m"\n')
    config = load_config(toml)
    with pytest.raises(ConfigError, match=r"server.toml: \[connector\] plugin = 'tiers' cannot run with \[engine\] "
                                          r"speculative = 'draft'.*allowed with it: speculative = 'off' or 'ngram'"):
        build_connector(config, PluginRegistry.of(config), None, Engine(4, None).kvcache, None)
    plain = load_config(None, {"connector.plugin": "tiers", "kvcache.plugin": "contiguous"})
    contiguous = PluginRegistry.of(plain).build("kvcache", plain.kvcache, SPEC)
    with pytest.raises(ConfigError, match=r"\[kvcache\] plugin = 'contiguous' cannot use a KV connector.*allowed "
                                          r"with one: a layout with prefix caching"):
        build_connector(plain, PluginRegistry.of(plain), None, contiguous, SimpleNamespace(weight_bytes=0))
    uncached = PagedKVCache(PagedOptions(block_size=BLOCK, num_blocks=8, enable_prefix_caching=False), SPEC)
    with pytest.raises(ValueError, match="needs \\[kvcache\\] enable_prefix_caching = true"):
        uncached.attach(Engine(4, 8).connector)


def test_blocks_reach_the_disk_tier_while_waiting_requests_keep_the_host_tier(tmp_path):
    """Requests waiting behind one another keep their prefixes' host copies (at most half the tier): the
    blocks the running ones compute still get host slots, and every one reaches the disk."""
    engine = Engine(num_blocks=16, host_blocks=8, disk_dir=str(tmp_path), max_num_seqs=1)
    firsts = [list(range(100 * i, 100 * i + 24)) for i in range(1, 5)]
    engine.run(firsts)
    # new prompts first: they run while the returning ones wait, keeping their prefixes' host copies
    seconds = [list(range(100 * i, 100 * i + 24)) for i in range(5, 9)] + [p + [1, 2, 3, 4] for p in firsts]
    engine.run(seconds)
    engine.worker.close()
    on_disk = {bytes.fromhex(p.stem) for p in block_dir(str(tmp_path), "f" * 24, 0).glob("*.kv")}
    for prompt in firsts + seconds:
        assert set(engine.kvcache.prefix_digests(Request("x", prompt, SamplingParams(), 512))) <= on_disk
    assert engine.connector.stats().blocks["host"] == 8 and engine.connector.stats().hit_tokens["host"] > 0
