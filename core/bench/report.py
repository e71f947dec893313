"""Benchmark reports: the printed table, the sweep and comparison tables, and the plot."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.bench.parallel import parallel_table

if TYPE_CHECKING:
    from matplotlib.figure import Figure

LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E latency"))
# what the comparison table and the plot read from each run's summary
SUMMARY_KEYS = ("completed", "failed", "request_throughput", "output_throughput", "ttft_ms", "itl_ms", "e2e_ms")


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def has_samples(value: float | None) -> bool:
    """False for a latency statistic with no samples behind it: NaN in a run, null in its saved JSON."""
    return value is not None and not math.isnan(value)


def _cell(value: float | None, width: int, decimals: int) -> str:
    """``value`` right-aligned in ``width``, or "-" where it has no samples."""
    return f"{value:>{width}.{decimals}f}" if has_samples(value) else f"{'-':>{width}}"


def run_table(run: dict[str, Any]) -> str:
    """The report of one run: counts, throughput, and mean/P50/P90/P95/P99 of each latency, in ms."""
    s = run["summary"]
    rows = [
        ("Requests ok / failed", f"{s['completed']} / {s['failed']}"),
        ("Offered rate (req/s)", rate_label(run["config"]["rate"])),
        ("Duration (s)", f"{s['duration_s']:.2f}"),
        ("Prompt tokens / output tokens", f"{s['prompt_tokens']} / {s['output_tokens']}"),
        ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{s['output_throughput']:.1f}"),
        ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.1f}"),
    ]
    if "goodput" in s:
        slos = ", ".join(f"{k} <= {v:g} ms" for k, v in s["slos_ms"].items())
        rows.append((f"Goodput (req/s; {slos})", f"{s['goodput']:.2f}"))
    queue = run.get("server", {}).get("queue_time_mean_ms")
    if queue is not None:
        rows.append(("Queue time, mean (ms, from the server)", f"{queue:.1f}"))
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    lines += ["", f"{'(ms)':<12}{'mean':>10}{'P50':>10}{'P90':>10}{'P95':>10}{'P99':>10}"]
    for key, title in LATENCIES:
        stats = s[key]
        lines.append(f"{title:<12}" + "".join(_cell(stats[k], 10, 1) for k in ("mean", "p50", "p90", "p95", "p99")))
    parallel = run.get("server", {}).get("parallel")
    if parallel is not None:
        lines += ["", parallel_table(parallel)]
    for error in s["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)


def sweep_table(runs: Sequence[dict[str, Any]], label: str = "") -> str:
    """One row per offered rate: throughput and P50/P99 of TTFT and ITL."""
    header = (f"{'rate':>6} {'ok':>5} {'failed':>6} {'req/s':>7} {'out tok/s':>10} {'TTFT P50':>9} {'TTFT P99':>9}"
              f" {'ITL P50':>8} {'ITL P99':>8} {'E2E P50':>9}")
    lines = [label] if label else []
    lines.append(header)
    for run in runs:
        s = run["summary"]
        lines.append(
            f"{rate_label(run['config']['rate']):>6} {s['completed']:>5} {s['failed']:>6} "
            f"{s['request_throughput']:>7.2f} {s['output_throughput']:>10.1f} {_cell(s['ttft_ms']['p50'], 9, 0)} "
            f"{_cell(s['ttft_ms']['p99'], 9, 0)} {_cell(s['itl_ms']['p50'], 8, 0)} {_cell(s['itl_ms']['p99'], 8, 0)} "
            f"{_cell(s['e2e_ms']['p50'], 9, 0)}"
        )
    return "\n".join(lines)


def runs_of(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs of a result file: a sweep's list, or the one run."""
    return result.get("runs", [result])


def load_result(path: str | Path) -> dict[str, Any]:
    """A result file written by ``conveyor bench --json`` or ``conveyor simulate --json`` (JSON has no infinity: a
    null rate is ``inf``).

    Raises:
        ValueError: the file is not such a result, naming it and what was expected.
    """
    expected = "expected the JSON of conveyor bench --json: a run (an object with config and summary) or runs: [...]"
    try:
        result = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e}); {expected}") from None
    problem = _result_problem(result)
    if problem is not None:
        raise ValueError(f"{path}: {problem}; {expected}")
    result.setdefault("label", Path(path).stem)
    for run in runs_of(result):
        if run["config"].get("rate") is None:
            run["config"]["rate"] = math.inf
    return result


def _result_problem(result: Any) -> str | None:
    """What a result file lacks that the tables and the plot read (None when nothing)."""
    if not isinstance(result, dict):
        return "the top level is not an object"
    runs = runs_of(result)
    if not isinstance(runs, list) or not runs:
        return "runs is not a list of runs"
    for i, run in enumerate(runs):
        where = f"runs[{i}]" if "runs" in result else "the run"
        if not isinstance(run, dict):
            return f"{where} is not an object"
        for key in ("config", "summary"):
            if not isinstance(run.get(key), dict):
                return f"{where} has no {key!r} object"
        missing = [key for key in SUMMARY_KEYS if key not in run["summary"]]
        if missing:
            return f"{where}'s summary lacks {', '.join(map(repr, missing))}"
    return None


def compare_table(results: Sequence[dict[str, Any]]) -> str:
    """Results side by side: each one's sweep table under its label."""
    return "\n\n".join(sweep_table(runs_of(r), r.get("label", "")) for r in results)


def plot(results: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """Output tokens/s, TTFT and ITL (P50 solid, P99 dashed) against the offered rate, one line per result."""
    fig = figure(results, title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def figure(results: Sequence[dict[str, Any]], title: str = "") -> Figure:
    """The figure ``plot`` saves. A latency point with no samples is left out; a panel left with none says so.

    Raises:
        ImportError: matplotlib is not installed, saying how to install it.
    """
    try:
        from matplotlib.figure import Figure  # (not pyplot: no window, no figure kept open after saving)
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'conveyor-serve[bench]'") from None
    rates = sorted({run["config"]["rate"] for r in results for run in runs_of(r)})
    position = {rate: i for i, rate in enumerate(rates)}
    fig = Figure(figsize=(15, 4.5))
    axes = fig.subplots(1, 3)
    for index, result in enumerate(results):
        runs = sorted(runs_of(result), key=lambda run: run["config"]["rate"])
        x = [position[run["config"]["rate"]] for run in runs]
        color = f"C{index}"
        label = result.get("label") or f"run {index + 1}"
        axes[0].plot(x, [run["summary"]["output_throughput"] for run in runs], "o-", color=color, label=label)
        for ax, key in ((axes[1], "ttft_ms"), (axes[2], "itl_ms")):
            for point, style in (("p50", "o-"), ("p99", "s--")):
                sampled = [(i, run["summary"][key][point]) for i, run in zip(x, runs)
                           if has_samples(run["summary"][key][point])]
                if sampled:
                    ax.plot(*zip(*sampled), style, color=color, label=f"{label} {point.upper()}")
    titles = ("Output tokens/s", "Time to first token (ms)", "Inter-token latency (ms)")
    for ax, name in zip(axes, titles):
        ax.set_title(name)
        ax.set_xticks(range(len(rates)), [rate_label(r) for r in rates])
        ax.set_xlabel("offered request rate (req/s)")
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no samples", transform=ax.transAxes, ha="center", va="center", color="gray")
    for ax in axes[1:]:
        # (a log axis needs a value above 0 to draw)
        if any(y > 0 for line in ax.lines for y in line.get_ydata()):
            ax.set_yscale("log")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
