"""The live dashboard: its feed's arithmetic against references computed here, and the page itself in headless
Chromium (the system's, driven by playwright) on a real server under load."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections import Counter

import anyio
import httpx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conveyor.bench.datasets import shared_system_prompt
from conveyor.bench.load import BenchRequest, LoadOptions, run_load
from conveyor.messages import KVCacheStats, KVOwners, SchedulerStats, StepStats
from conveyor.serving.dashboard import SERIES, DashboardFeed, block_runs
from tests.server import Server


@given(st.lists(st.integers(-2, 40), max_size=30))
def test_block_runs_expand_back_to_the_blocks_in_the_pool(blocks):
    runs = block_runs(blocks, 32)
    assert [b for first, count in runs for b in range(first, first + count)] == [b for b in blocks if 0 <= b < 32]
    assert all(count >= 1 for _, count in runs)


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def step(num: int, prefill: int, decode: int, forward: float, mfu: float, running: int = 3, owners=None):
    kv = KVCacheStats(usage=0.25, num_blocks=16, num_free_blocks=12, block_size=16)
    return StepStats(num, 0.0, SchedulerStats(num_running=running, num_waiting=2), kv, num_prefill_tokens=prefill,
                     num_decode_tokens=decode, num_prefill_seqs=1 if prefill else 0, num_decode_seqs=decode,
                     forward_time=forward, mfu=mfu, mbu=2 * mfu, kv_owners=owners)


def test_the_feed_bins_tokens_by_second_and_weights_utilization_by_forward_time():
    clock = Clock(1000.2)
    feed = DashboardFeed(clock=clock)
    rng = np.random.default_rng(0)
    itls = rng.exponential(0.03, 200)
    ttfts = rng.exponential(0.3, 7)
    for x in ttfts:
        feed.first_token(float(x))
    for x in itls:
        feed.next_token(float(x))
    feed.step(step(1, 40, 3, 0.02, 0.5))
    feed.step(step(2, 0, 4, 0.06, 0.1, owners=KVOwners(["a", "b"], [[0, 1, 2], [0, 1, 5]])))
    for _ in range(5):
        feed.within_slo()
    clock.now = 1003.7  # one busy second, two idle ones, and the open one
    data = feed.snapshot()
    rows = [dict(zip(SERIES, r)) for r in zip(*data["series"].values())]
    assert [r["t"] for r in rows] == [1000, 1001, 1002]
    busy = rows[0]
    assert busy["ttft_p50_ms"] == pytest.approx(np.quantile(ttfts, 0.5, method="inverted_cdf") * 1e3, abs=1e-3)
    assert busy["ttft_p99_ms"] == pytest.approx(np.quantile(ttfts, 0.99, method="inverted_cdf") * 1e3, abs=1e-3)
    assert busy["itl_p50_ms"] == pytest.approx(np.quantile(itls, 0.5, method="inverted_cdf") * 1e3, abs=1e-3)
    assert busy["itl_p99_ms"] == pytest.approx(np.quantile(itls, 0.99, method="inverted_cdf") * 1e3, abs=1e-3)
    assert busy["output_tokens_per_s"] == 207 and busy["requests_within_slo_per_s"] == 5
    assert busy["mfu"] == pytest.approx((0.5 * 0.02 + 0.1 * 0.06) / 0.08)
    assert busy["mbu"] == pytest.approx(2 * busy["mfu"])
    assert (busy["running"], busy["waiting"], busy["kv_usage"]) == (3, 2, 0.25)
    for idle in rows[1:]:
        assert idle["output_tokens_per_s"] == 0 and idle["itl_p50_ms"] is None and idle["mfu"] is None
        assert idle["requests_within_slo_per_s"] == 0
    assert data["steps"]["prefill_tokens"] == [40, 0] and data["steps"]["decode_seqs"] == [3, 4]
    owners = data["replicas"][0]["owners"]
    assert owners == [{"request_id": "a", "blocks": [[0, 3]]}, {"request_id": "b", "blocks": [[0, 2], [5, 1]]}]
    # the queue: requests without a token yet, oldest first, with their ages
    feed.pending("x", 12)
    clock.now += 0.5
    feed.pending("y", 30)
    feed.pending("z", 5)
    feed.answered("y")
    clock.now += 0.25
    assert feed.snapshot()["queue"] == {"count": 2, "oldest": [["x", 0.75, 12], ["z", 0.25, 5]]}
    feed.answered("x")
    feed.answered("z")
    feed.answered("z")  # (a request ends after its first token: answered twice)
    assert feed.snapshot()["queue"] == {"count": 0, "oldest": []}
    # a step with no owners keeps the last map; seconds past the kept history are dropped
    feed.step(step(3, 0, 4, 0.01, 0.1))
    clock.now += 10_000
    data = feed.snapshot()
    assert data["replicas"][0]["owners"] == owners
    assert len(data["series"]["t"]) == 300 and data["series"]["t"][-1] == int(clock.now) - 1


# --- the page in Chromium, on a real server ---

KEY = "dashboard-key-5678"
CONFIG = """
[scheduler]
max_num_seqs = 8

