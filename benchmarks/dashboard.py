"""The live dashboard under load, in headless Chromium: a screenshot for the docs.

    python benchmarks/dashboard.py [--seconds 25] [--out docs/dashboard.png] [--chromium PATH]

Starts ``conveyor serve`` (default model and config, an API key), sends chat
requests that share a long system prompt (shared prefix blocks in the KV
map) at a rate that keeps some waiting, opens ``/dashboard`` in the system's
Chromium (playwright drives it; no browser is downloaded) and saves a
screenshot after ``--seconds``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time
from pathlib import Path

import anyio
import httpx

from conveyor.bench.datasets import shared_system_prompt
from conveyor.bench.load import BenchRequest, LoadOptions, run_load
from conveyor.bench.server import Server

KEY = "dashboard-demo-key"
CONFIG = """
[scheduler]
max_num_seqs = 16

[server]
status_interval = 5.0

[[transport]]
plugin = "http"
port = 0
api_key_env = "CONVEYOR_DASHBOARD_KEY"
"""


def chromium_path(given: str | None) -> str:
    path = given or shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if path is None:
        raise SystemExit("no Chromium found: install the system's (apt-get install chromium) or pass --chromium")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=25.0)
    parser.add_argument("--rate", type=float, default=6.0, help="requests per second")
    parser.add_argument("--out", default="docs/dashboard.png")
    parser.add_argument("--chromium", default=None)
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        print("starting conveyor serve ...", flush=True)
        server = Server(CONFIG, Path(tmp), env={"CONVEYOR_DASHBOARD_KEY": KEY}).start()
        try:
            auth = {"Authorization": f"Bearer {KEY}"}
            model = httpx.get(f"{server.http}/v1/models", headers=auth).json()["data"][0]["id"]
            chats = shared_system_prompt(int(args.rate * (args.seconds + 10)), seed=0)
            requests = [BenchRequest(c.messages, None, 0, c.max_tokens) for c in chats]
            options = LoadOptions(rate=args.rate, api_key=KEY, ignore_eos=True, seed=1)
            load = threading.Thread(target=anyio.run, args=(run_load, server.http, model, requests, options),
                                    daemon=True)
            load.start()
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=chromium_path(args.chromium))
                page = browser.new_page(viewport={"width": 1100, "height": 1300})
                page.goto(f"{server.http}/dashboard#key={KEY}")
                started = time.monotonic()
                while time.monotonic() - started < args.seconds:
                    time.sleep(5)
                    polls = page.evaluate("window.conveyor.polls")
                    print(f"  {time.monotonic() - started:4.0f} s: {polls} polls of /dashboard/data", flush=True)
                page.screenshot(path=args.out, full_page=True)
                browser.close()
            print(f"wrote {args.out}")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
