"""Multi-turn chats on a KV pool too small for their histories: the tiers off, the host tier, the disk tier,
and the disk tier after a restart, each a `conveyor serve` of its own, in one run.

    python benchmarks/kv_tiers.py [--conversations 16] [--turns 4] [--system-tokens 300] [--num-blocks 160]
                                  [--max-tokens 32] [--no-batch-invariant] [--out bench-results/kv_tiers]

Each conversation has a distinct long system prompt; every turn resends the whole history (system prompt,
earlier questions and replies) with a new question, as a chat client does. The conversations run at once,
each one turn after the other; greedy, ``ignore_eos``. Setups (the default config with ``[kvcache]
num_blocks`` set and ``[engine] batch_invariant = true``, so that a reply does not depend on what else ran
beside it, nor on whether its prefix was computed or loaded: every setup's replies must equal the first's):

- ``off``: no connector: a history the pool evicted is computed again;
- ``host``: ``[connector] plugin = "tiers"`` with host memory for every history;
- ``disk``: the tiers with a host tier of a third of that (less than the histories) and a disk tier in a
  fresh directory;
- ``disk, restarted``: a new server on the same directory; the same conversations again from their first turn.

Printed per setup: TTFT p50 of the later turns (2 on) and of the first, the prompt tokens computed (prompt
tokens less those served from the prefix cache or a tier, from each reply's usage), the tokens each tier
served (/metrics), and whether every reply equals the ``off`` setup's. A plot of TTFT p50 per turn goes to
--out/ttft_per_turn.png, the records to --out/kv_tiers.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import msgspec

from conveyor.bench.server import Server

DEFAULT = Path(__file__).resolve().parent.parent / "configs" / "default.toml"
WORDS = "river stone maple copper lantern orchard violet harbor meadow ember glacier saffron".split()


def system_prompt(index: int, tokens: int) -> str:
    """A distinct instruction block of about ``tokens`` tokens (different from the first word on)."""
    words = [WORDS[(index * 7 + i * (index + 3)) % len(WORDS)] for i in range(tokens)]
    return f"You are assistant {index}. Keep these words in mind: " + " ".join(words)


async def conversation(client: httpx.AsyncClient, url: str, model: str, index: int, args) -> list[dict]:
    """One conversation, turn after turn; each turn's TTFT, prompt and cached tokens and reply."""
    messages = [{"role": "system", "content": system_prompt(index, args.system_tokens)}]
    turns = []
    for turn in range(args.turns):
        messages.append({"role": "user", "content": f"Question {turn}: tell me about word {WORDS[turn]}."})
        body = {"model": model, "messages": messages, "max_tokens": args.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        ttft, text, usage = None, [], {}
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=None) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", ()):
                    if choice["delta"].get("content"):
                        ttft = ttft if ttft is not None else time.perf_counter() - start
                        text.append(choice["delta"]["content"])
        reply = "".join(text)
        messages.append({"role": "assistant", "content": reply})
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        turns.append({"conversation": index, "turn": turn, "ttft": ttft, "prompt_tokens": usage["prompt_tokens"],
                      "cached_tokens": cached, "reply": reply})
    return turns


async def run_chats(url: str, args) -> list[dict]:
    async with httpx.AsyncClient() as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        results = await asyncio.gather(*(conversation(client, url, model, i, args) for i in range(args.conversations)))
    return [turn for turns in results for turn in turns]


def tier_hits(server: Server) -> dict[str, float]:
    hits = {}
    for tier in ("host", "disk"):
        try:
            hits[tier] = server.metric("conveyor_kv_tier_hit_tokens_total", tier=tier)
        except KeyError:
            hits[tier] = 0.0
    return hits


