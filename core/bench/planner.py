"""``conveyor plan``: the configs that carry the most traffic within latency SLOs, found by simulation.

A candidate's **capacity** is the highest request rate at which its simulated
run (``conveyor.bench.simulator``, the workload arriving as a Poisson process)
completes every request and meets every SLO (``--slo
ttft_p99=500ms,itl_p99=50ms``: percentiles of the whole run), found by
bisection between 0 and the rate at which it completes the requests when they
all come at once. With ``--gpus N``, a candidate at tensor parallelism T runs
N / T replicas (data parallelism): one replica is simulated on every
(N / T)-th request at 1 / (N / T) of the rate, and its capacity counts N / T
times. Its N / T engines may instead split into prefill and decode engines
(disaggregation): those wait on each other, so all of them are simulated
(``simulate_fleet``), the prompts' KV crossing ``--interconnect``.

The search runs in rounds (the whole grid would take hours):

1. ``parallel.tensor_parallel_size`` x ``quant.plugin`` x ``kvcache.dtype``,
   at the config's scheduler (on ``--hardware cpu`` each weight format and
   KV dtype calibrated by a real run of its own, ``auto`` too: the
   checkpoint's own format, a GGUF's blocks kept packed);
2. for the best of round 1 at each tensor parallelism that runs two
   engines or more: each split of its engines into
   ``parallel.prefill_engines`` and ``parallel.decode_engines``;
3. the best ``KEEP`` so far x ``scheduler.max_num_seqs`` x
   ``scheduler.max_num_batched_tokens``;
4. the best ``KEEP`` so far with the other ``kvcache.block_size``.

The best configs print as TOML: the config given (or the defaults) with the
chosen keys, and each one's predicted report at its capacity.
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import tomli_w

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

from conveyor.bench import flags
from conveyor.bench.costs import DEFAULT_INTERCONNECT
from conveyor.bench.sim_fleet import simulate_fleet
from conveyor.bench.simulator import (
    SimRequest,
    comm_share,
    hardware_costs,
    kv_link_bytes_per_s,
    simulate,
    split_problem,
)
from conveyor.bench.stats import summarize
from conveyor.config import Config, ConfigError, load_config

# candidates kept from one round to the next
KEEP = 2
# bisection steps between 0 and the all-at-once rate (the capacity is found within 1/2^STEPS of that rate)
BISECT_STEPS = 6
# the values tried, by the keys' short names (fp8 weights only on a GPU with fp8 matmuls; auto, the checkpoint's
# own format, only on a CPU, whose calibration runs the checkpoint: the datasheet knows formats by name)
GRID: dict[str, Sequence[Any]] = {"tp": (1, 2, 4, 8), "quant": ("auto", "none", "int8", "fp8"), "kv": ("auto", "fp8"),
                                  "seqs": (32, 64, 128, 256), "tokens": (512, 2048, 8192), "block": (16, 32)}
# the keys searched, as progress lines name them
SHORT = {"parallel.tensor_parallel_size": "tp", "parallel.data_parallel_size": "dp", "quant.plugin": "quant",
         "kvcache.dtype": "kv", "scheduler.max_num_seqs": "seqs", "scheduler.max_num_batched_tokens": "tokens",
         "kvcache.block_size": "block", "parallel.prefill_engines": "prefill",
         "parallel.decode_engines": "decode"}
# the latency metrics an SLO may bound, and the statistics of each
SLO_METRICS = ("ttft", "itl", "tpot", "e2e")
SLO_STATS = ("mean", "p50", "p90", "p95", "p99")


@dataclass(frozen=True)
class Slo:
    metric: str
    stat: str
    ms: float

    def __str__(self) -> str:
        return f"{self.metric}_{self.stat} <= {self.ms:g} ms"


def parse_slos(text: str) -> list[Slo]:
    """``ttft_p99=500ms,itl_p99=50ms`` (a value in ms, or with ``s``/``ms``) as SLOs."""
    slos = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        metric, _, stat = name.strip().partition("_")
        match = re.fullmatch(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(ms|s)?", value.strip())
        if metric not in SLO_METRICS or stat not in SLO_STATS or match is None:
            raise ValueError(f"--slo {part!r}: expected METRIC_STAT=VALUE[ms|s], METRIC one of "
                             f"{', '.join(SLO_METRICS)}, STAT one of {', '.join(SLO_STATS)} (e.g. ttft_p99=500ms)")
        number, unit = float(match.group(1)), match.group(2) or "ms"
        if not number > 0:  # (no latency is 0: a bound of 0 would be met by no config at all)
            raise ValueError(f"--slo {part!r}: a bound must be above 0")
        slos.append(Slo(metric, stat, number * (1000.0 if unit == "s" else 1.0)))
    if not slos:
        raise ValueError("--slo: give at least one, e.g. ttft_p99=500ms,itl_p99=50ms")
    return slos


def meets(summary: dict[str, Any], slos: Sequence[Slo]) -> bool:
    """Every request completed and every SLO holds (a metric with no samples, e.g. the ITL of one-token
    replies, holds)."""
    if summary["failed"]:
        return False
    values = [summary[f"{slo.metric}_ms"][slo.stat] for slo in slos]
    return all(math.isnan(v) or v <= slo.ms for v, slo in zip(values, slos))


@dataclass
class Candidate:
    """Config keys to set (``section.key`` -> value) and what the simulation found."""

    keys: dict[str, Any]
    # requests/s within the SLOs, all replicas; 0: none of the rates tried; None: not evaluated (see ``error``)
    capacity: float | None = None
    # the report of one replica at its share of the capacity, and how many replicas the deployment runs (a
    # prefill/decode split: the whole deployment's report, and 1)
    summary: dict[str, Any] = field(default_factory=dict)
    replicas: int = 1
    error: str = ""

    def label(self) -> str:
        return " ".join(f"{SHORT.get(k, k)}={v}" for k, v in self.keys.items())


class Planner:
    """Evaluates candidates of one base config, model, hardware and workload.

    Args:
        config_file: the TOML config the candidates change (None: the defaults).
        overrides: ``section.key`` -> value applied before the candidate's keys.
        arrivals: seconds of each request's arrival at 1 request/s (scaled for each rate).
        gpus: devices for one deployment (TP x engines = gpus; the engines replicas, or prefill and decode
            engines).
        interconnect: the link between the GPUs (``conveyor.bench.simulator.INTERCONNECTS``; None: NVLink 4).
    """

    def __init__(self, config_file: str | None, overrides: dict[str, Any], spec, hardware: str,
                 requests: Sequence[SimRequest], arrivals: Sequence[float], slos: Sequence[Slo], gpus: int = 1,
                 progress: Callable[[str], None] | None = None, interconnect: str | None = None):
        self.config_file, self.overrides, self.spec, self.hardware = config_file, overrides, spec, hardware
        self.interconnect = interconnect
        self.requests, self.arrivals, self.slos, self.gpus = list(requests), list(arrivals), list(slos), gpus
        self.progress = progress or (lambda line: None)
        self._costs: dict[tuple, Any] = {}

    def config(self, keys: dict[str, Any]) -> Config:
        return load_config(self.config_file, {**self.overrides, **keys})

    def _hardware(self, config: Config):
        key: tuple = (config.parallel.tensor_parallel_size, config.model.dtype)
        if self.hardware == "cpu":  # (a run of each weight format and KV dtype: their kernels are what it measures)
            key += (config.quant.plugin, getattr(config.kvcache.options, "dtype", None))
        if key not in self._costs:
            self._costs[key] = hardware_costs(self.hardware, config, self.spec, self.interconnect)
        return self._costs[key]

    def run(self, config: Config, rate: float, replicas: int) -> dict[str, Any]:
        """One replica's simulated report at ``rate`` requests/s for the whole deployment, or the whole
        deployment's with ``replicas`` 1 (with ``comm_share``: the share of its steps' time in collectives)."""
        peaks, cost = self._hardware(config)
        requests = self.requests[::replicas]
        share = rate / replicas
        arrivals = [0.0] * len(requests) if math.isinf(share) else [t / share for t in self.arrivals[::replicas]]
        if config.parallel.prefill_engines:
            link = kv_link_bytes_per_s(self.hardware, self.interconnect)
            records, duration, steps = simulate_fleet(config, self.spec, requests, arrivals, cost, peaks, link)
        else:
            records, duration, steps = simulate(config, self.spec, requests, arrivals, cost, peaks)
        return {**summarize(records, duration), "comm_share": comm_share(steps)}

    def evaluate(self, candidate: Candidate) -> Candidate:
        """Find the candidate's capacity (or why it cannot run)."""
        try:
            config = self.config(candidate.keys)
            parallel = config.parallel
            engines = parallel.prefill_engines + parallel.decode_engines or parallel.data_parallel_size
            if engines * parallel.tensor_parallel_size != self.gpus:
                raise ValueError(f"{engines} engines at tensor_parallel_size = {parallel.tensor_parallel_size} "
                                 f"take {engines * parallel.tensor_parallel_size} devices, not --gpus {self.gpus}")
            replicas = candidate.replicas = 1 if parallel.prefill_engines else engines
            flood = self.run(config, math.inf, replicas)
        except (ConfigError, ValueError) as e:
            candidate.error = str(e).splitlines()[0]
            return candidate
        if flood["failed"]:
            candidate.error = (f"{flood['failed']} of {flood['num_requests']} requests failed, e.g. "
                               f"{flood['errors'][0]}")
            return candidate
        top = flood["request_throughput"] * replicas
        if meets(flood, self.slos):
            candidate.capacity, candidate.summary = top, flood
            return candidate
        low, high, best = 0.0, top, {}
        for _ in range(BISECT_STEPS):
            rate = (low + high) / 2
            summary = self.run(config, rate, replicas)
            if meets(summary, self.slos):
                low, best = rate, summary
            else:
                high = rate
        candidate.capacity, candidate.summary = low, best
        return candidate

    def rounds(self, keep: int = KEEP, grid: dict[str, Sequence[Any]] | None = None) -> list[Candidate]:
        """The rounds of the search; every candidate evaluated, the best first.

        Args:
            grid: values to try instead of the defaults, by ``SHORT`` name (``{"seqs": [16, 64]}``).
        """
        values = {**GRID, **(grid or {})}
        base = self.config({})
        tps = [t for t in values["tp"] if t <= self.gpus and self.gpus % t == 0 and split_problem(self.spec, t) is None]
        peaks, _ = self._hardware(base) if self.hardware != "cpu" else (None, None)
        quants = [q for q in values["quant"] if (q != "fp8" or (peaks is not None and peaks.flops_for("fp8")))
                  and (q != "auto" or self.hardware == "cpu")]
        paged = base.kvcache.plugin == "paged"
        seen: dict[str, Candidate] = {}

        def run_round(title: str, keys_list: list[dict[str, Any]]) -> list[Candidate]:
            fresh = [k for k in keys_list if json.dumps(k, sort_keys=True) not in seen]
            self.progress(f"round {title}: {len(fresh)} candidates")
            for i, keys in enumerate(fresh, 1):
                candidate = self.evaluate(Candidate(keys))
                seen[json.dumps(keys, sort_keys=True)] = candidate
                result = candidate.error or f"{candidate.capacity:.2f} requests/s"
                self.progress(f"  [{i}/{len(fresh)}] {candidate.label()}: {result}")
            return ranked(seen.values())

        first = [{"parallel.tensor_parallel_size": tp, "parallel.data_parallel_size": self.gpus // tp,
                  "quant.plugin": quant, "kvcache.dtype": kv} for tp in tps for quant in quants for kv in values["kv"]]
        splittable = any(self.gpus // tp > 1 for tp in tps)  # (a round of prefill/decode splits)
        total = 2 + splittable + paged
        best = run_round(f"1/{total}: parallelism, weights, KV dtype", first)[:keep]
        if splittable:
            # (of the best at each tensor parallelism that runs two engines or more: the best of all may be one)
            tops = {c.keys["parallel.tensor_parallel_size"]: c for c in reversed(ranked(seen.values()))}
            splits = [{**c.keys, "parallel.data_parallel_size": 1, "parallel.prefill_engines": prefill,
                       "parallel.decode_engines": engines - prefill}
                      for c in tops.values() for engines in [c.keys["parallel.data_parallel_size"]]
                      for prefill in range(1, engines)]
            best = run_round(f"2/{total}: prefill/decode splits", splits)[:keep]
        second = [{**c.keys, "scheduler.max_num_seqs": seqs, "scheduler.max_num_batched_tokens": tokens}
                  for c in best for seqs in values["seqs"] for tokens in values["tokens"]]
        best = run_round(f"{2 + splittable}/{total}: batch size and token budget", second)[:keep]
        if paged:
            third = [{**c.keys, "kvcache.block_size": size} for c in best for size in values["block"]]
            run_round(f"{total}/{total}: block size", third)
        return ranked(seen.values())

    def toml(self, candidate: Candidate) -> str:
        """The base config with the candidate's keys, and the values the others searched take in it, as TOML."""
        config = self.config(candidate.keys)
        effective = {"parallel.tensor_parallel_size": config.parallel.tensor_parallel_size,
                     "parallel.data_parallel_size": config.parallel.data_parallel_size,
                     "quant.plugin": config.quant.plugin}
        for section, spec in (("kvcache", config.kvcache), ("scheduler", config.scheduler)):
            options = msgspec.structs.asdict(spec.options)
            for key in ("dtype", "block_size", "max_num_seqs", "max_num_batched_tokens"):
                if key in options:
                    effective[f"{section}.{key}"] = options[key]
        raw: dict[str, Any] = {}
        if self.config_file is not None:
            with open(self.config_file, "rb") as f:
                raw = tomllib.load(f)
        for dotted, value in {**effective, **self.overrides, **candidate.keys}.items():
            section, _, key = dotted.partition(".")
            if isinstance(value, str):  # (as --set parses a value)
                try:
                    value = tomllib.loads(f"v = {value}")["v"]
                except tomllib.TOMLDecodeError:
                    pass
            raw.setdefault(section, {})[key] = value
        return tomli_w.dumps(raw)


def ranked(candidates) -> list[Candidate]:
    """Evaluated candidates, the highest capacity first (ties: the lower TTFT P99)."""
    done = [c for c in candidates if c.capacity is not None]
    return sorted(done, key=lambda c: (-c.capacity, c.summary.get("ttft_ms", {}).get("p99", math.inf)))


def format_plan(planner: Planner, candidates: Sequence[Candidate], top: int, title: str) -> str:
    """The ``top`` best of the ranked candidates as TOML, each under a comment with its predicted report
    (candidates predicted the same are named under the first)."""
    lines = [title]
    groups: dict[tuple, list[Candidate]] = {}
    for c in candidates:
        s = c.summary
        key = (round(c.capacity or 0, 6),) + ((round(s["ttft_ms"]["p99"], 3), round(s["itl_ms"]["p99"], 3))
                                               if c.capacity else ())
        groups.setdefault(key, []).append(c)
    for i, (first, *same) in enumerate(list(groups.values())[:top], 1):
        s = first.summary
        if not first.capacity:
            lines.append(f"\n# {i}: meets the SLOs at no rate tried ({first.label()})")
            continue
        tokens = s["output_tokens"] / max(1, s["completed"])
        lines.append(f"\n# {i}: {first.capacity:.2f} requests/s within the SLOs (about "
                     f"{first.capacity * tokens:.0f} output tok/s); at that rate TTFT P50/P99 "
                     f"{s['ttft_ms']['p50']:.0f}/{s['ttft_ms']['p99']:.0f} ms, "
                     f"ITL P50/P99 {s['itl_ms']['p50']:.1f}/{s['itl_ms']['p99']:.1f} ms")
        if s.get("comm_share"):  # (tensor parallelism: what its all-reduces cost)
            lines.append(f"# its devices spend {s['comm_share']:.0%} of each step in all-reduces "
                         f"({planner.interconnect or DEFAULT_INTERCONNECT})")
        lines += [f"# the same predicted with {c.label()}" for c in same[:3]]
        if len(same) > 3:
            lines.append(f"# and {len(same) - 3} more")
        lines.append(planner.toml(first).rstrip())
    return "\n".join(lines)


def main(args) -> int:
    """``conveyor plan``: search, then print the best configs."""
    from conveyor.bench.arrivals import arrival_times
    from conveyor.bench.sim_workload import workload
    from conveyor.bench.simulator import resolve_model
    from conveyor.config import parse_override

    slos = parse_slos(args.slo)
    if args.hardware == "cpu" and args.gpus != 1:
        raise ValueError(f"--gpus {args.gpus}: give 1 or more GPUs of --hardware (this CPU counts as one device)")
    spec = resolve_model(args.model)
    requests = workload(args)
    arrivals = [float(t) for t in arrival_times(len(requests), 1.0, args.burstiness, args.seed)]
    planner = Planner(args.config_file, dict(parse_override(o) for o in args.set), spec, args.hardware, requests,
                      arrivals, slos, args.gpus, progress=lambda line: print(line, flush=True),
                      interconnect=args.interconnect)
    engine_log = logging.getLogger("conveyor")
    level = engine_log.level
    engine_log.setLevel(logging.WARNING)  # (each simulated engine would log its KV cache)
    try:
        candidates = planner.rounds()
    finally:
        engine_log.setLevel(level)
    device = "this CPU" if args.hardware == "cpu" else f"{args.gpus} x {args.hardware}"
    title = (f"\nbest of {len(candidates)} configs for {args.model} on {device}, {len(requests)} {args.dataset} "
             f"requests, {', '.join(map(str, slos))}:")
    if not candidates:
        print("\nno config could serve the workload (the reasons are above)")
        return 1
    print(format_plan(planner, candidates, args.top, title))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump([{"keys": c.keys, "capacity": c.capacity, "replicas": c.replicas, "summary": c.summary,
                        "toml": planner.toml(c)} for c in candidates], f, indent=2)
    return 0 if candidates and candidates[0].capacity else 1


def add_arguments(parser) -> None:
    from conveyor.bench.sim_workload import add_workload_arguments

    add_workload_arguments(parser)
    parser.set_defaults(num_requests=200)
    parser.add_argument("--slo", required=True, help="latency bounds, e.g. ttft_p99=500ms,itl_p99=50ms "
                        f"(metrics {', '.join(SLO_METRICS)}; statistics {', '.join(SLO_STATS)})")
    parser.add_argument("--gpus", type=flags.positive(int), default=1, help="devices for one deployment: tensor "
                        "parallelism x engines, replicas or prefill and decode engines (default: 1)")
    parser.add_argument("--top", type=flags.positive(int), default=3, help="configs to print (default: 3)")
    parser.add_argument("--json", dest="json_path", metavar="OUT", help="every candidate evaluated, as JSON")
