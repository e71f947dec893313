"""``conveyor bench``: measure any OpenAI-compatible server under load; ``conveyor bench compare``: put runs side by side."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
from prometheus_client.samples import Sample

from conveyor.bench import datasets, flags, report
from conveyor.bench.load import BenchRequest, LoadOptions, metric_totals, run_load, scrape_metrics, served_model
from conveyor.bench.parallel import parallel_view
from conveyor.bench.stats import SLO_METRICS, RequestRecord, summarize


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("compare", nargs="*", metavar="compare FILE.json",
                        help="`conveyor bench compare A.json B.json ...` prints saved runs side by side")
    parser.add_argument("--url", help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", help="model name to send (default: the first one /v1/models lists)")
    parser.add_argument("--dataset", default="mixed", help="mixed | random | sharegpt:FILE (default: mixed)")
    parser.add_argument("--tokenizer", help="tokenizer.json, a directory holding one, or a .gguf, to size prompts "
                        "(default: the default model's)")
    parser.add_argument("--num-requests", type=flags.positive(int), default=64)
    parser.add_argument("--request-rate", type=flags.rate, default=math.inf, help="requests/s, or inf (default: inf)")
    parser.add_argument("--sweep", type=flags.rates, metavar="RATES",
                        help="run once per rate, e.g. 1,2,4,8,inf, and plot the results")
    parser.add_argument("--burstiness", type=flags.positive(float), default=1.0,
                        help="gamma shape of arrival gaps; 1 = Poisson")
    parser.add_argument("--max-concurrency", type=flags.positive(int, zero=True), default=0,
                        help="most requests in flight (0: no limit)")
    parser.add_argument("--input-len", type=flags.positive(int), default=256, help="random: prompt tokens")
    parser.add_argument("--output-len", type=flags.positive(int), default=None,
                        help="random: output tokens (default 128); sharegpt: override the reply length")
    parser.add_argument("--range-ratio", type=flags.fraction, default=0.0, help="random: lengths vary by +-ratio")
    parser.add_argument("--temperature", type=flags.positive(float, zero=True), default=0.0)
    parser.add_argument("--ignore-eos", action="store_true", help="ask for exactly max_tokens (vLLM's extra field)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=flags.positive(int, zero=True), default=1,
                        help="requests sent (and not counted) before measuring")
    parser.add_argument("--goodput", nargs="+", metavar="METRIC:MS", default=[],
                        help="SLOs for goodput, e.g. ttft:1000 itl:150 (metrics: ttft, tpot, e2e, itl: the P99 of "
                        "each request's own gaps between tokens)")
    parser.add_argument("--json", dest="json_path", metavar="OUT", help="write every request's timings here")
    parser.add_argument("--plot", metavar="PNG", help="where the sweep or comparison plot goes")
    parser.add_argument("--label", default="", help="name of this run in comparisons (default: the URL)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--ready-timeout", type=flags.positive(float, zero=True), default=600.0, metavar="SECONDS",
                        help="how long to wait for a server that is still starting (503) or not up yet (default: 600)")
    parser.add_argument("--no-progress", action="store_true")


def _slos(specs: list[str]) -> dict[str, float]:
    slos = {}
    for spec in specs:
        name, _, value = spec.partition(":")
        if name not in SLO_METRICS or not value:
            raise ValueError(f"--goodput {spec!r}: expected METRIC:MS with METRIC one of {', '.join(SLO_METRICS)}")
        try:
            slos[name] = flags.positive(float)(value)
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"--goodput {spec!r}: {e} (milliseconds)") from None
    return slos


def main(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the report
    if args.compare:
        if args.compare[0] != "compare" or len(args.compare) < 2:
            raise ValueError("usage: conveyor bench compare A.json [B.json ...]  (or conveyor bench --url URL ...)")
        return compare(args.compare[1:], args.plot)
    if not args.url:
        raise ValueError("--url is required, e.g. --url http://127.0.0.1:8000")
    slos = _slos(args.goodput)
    rates = args.sweep or [args.request_rate]
    # NOTE: each rate of a sweep gets prompts of its own (seed + i): repeated prompts would be served from
    # the prefix cache and flatter every rate after the first.
    workloads = [build_workload(args, args.num_requests, args.seed + i) for i in range(len(rates))]
    warmup = build_workload(args, args.warmup, args.seed - 1) if args.warmup else []
    result = anyio.run(_run_all, args, workloads, warmup, rates, slos)
    runs = result["runs"]
    # (saved first: a table or a plot that fails must not take the measurements with it)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_bytes(msgspec.json.encode(result if len(runs) > 1 else runs[0]))
        print(f"every request's timings: {args.json_path}")
    plot_path = args.plot
    if len(runs) > 1:
        print("\n" + report.sweep_table(runs, result["label"]))
        if not plot_path:
            plot_path = str(Path(args.json_path).with_suffix(".png")) if args.json_path else "bench-sweep.png"
    if plot_path:
        print(f"plot: {report.plot([result], plot_path, result['label'])}")
    if all(run["summary"]["completed"] == 0 for run in runs):
        print("error: every request failed", file=sys.stderr)
        return 1
    return 0


def compare(paths: list[str], plot_path: str | None) -> int:
    results = [report.load_result(path) for path in paths]
    print(report.compare_table(results))
    if plot_path:
        print(f"plot: {report.plot(results, plot_path)}")
    return 0


def build_workload(args: argparse.Namespace, n: int, seed: int) -> list[BenchRequest]:
    tokenizer = _tokenizer(args.tokenizer)
    if args.dataset == "mixed":
        chats = datasets.mixed(n, seed, lambda m: len(tokenizer.encode_chat(m)))
        return [BenchRequest(c.messages, None, len(tokenizer.encode_chat(c.messages)), c.max_tokens) for c in chats]
    if args.dataset == "random":
        special = frozenset(i for i in (tokenizer.bos_token_id, *tokenizer.eos_token_ids) if i is not None)
        pairs = datasets.random_prompts(n, seed, tokenizer.vocab_size, args.input_len,
                                        128 if args.output_len is None else args.output_len,
                                        args.range_ratio, special)
        return [BenchRequest(None, ids, len(ids), out) for ids, out in pairs]
    if args.dataset.startswith("sharegpt:"):
        requests = []
        for question, answer in datasets.sharegpt(args.dataset.partition(":")[2], n, seed):
            messages = [{"role": "user", "content": question}]
            output_len = args.output_len
            if output_len is None:
                output_len = max(1, len(tokenizer.encode(answer, add_special_tokens=False)))
            requests.append(BenchRequest(messages, None, len(tokenizer.encode_chat(messages)), output_len))
        return requests
    raise ValueError(f"--dataset {args.dataset!r}: allowed: mixed, random, sharegpt:FILE")


def _tokenizer(path: str | None):
    from conveyor.config import ModelConfig
    from conveyor.model.tokenizer import load_tokenizer

    if path is None:
        return load_tokenizer(ModelConfig(), source="--tokenizer")
    if path.endswith(".gguf"):
        return load_tokenizer(ModelConfig(path=path), source="--tokenizer")
    return load_tokenizer(ModelConfig(tokenizer=path), source="--tokenizer")


async def _run_all(args: argparse.Namespace, workloads: list[list[BenchRequest]], warmup: list[BenchRequest],
                   rates: list[float], slos: dict[str, float]) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=30.0) as client:
        served = await served_model(client, args.url, args.api_key, args.ready_timeout)  # (waits until it is up)
    model = args.model or served
    config = {"url": args.url, "model": model, "dataset": args.dataset, "num_requests": args.num_requests,
              "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "seed": args.seed,
              "ignore_eos": args.ignore_eos, "temperature": args.temperature}
    label = args.label or args.url
    if warmup:
        warm = [msgspec.structs.replace(r, max_tokens=min(r.max_tokens, 8)) for r in warmup]
        print(f"warming up with {len(warm)} request(s)", file=sys.stderr)
        await run_load(args.url, model, warm, _options(args, math.inf))
    runs = []
    for i, (rate, requests) in enumerate(zip(rates, workloads)):
        print(f"{label}: {len(requests)} requests at {report.rate_label(rate)} req/s", file=sys.stderr)
        records, duration, server = await _measure(args, model, requests, rate)
        run_config = {**config, "rate": rate, "seed": args.seed + i}
        run = {"label": label, "config": run_config, "summary": summarize(records, duration, slos),
               "server": server, "requests": [msgspec.to_builtins(r) for r in records]}
        print(report.run_table(run) + "\n")
        runs.append(run)
    return {"label": label, "config": config, "runs": runs}


def _options(args: argparse.Namespace, rate: float) -> LoadOptions:
    return LoadOptions(rate, args.burstiness, args.max_concurrency, args.seed, args.temperature, args.ignore_eos,
                       args.api_key)


async def _measure(args: argparse.Namespace, model: str, requests: list[BenchRequest],
                   rate: float) -> tuple[list[RequestRecord], float, dict[str, Any]]:
    from tqdm import tqdm

    async with httpx.AsyncClient(timeout=30.0) as client:
        before = await scrape_metrics(client, args.url)
        with tqdm(total=len(requests), unit="req", disable=args.no_progress, file=sys.stderr) as bar:

            def done(record: RequestRecord) -> None:
                bar.update(1)
                if record.error:
                    bar.set_postfix_str(f"failed: {record.error[:60]}")

            records, duration = await run_load(args.url, model, requests, _options(args, rate), done)
        after = await scrape_metrics(client, args.url)
    return records, duration, _server_view(before, after)


def _server_view(before: list[Sample], after: list[Sample]) -> dict[str, Any]:
    """What the server's own metrics say about the run (any server whose names end like these; the parallel
    section only from Conveyor with several workers)."""
    start, end = metric_totals(before), metric_totals(after)

    def delta(suffix: str) -> float | None:
        names = [n for n in end if n.endswith(suffix)]
        if not names:
            return None
        return end[names[0]] - start.get(names[0], 0.0)

    view: dict[str, Any] = {}
    queue_sum, queue_count = delta("request_queue_time_seconds_sum"), delta("request_queue_time_seconds_count")
    if queue_sum is not None and queue_count:
        view["queue_time_mean_ms"] = 1000 * queue_sum / queue_count
    ttft_count = delta("time_to_first_token_seconds_count")
    if ttft_count is not None:
        view["ttft_count"] = ttft_count
    parallel = parallel_view(before, after)
    if parallel is not None:
        view["parallel"] = parallel
    return view