[server]
status_interval = 5.0

[[transport]]
plugin = "http"
port = 0
api_key_env = "CONVEYOR_TEST_KEY"
"""
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


NUM_REQUESTS = 24
MAX_NUM_SEQS = 8  # (CONFIG's)


def holders(kv: dict) -> Counter:
    """Block id -> how many of the running requests hold it, from a replica's KV map."""
    return Counter(b for owner in kv["owners"] for first, count in owner["blocks"] for b in range(first, first + count))


def shared_blocks(kv: dict | None) -> int:
    return 0 if kv is None else sum(1 for n in holders(kv).values() if n > 1)


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="no system Chromium (apt-get install chromium; .ci/run installs it)")
def test_the_dashboard_in_chromium_follows_a_server_under_load(tmp_path):
    """24 requests that share a long system prompt, on a server that runs 8 at a time. The engine is held
    (SIGSTOP) at three points, so that what the page shows does not depend on the device's speed: before it has
    run any (the queue), with 8 running and the rest waiting for 10 s and more (the doctor's window sees a batch
    held at its cap while requests wait: ``batch_too_small``), and right after a step that sent the KV map with
    the 8 running requests (blocks held, the system prompt's shared)."""
    from playwright.sync_api import sync_playwright

    server = Server(CONFIG, tmp_path, env={"CONVEYOR_TEST_KEY": KEY}).start()
    try:
        # the data needs the API key like the API; the page itself holds no data
        denied = httpx.get(f"{server.http}/dashboard/data")
        assert denied.status_code == 401 and "API key" in denied.json()["error"]["message"]
        assert httpx.get(f"{server.http}/dashboard").headers["content-type"].startswith("text/html")
        auth = {"Authorization": f"Bearer {KEY}"}
        model = httpx.get(f"{server.http}/v1/models", headers=auth).json()["data"][0]["id"]
        chats = shared_system_prompt(NUM_REQUESTS, seed=3, output_len=(24, 48))
        requests = [BenchRequest(c.messages, None, 0, c.max_tokens) for c in chats]
        load = threading.Thread(target=anyio.run, daemon=True, args=(
            run_load, server.http, model, requests, LoadOptions(rate=8.0, api_key=KEY, ignore_eos=True, seed=2)))

        def dashboard_data() -> dict:
            return httpx.get(f"{server.http}/dashboard/data", headers=auth).json()

        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM)
            page = browser.new_page(viewport={"width": 1100, "height": 1300})
            errors, elsewhere = [], []
            page.on("pageerror", lambda e: errors.append(str(e)))
            # offline: nothing but this server is asked for anything
            page.route("**/*", lambda route: route.continue_() if route.request.url.startswith(server.http)
                       else (elsewhere.append(route.request.url), route.abort()))
            page.goto(f"{server.http}/dashboard")
            page.wait_for_selector("#key-form", state="visible")  # no key yet: the page asks for it
            page.fill("#key", KEY)
            page.click("#key-form button")
            page.wait_for_function("window.conveyor.polls >= 1")
            last_step = "window.conveyor.charts.batch.data[0].at(-1) ?? 0"
            with server.paused_engine():  # every request queues: no token can come
                load.start()
                page.wait_for_function(f"window.conveyor.last.queue.count === {NUM_REQUESTS}")
                queue, rows, step_before = page.evaluate(f"""() => [window.conveyor.last.queue,
                    [...document.querySelectorAll('#queue tr')].map(row => row.innerText), {last_step}]""")
            # 8 running, the others waiting: held there until the doctor's whole window is of the held engine
            # (every reading with 8 running, no step between the first and the last)
            server.wait_for(lambda: server.metric("conveyor_num_requests_running") == MAX_NUM_SEQS
                            and server.metric("conveyor_num_requests_waiting") >= MAX_NUM_SEQS,
                            timeout=120, what="a full batch with requests waiting")
            with server.paused_engine():
                held_verdict = f"""(() => {{ const v = window.conveyor.last.verdict;
                    return v && v.window.steps === 0 && v.window.running_mean === {MAX_NUM_SEQS}
                        && [v, document.getElementById("verdict-name").textContent]; }})()"""
                verdict, verdict_name = page.wait_for_function(held_verdict, timeout=60_000).json_value()
                held = server.metric("conveyor_num_requests_running"), server.metric("conveyor_num_requests_waiting")
            page.wait_for_function(f"{last_step} > {step_before}")  # the batch chart moves once steps run
            # a KV map in which requests share blocks (those admitted once the first had computed the system
            # prompt find it in the prefix cache), held while the page draws it
            server.wait_for(lambda: shared_blocks(dashboard_data()["replicas"][0]) > 0,
                            timeout=120, what="a KV map with shared blocks")
            with server.paused_engine():
                owners = json.dumps(dashboard_data()["replicas"][0]["owners"], separators=(",", ":"))
                page.wait_for_function(f"JSON.stringify(window.conveyor.last.replicas[0].owners) === "
                                       f"{json.dumps(owners)}")
                held_map = page.evaluate("() => [window.conveyor.kvSharedBlocks ?? 0, window.conveyor.last]")
            seen = [held_map]  # what the page drew and the data it drew it from, while the load runs
            while load.is_alive():
                seen.append(page.evaluate("() => [window.conveyor.kvSharedBlocks ?? 0, window.conveyor.last]"))
                time.sleep(0.5)
            load.join()
            generated = server.metric("conveyor_generation_tokens_total")
            # once idle: every token in the per-second chart, and the engine's empty map after its last step
            page.wait_for_function(f"""(() => {{ const d = window.conveyor.last;
                return d.in_flight === 0 && d.replicas[0].owners.length === 0
                    && d.series.output_tokens_per_s.reduce((a, b) => a + b, 0) === {generated}; }})()""")
            final = page.evaluate("window.conveyor.last")
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            browser.close()
    finally:
        assert server.stop() == 0, server.output
    assert not errors and not elsewhere, (errors, elsewhere)
    # the queue, oldest first, as the page lists it
    ages = [age for _, age, _ in queue["oldest"]]
    assert ages == sorted(ages, reverse=True) and len(rows) == len(queue["oldest"]) == min(queue["count"], 10)
    assert all(tokens > 0 for *_, tokens in queue["oldest"]) and queue["oldest"][0][0] in rows[0]
    # the verdict over a window of the held engine: the batch at its cap, requests waiting, the cache nearly
    # empty and compute idle; the page names it
    running, waiting = held
    assert running == MAX_NUM_SEQS and waiting >= 1
    assert verdict["verdict"] == "batch_too_small" and verdict_name == "batch too small", verdict
    window = verdict["window"]
    assert (window["running_max"], window["running_mean"], window["waiting_mean"]) == (running, running, waiting)
    assert window["kv_usage_max"] < 0.8 and window["mfu"] == 0
    # the KV map: what the requests hold is what the cache counts as not free, at the same step, and the page
    # draws as shared the blocks more than one request holds; the held map has the system prompt's blocks shared
    shared_drawn, held_data = held_map
    assert shared_drawn == shared_blocks(held_data["replicas"][0]) > 0, held_data["replicas"][0]
    for shared_drawn, data in seen:
        kv = data["replicas"][0]
        if kv is None:  # no step yet
            continue
        assert len(holders(kv)) == kv["num_blocks"] - kv["num_free_blocks"], kv
        assert shared_drawn == shared_blocks(kv)
    assert final["steps"]["step"][-1] > step_before