def run_setup(label: str, overrides: list[str], args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        print(f"== {label}: conveyor serve {' '.join(overrides)}", flush=True)
        server = Server(DEFAULT.read_text().replace("port = 8000", "port = 0"), Path(tmp),
                        overrides=["server.status_interval=0", f"kvcache.num_blocks={args.num_blocks}", *overrides])
        server.start()
        try:
            start = time.perf_counter()
            turns = asyncio.run(run_chats(server.http, args))
            seconds = time.perf_counter() - start
            hits = tier_hits(server)
        finally:
            server.stop()
    later = [t for t in turns if t["turn"] > 0]
    summary = {
        "later_ttft_p50": statistics.median(t["ttft"] for t in later),
        "first_ttft_p50": statistics.median(t["ttft"] for t in turns if t["turn"] == 0),
        "later_prompt_tokens": sum(t["prompt_tokens"] for t in later),
        "later_computed_tokens": sum(t["prompt_tokens"] - t["cached_tokens"] for t in later),
        "computed_tokens": sum(t["prompt_tokens"] - t["cached_tokens"] for t in turns),
        "tier_hit_tokens": hits, "seconds": seconds,
        "ttft_p50_per_turn": [statistics.median(t["ttft"] for t in turns if t["turn"] == k) for k in range(args.turns)],
    }
    print(f"   later turns: TTFT p50 {summary['later_ttft_p50']:.2f} s, prompt tokens computed "
          f"{summary['later_computed_tokens']} of {summary['later_prompt_tokens']}; first turns: TTFT p50 "
          f"{summary['first_ttft_p50']:.2f} s; tier hits {hits}; {seconds:.0f} s", flush=True)
    return {"label": label, "overrides": overrides, "summary": summary, "turns": turns}


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        per_turn = run["summary"]["ttft_p50_per_turn"]
        ax.plot(range(1, len(per_turn) + 1), per_turn, marker="o", label=run["label"])
    ax.set_xticks(range(1, len(runs[0]["summary"]["ttft_p50_per_turn"]) + 1))
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT p50 (s)")
    ax.set_title("Multi-turn chats on a KV pool too small for their histories")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=300)
    parser.add_argument("--num-blocks", type=int, default=160)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--no-batch-invariant", action="store_true",
                        help="serve without batch-invariant mode (faster; replies may differ in their last bits)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/kv_tiers"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{platform.processor() or platform.machine()}: {args.conversations} conversations x {args.turns} turns, "
          f"system prompts of ~{args.system_tokens} words, a pool of {args.num_blocks} blocks", flush=True)
    host_gb = 0.25 * args.num_blocks / 160  # (SmolLM2: 160 blocks of 16 tokens = 59 MB; room for every history)
    with tempfile.TemporaryDirectory() as disk:
        mode = [] if args.no_batch_invariant else ["engine.batch_invariant=true"]
        tiers = [*mode, "connector.plugin=tiers"]
        disk_setup = [*tiers, f"connector.host_gb={host_gb / 3:.6f}", f"connector.disk_dir={disk}"]
        runs = [run_setup("off", mode, args), run_setup("host", [*tiers, f"connector.host_gb={host_gb}"], args),
                run_setup("disk", disk_setup, args), run_setup("disk, restarted", disk_setup, args)]
    reference = [t["reply"] for t in runs[0]["turns"]]
    for run in runs:
        run["replies_equal_off"] = [t["reply"] for t in run["turns"]] == reference
    print("\n| setup | later turns TTFT p50 | prompt tokens computed (later turns) | first turns TTFT p50 "
          "| host tier hits | disk tier hits | replies = off |")
    print("|---|---|---|---|---|---|---|")
    for run in runs:
        s = run["summary"]
        print(f"| {run['label']} | {s['later_ttft_p50']:.2f} s | {s['later_computed_tokens']} of "
              f"{s['later_prompt_tokens']} | {s['first_ttft_p50']:.2f} s | {s['tier_hit_tokens']['host']:.0f} "
              f"| {s['tier_hit_tokens']['disk']:.0f} | {run['replies_equal_off']} |")
    (args.out / "kv_tiers.json").write_bytes(msgspec.json.encode(runs))
    plot(runs, args.out / "ttft_per_turn.png")
    print(f"\nwrote {args.out / 'kv_tiers.json'} and {args.out / 'ttft_per_turn.png'}")
    return 0 if all(run["replies_equal_off"] for run in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
