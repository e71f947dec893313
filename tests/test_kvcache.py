"""Block allocation: prefix caching (sharing, LRU eviction, ref counts) and contiguous slabs."""

from __future__ import annotations

import pytest

from conveyor.plugins.kvcache.contiguous import ContiguousKVCache, ContiguousOptions
from conveyor.plugins.schedulers.continuous import ContinuousOptions, ContinuousScheduler
from conveyor.request import Request
from conveyor.sampling import SamplingParams
from tests.factories import assert_no_leak, create_kvcache, create_request, create_spec, fake_step, run_to_completion


def test_a_shared_prefix_is_computed_once_and_outputs_do_not_change():
    def run(prefix_caching: bool):
        kvcache = create_kvcache(num_blocks=64, block_size=4)
        kvcache.options.enable_prefix_caching = prefix_caching
        scheduler = ContinuousScheduler(ContinuousOptions(), kvcache, 256)
        system = list(range(900, 930))  # 30 shared tokens = 7 full blocks + 2
        first = create_request(1, max_tokens=5, request_id="first")
        first.prompt_token_ids = system + [1, 2, 3]
        scheduler.add(first)
        run_to_completion(scheduler)
        second = create_request(1, max_tokens=5, request_id="second")
        second.prompt_token_ids = system + [7, 8]
        scheduler.add(second)
        batch, _ = fake_step(scheduler)
        computed = dict(zip([r.request_id for r in batch.requests], batch.num_tokens))["second"]
        run_to_completion(scheduler)
        assert_no_leak(kvcache)
        return second, computed, kvcache

    cached, computed_cached, kvcache = run(True)
    plain, computed_plain, _ = run(False)
    assert cached.num_cached_tokens == 28 and plain.num_cached_tokens == 0
    assert (computed_plain, computed_cached) == (32, 4)
    assert cached.output_token_ids == plain.output_token_ids
    assert kvcache.stats().num_prefix_hit_tokens == 28


def test_a_whole_cached_prompt_still_computes_its_last_token():
    kvcache = create_kvcache(num_blocks=16, block_size=4)
    scheduler = ContinuousScheduler(ContinuousOptions(), kvcache, 256)
    a, b = create_request(8, max_tokens=1), create_request(8, max_tokens=1)
    scheduler.add(a)
    run_to_completion(scheduler)
    scheduler.add(b)
    batch, _ = fake_step(scheduler)
    assert b.num_cached_tokens == 4 and batch.num_tokens == [4]
    assert b.output_token_ids == a.output_token_ids


def test_eviction_takes_the_least_recently_freed_block_and_never_one_in_use():
    kvcache = create_kvcache(num_blocks=6, block_size=4)
    old, recent, holder = (create_request(9, request_id=n) for n in ("old", "recent", "holder"))
    recent.prompt_token_ids = list(range(100, 109))
    for request in (old, recent):
        assert kvcache.allocate(request, 8)
        request.num_computed_tokens = 8
        kvcache.free(request)  # 2 cached blocks each, now free
    assert kvcache.stats().num_cached_blocks == 4
    holder.prompt_token_ids = recent.prompt_token_ids
    match = kvcache.match_prefix(holder)
    assert match.num_tokens == 8
    assert kvcache.allocate(holder, 1, match)  # revives recent's 2 blocks, takes 1 fresh
    # 3 blocks left free: old's two (oldest) go first, then nothing else is evictable
    newcomer = create_request(12, request_id="new")
    assert kvcache.allocate(newcomer, 12)
    assert kvcache.match_prefix(create_request(9, request_id="again")).num_tokens == 0  # old's blocks are gone
    assert set(kvcache.block_ids(holder)[:2]).isdisjoint(kvcache.block_ids(newcomer))
    assert not kvcache.allocate(create_request(4, request_id="x"), 4)  # holder's blocks are in use
    kvcache.free(holder)
    kvcache.free(newcomer)
    assert_no_leak(kvcache)


def test_contiguous_reserves_whole_slabs_and_reports_the_unused_part():
    spec = create_spec(max_model_len=64)
    kvcache = ContiguousKVCache(ContiguousOptions(num_tokens=160), spec)  # 10 granules of 16
    requests = [create_request(10, max_tokens=5, max_model_len=64) for _ in range(3)]
    assert kvcache.allocate(requests[0], 10) and kvcache.allocate(requests[1], 10)
    assert not kvcache.allocate(requests[2], 10)  # 2 x 64 reserved; 32 left, a slab needs 64
    stats = kvcache.stats()
    assert stats.reserved_tokens == 128 and stats.used_tokens == 20
    kvcache.free(requests[0])
    assert kvcache.allocate(requests[2], 10)
    per_request = ContiguousKVCache(ContiguousOptions(num_tokens=160, reserve="request"), spec)
    assert all(per_request.allocate(r, 10) for r in requests)  # 15 tokens -> one granule each
    assert per_request.stats().reserved_tokens == 48


def test_a_contiguous_cache_smaller_than_one_max_model_len_slab_is_refused_at_start():
    """Reserving max_model_len a request, a cache that holds less could run nothing: said at start-up, naming
    what would fix it, rather than refusing every request after (as "needs 18 tokens, holds 112")."""
    spec = create_spec(max_model_len=64)
    with pytest.raises(ValueError, match=r"holds 48 tokens, less than one slab of max_model_len \(64 tokens"):
        ContiguousKVCache(ContiguousOptions(num_tokens=48), spec)
    assert ContiguousKVCache(ContiguousOptions(num_tokens=48, reserve="request"), spec).num_blocks == 3
    assert ContiguousKVCache(ContiguousOptions(num_tokens=64), spec).num_blocks == 4


def test_a_sliding_window_bounds_the_blocks_a_request_holds():
    """Window 10, blocks of 4: a request that grows to 120 tokens never holds more than the blocks its window
    and this step's tokens touch; its table points the blocks behind it at the spare block; a second request
    with the same prompt still finds the prompt's blocks in the prefix cache; nothing leaks."""
    window, size = 10, 4
    kvcache = create_kvcache(num_blocks=40, block_size=size, sliding_window=window)
    scheduler = ContinuousScheduler(ContinuousOptions(max_num_batched_tokens=8), kvcache, 256)
    first = create_request(30, max_tokens=90, request_id="first")
    scheduler.add(first)
    most = 0
    while scheduler.has_unfinished():
        batch, _ = fake_step(scheduler)
        held = kvcache.num_blocks - kvcache.num_free_blocks
        most = max(most, held)
        # this step's queries start at num_computed_tokens - n; keys from window - 1 before that
        computed, n = first.num_computed_tokens, batch.num_tokens[0]
        first_key = max(0, computed - n - window + 1)
        assert held <= -(-computed // size) - first_key // size, f"at {computed} tokens"
        if not first.is_finished:  # (its table is gone once it finishes)
            table = kvcache.block_ids(first)
            assert all(b == kvcache.num_blocks for b in table[: first_key // size])
    assert most <= -(-(window + 8) // size) + 1, most
    assert_no_leak(kvcache)
    second = create_request(30, max_tokens=2, request_id="second")
    scheduler.add(second)
    fake_step(scheduler)
    assert second.num_cached_tokens == 28  # the first 7 blocks: freed behind the window, still cached
    run_to_completion(scheduler)
    assert_no_leak(kvcache)


def test_prefix_cache_counters_count_each_prompt_once_under_preemption():
    """Queried and hit tokens are the prompts' (each counted at its first admission): a preempted request that
    finds its own blocks again on re-admission adds nothing, so hits never pass the prompt tokens served."""
    kvcache = create_kvcache(num_blocks=10, block_size=4)
    scheduler = ContinuousScheduler(ContinuousOptions(), kvcache, 256)
    system = list(range(900, 912))  # 3 shared blocks
    requests = []
    for i in range(4):
        request = Request(f"r{i}", system + [i + 1, i + 2], SamplingParams(max_tokens=12, temperature=0,
                                                                            ignore_eos=True), 256)
        requests.append(request)
        scheduler.add(request)
    run_to_completion(scheduler)
    assert scheduler.stats().num_preemptions > 0
    stats = kvcache.stats()
    assert stats.num_prefix_query_tokens == sum(r.num_prompt_tokens for r in requests)
    assert stats.num_prefix_hit_tokens == sum(r.num_cached_tokens for r in requests) <= stats.num_prefix_query_tokens
    assert_no_leak(kvcache)
