"""``conveyor simulate``: what a config would do with a model on hardware you may not have.

The real engine core runs, with the real scheduler and KV cache plugins of
the config (chunked prefill, preemption, prefix caching, admission), on a
virtual clock: the executor computes nothing and answers each step after the
seconds a cost model gives for the step's FLOPs and bytes
(``conveyor.perf.roofline``; a calibrated model's with its jitter). Requests
arrive as ``conveyor bench`` sends them (its datasets and arrival processes),
and the report is bench's.

The cost models, calibrated on this machine or from a GPU's datasheet, are
``conveyor.bench.costs``. A KV connector (``[connector] plugin = "tiers"``)
runs as configured: its hits come from the workload's shared prefixes, and a
step waits for the bytes it moved at each tier's assumed bandwidth
(``TIER_BYTES_PER_S``); no block is read from or written to a disk.

Schedulers that wait on the wall clock for a batch to fill (``static``,
``dynamic``) stop the simulation with an error when they do; ``continuous``
steps on its own.
"""

from __future__ import annotations

import json
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from conveyor.bench import flags
from conveyor.bench.costs import (
    DEFAULT_INTERCONNECT,
    INTERCONNECTS,
    TIER_BYTES_PER_S,
    CostModel,
    calibrate,
    weight_bytes,
)
from conveyor.bench.sim_fleet import simulate_fleet
from conveyor.bench.sim_workload import SIMULATED_TOKEN, SimRequest, add_workload_arguments, workload
from conveyor.config import Config, ConfigError
from conveyor.connector import KVConnector
from conveyor.engine.core import EngineCore
from conveyor.executor import Executor
from conveyor.kvcache import DTYPE_BYTES, KVCacheSpec
from conveyor.messages import EngineRequest, RankTimes, RunnerOutput, StepInput, StepStats
from conveyor.model.spec import ModelSpec
from conveyor.perf.peaks import DevicePeaks
from conveyor.perf.roofline import ModelCosts, step_work
from conveyor.registry import PluginRegistry
from conveyor.sampling import SamplingParams
from conveyor.worker.rpc import ModelInfo

# the models the simulator knows by name (their config.json's shapes)
MODELS: dict[str, ModelSpec] = {
    "llama-3-8b": ModelSpec("LlamaForCausalLM", 128256, 4096, 14336, 32, 32, 8, 128, 500000.0, 1e-5, 8192, False),
    "llama-3-70b": ModelSpec("LlamaForCausalLM", 128256, 8192, 28672, 80, 64, 8, 128, 500000.0, 1e-5, 8192, False),
    "qwen2.5-7b": ModelSpec("Qwen2ForCausalLM", 152064, 3584, 18944, 28, 28, 4, 128, 1e6, 1e-6, 32768, False,
                            attention_bias=True),
    "mixtral-8x7b": ModelSpec("MixtralForCausalLM", 32000, 4096, 14336, 32, 32, 8, 128, 1e6, 1e-5, 32768, False,
                              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336),
    "smollm2-135m": ModelSpec("LlamaForCausalLM", 49152, 576, 1536, 30, 9, 3, 64, 100000.0, 1e-5, 8192, True),
}
# a GPU's memory kept from the KV cache for activations and the CUDA context
ACTIVATION_RESERVE_BYTES = 2 * 10**9


class SimulatedExecutor(Executor):
    """Computes nothing: each step's tokens come at once (a token that ends nothing), with the cost model's
    seconds as its forward time.

    With ``pipeline_parallel_size`` P the layers are split over P stages: a step occupies each stage for 1/P of
    its seconds in turn, with its hidden states sent between stages, and up to P steps are in flight (one per
    stage), as the real executor runs them. ``clock`` is the virtual time at which the engine submits;
    ``collected_at`` the time the step ``collect`` returned left the last stage.
    """

    name = "simulated"

    def __init__(self, config: Config, registry: PluginRegistry, spec: ModelSpec, cost: CostModel,
                 weights: int, free_memory: int | None):
        super().__init__(config, registry)
        self.spec, self.cost, self.weights, self._free = spec, cost, weights, free_memory
        self.costs: ModelCosts | None = None
        self.stages = config.parallel.pipeline_parallel_size
        self.clock = 0.0
        self.collected_at = 0.0
        # when each stage is free again; when each submitted step leaves the last stage
        self._stage_free = [0.0] * self.stages
        self._leaves: deque[float] = deque()
        self._jitter = random.Random(config.engine.seed or 0)
        # the engine's KV connector (``simulate`` sets it), and its tiers' byte counters as last seen
        self.connector: KVConnector | None = None
        self._moved: dict[str, float] = {}

    @property
    def max_in_flight(self) -> int:
        return self.stages

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return []

    def shutdown(self) -> None:
        pass

    def load_model(self) -> ModelInfo:
        spec, config = self.spec, self.config
        tp = config.parallel.tensor_parallel_size
        problem = split_problem(spec, tp, self.stages)  # (the workers' check: a real engine refuses it too)
        if problem is not None:
            raise ConfigError(f"{config.source}: [parallel] {problem}")
        max_model_len = config.model.max_model_len or spec.max_position_embeddings
        # (one device's share: its KV heads, and its stage's layers)
        kv_spec = KVCacheSpec(-(-spec.num_layers // self.stages), max(1, spec.num_kv_heads // tp), spec.head_dim,
                              config.model.dtype, max_model_len)
        return ModelInfo(max_model_len, kv_spec, "simulated", "simulated", self.weights, spec.vocab_size, spec)

    def free_memory(self) -> int | None:
        return self._free

    def init_kv_cache(self, layout) -> None:
        self.costs = ModelCosts.of(self.spec, self.weights, layout.spec.bytes_per_head,
                                   DTYPE_BYTES[self.config.model.dtype])

    def execute(self, step: StepInput) -> RunnerOutput:
        work = step_work(self.costs, [(r.start, len(r.token_ids)) for r in step.requests],
                         sum(1 for r in step.requests if r.sample))
        tokens = sum(len(r.token_ids) for r in step.requests)
        seconds = self.cost.seconds(work.flops, work.bytes, len(step.requests), tokens)
        if self.cost.jitter:
            seconds *= self._jitter.choice(self.cost.jitter)
        seconds += self.cost.transfer_seconds(self._tier_bytes())
        # through the stages in turn, each free once the step before has left it
        hop = self.cost.hop_seconds(tokens)
        at = self.clock
        for stage in range(self.stages):
            at = max(at, self._stage_free[stage]) + seconds / self.stages
            self._stage_free[stage] = at
            if stage < self.stages - 1:
                at += hop
        self._leaves.append(at)
        sampled = [SIMULATED_TOKEN if r.sample else None for r in step.requests]
        comm = self.cost.comm_seconds(tokens) + (self.stages - 1) * hop
        workers = self.cost.tp * self.stages
        ranks = [RankTimes(seconds, comm, 0.0)] * workers if workers > 1 else []
        return RunnerOutput(sampled, [None] * len(step.requests), forward_time=seconds, comm_time=comm, ranks=ranks)

    def collect(self) -> RunnerOutput:
        self.collected_at = self._leaves.popleft()
        return super().collect()

    def _tier_bytes(self) -> dict[str, float]:
        """The bytes the connector moved by tier since the last step (its copies to and from host memory, and
        the disk reads between steps; disk writes run beside the steps), which this step waits for."""
        if self.connector is None:
            return {}
        stats = self.connector.stats()
        now = {tier: n + (stats.written_bytes.get(tier, 0) if tier == "host" else 0)
               for tier, n in stats.read_bytes.items()}
        moved = {tier: n - self._moved.get(tier, 0) for tier, n in now.items()}
        self._moved = now
        return moved


def split_problem(spec: ModelSpec, tp: int, pp: int = 1) -> str | None:
    """Why ``spec`` cannot be split ``tp`` x ``pp`` ways, with the tensor-parallel sizes that can (None when it
    can): the check the workers make (``conveyor.model.parallel.check_divisible``)."""
    # (imported here: that module imports torch, and the CLI, the server's included, imports this one for its flags)
    from conveyor.model.parallel import Placement, check_divisible

    experts = tuple(w for w in (spec.moe_intermediate_size, spec.shared_expert_intermediate_size) if w)
    return check_divisible(Placement(0, tp, pp), spec.num_heads, spec.num_kv_heads, spec.intermediate_size,
                           spec.num_layers, experts)


def _free_memory(config: Config, peaks: DevicePeaks, weights: float) -> int | None:
    """A device's memory less its share of the weights and the activations' reserve (None: no memory figure, a
    CPU's).

    Raises:
        ValueError: the weights do not fit the device's memory.
    """
    if not peaks.memory_bytes:
        return None
    devices = config.parallel.tensor_parallel_size * config.parallel.pipeline_parallel_size
    free_memory = int(peaks.memory_bytes - weights / devices - ACTIVATION_RESERVE_BYTES)
    if free_memory <= 0:
        raise ValueError(f"{weights / devices / 1e9:.1f} GB of weights per device do not fit in the "
                         f"{peaks.memory_bytes / 1e9:.0f} GB of {peaks.name}: raise tensor_parallel_size "
                         "(or pipeline_parallel_size) or quantize")
    return free_memory


def simulate(config: Config, spec: ModelSpec, requests: Sequence[SimRequest], arrivals: Sequence[float],
             cost: CostModel, peaks: DevicePeaks, latency_s: float = 0.0, connector: KVConnector | None = None):
    """Run the workload through the engine core on a virtual clock.

    Args:
        config: the engine's config (scheduler, KV cache, ``model.dtype``, ``quant.plugin``,
            ``parallel.tensor_parallel_size``); its model is ``spec``.
        arrivals: each request's arrival, seconds from the start.
        latency_s: from a request's arrival to the engine's taking it (the frontend: HTTP, tokenizing, IPC).
        connector: consulted by the KV cache instead of the config's (``sim_fleet.HandedOver``).
        peaks: the device's; on a GPU its memory less the weights' share is the KV cache's before
            ``memory_fraction`` (a CPU's budget is ``[kvcache] memory_gb``).

    Returns:
        The requests' records (``conveyor.bench.stats.RequestRecord``), the run's virtual duration, and the
        engine's step stats.

    Raises:
        ValueError: the weights do not fit the device's memory.
    """
    from conveyor.bench.stats import RequestRecord

    registry = PluginRegistry.of(config)
    weights = cost.weight_bytes or weight_bytes(spec, DTYPE_BYTES[config.model.dtype], config.quant.plugin)
    executor = SimulatedExecutor(config, registry, spec, cost, weights, _free_memory(config, peaks, weights))
    core = EngineCore(config, registry, executor=executor, peaks=peaks)
    core.scheduler.clock = lambda: executor.clock  # (deadlines and queue times on the virtual clock)
    core.timer = core.scheduler.clock  # (the cost model holds the host's time per step: nothing real is added)
    if connector is not None:
        core.kvcache.attach(connector)
    executor.connector = core.connector
    arrivals = [float(t) + latency_s for t in arrivals]  # (when each reaches the engine)
    order = sorted(range(len(requests)), key=lambda i: arrivals[i])
    records = [RequestRecord(i, len(r.prompt_token_ids), start=arrivals[i] - latency_s) for i, r in enumerate(requests)]
    last_token = [0.0] * len(requests)
    now, next_arrival, idle = 0.0, 0, 0
    steps: list[StepStats] = []
    try:
        while next_arrival < len(order) or core.has_unfinished():
            if not core.has_unfinished():
                now = max(now, float(arrivals[order[next_arrival]]))
            executor.clock = now
            while next_arrival < len(order) and arrivals[order[next_arrival]] <= now:
                i = order[next_arrival]
                params = SamplingParams(max_tokens=requests[i].max_tokens, ignore_eos=True, temperature=0)
                rejection = core.add_request(EngineRequest(str(i), requests[i].prompt_token_ids, params))
                if rejection is not None:
                    records[i].error = rejection.error or "rejected"
                next_arrival += 1
            outputs, stats = core.step()
            if stats is None:  # nothing ran (a rejection, or nothing schedulable until more requests come)
                idle += 1
                if idle > 2:
                    if next_arrival == len(order):
                        raise ValueError(f"scheduler {config.scheduler.plugin!r} makes no progress on the virtual "
                                         "clock (static and dynamic batching wait on the wall clock)")
                    now = max(now, float(arrivals[order[next_arrival]]))
                continue
            idle = 0
            now = max(now, executor.collected_at)
            steps.append(stats)
            for output in outputs:
                i = int(output.request_id)
                record = records[i]
                if output.new_token_ids:
                    if record.ttft is None:
                        record.ttft = now - record.start
                    else:
                        record.itl.extend([now - last_token[i]] + [0.0] * (len(output.new_token_ids) - 1))
                    record.output_tokens += len(output.new_token_ids)
                    last_token[i] = now
                if output.finish_reason is not None and record.error is None:
                    if output.finish_reason == "error":
                        record.error = output.error
                    else:
                        record.e2e = now - record.start
    finally:
        core.shutdown()
    return records, now, steps




def measure_steps(config: Config, num_requests: int = 32, seed: int = 1) -> tuple[list[StepStats], int]:
    """Steps of a short real run of ``config``'s model here: a mixed workload all at once, then a few requests one
    at a time (so that small batches are seen too); and the bytes of the weights they read, as stored."""
    from conveyor import LLM
    from conveyor.bench.datasets import mixed

    steps: list[StepStats] = []
    with LLM(config) as llm:
        core, step = llm.engine, llm.engine.step

        def step_and_keep():
            outputs, stats = step()
            if stats is not None and stats.flops:
                steps.append(stats)
            return outputs, stats

        core.step = step_and_keep
        chats = mixed(num_requests, seed, lambda m: len(llm.tokenizer.encode_chat(m)), output_len=(16, 96))
        llm.generate([c.messages for c in chats],
                     [SamplingParams(max_tokens=c.max_tokens, ignore_eos=True, temperature=0) for c in chats])
        for chat in chats[:3]:
            llm.generate([chat.messages], SamplingParams(max_tokens=32, ignore_eos=True, temperature=0))
        return steps, core.info.weight_bytes


def resolve_model(name: str) -> ModelSpec:
    """A model the simulator knows by name, or the shape in a config.json (the file or its directory)."""
    if name in MODELS:
        return MODELS[name]
    from pathlib import Path

    from conveyor.model.families import spec_from_hf_config

    path = Path(name)
    return spec_from_hf_config(json.loads((path / "config.json" if path.is_dir() else path).read_text()))


def hardware_costs(hardware: str, config: Config, spec: ModelSpec,
                   interconnect: str | None = None) -> tuple[DevicePeaks, CostModel]:
    """The device's peaks and the cost model of ``config``'s steps on it: a GPU of the table (datasheet; its
    devices joined by ``interconnect``, NVLink 4 by default), or ``cpu`` (this machine, calibrated by a short
    real run of the config's model)."""
    from conveyor.config import paths
    from conveyor.perf.peaks import cpu_peaks, gpu_peaks

    if interconnect is not None and interconnect not in INTERCONNECTS:
        raise ValueError(f"--interconnect {interconnect!r}: allowed: {', '.join(INTERCONNECTS)}")
    if hardware == "cpu":
        if interconnect is not None:
            raise ValueError("--interconnect applies to GPUs (--hardware); this CPU's workers are calibrated")
        peaks = cpu_peaks(paths.cache_root())
        kv = getattr(config.kvcache.options, "dtype", "auto")
        print(f"calibrating on this machine: a short real run of the config's model (quant {config.quant.plugin}, "
              f"KV {kv}) ...", flush=True)
        return peaks, calibrate(*measure_steps(config))
    peaks = gpu_peaks(hardware)
    if peaks is None:
        raise ValueError(f"--hardware {hardware!r}: not in the GPU table (conveyor profile --gpus), nor 'cpu'")
    return peaks, CostModel.datasheet(peaks, config.model.dtype, spec, config.parallel.tensor_parallel_size,
                                      interconnect or DEFAULT_INTERCONNECT)


def main(args) -> int:
    """``conveyor simulate``: the report ``conveyor bench`` would print, for each request rate."""
    from conveyor.bench.arrivals import arrival_times
    from conveyor.bench.command import _slos
    from conveyor.bench.report import rate_label, run_table, sweep_table
    from conveyor.bench.stats import summarize
    from conveyor.config import load_config, parse_override

    config = load_config(args.config_file, dict(parse_override(o) for o in args.set))
    spec = resolve_model(args.model)
    peaks, cost = hardware_costs(args.hardware, config, spec, args.interconnect)
    several = config.parallel.tensor_parallel_size * config.parallel.pipeline_parallel_size > 1
    link = f", {args.interconnect or DEFAULT_INTERCONNECT}" if several and args.hardware != "cpu" else ""
    requests = workload(args)
    transfer = kv_link_bytes_per_s(args.hardware, args.interconnect)
    runs = []
    for rate in args.request_rate:
        arrivals = [float(t) for t in arrival_times(len(requests), rate, args.burstiness, args.seed)]
        records, duration, steps = simulate_fleet(config, spec, requests, arrivals, cost, peaks, transfer)
        run = {"label": f"{args.model} on {peaks.name}{link}{_engines(config)} (simulated)", "config": {"rate": rate},
               "summary": summarize(records, duration, _slos(args.goodput)), "comm_share": comm_share(steps)}
        runs.append(run)
        comm = f"\n  communication: {run['comm_share']:.1%} of the steps' time" if several else ""
        print(f"\n{run['label']}, {rate_label(rate)} requests/s\n{run_table(run)}{comm}", flush=True)
    if len(runs) > 1:
        print("\n" + sweep_table(runs))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"cost_model": asdict(cost), "runs": runs}, f, indent=2)
    return 0


def kv_link_bytes_per_s(hardware: str, interconnect: str | None) -> float:
    """The link a prompt's KV crosses from a prefill engine to a decode engine: shared memory on a CPU, else the
    interconnect between the GPUs."""
    if hardware == "cpu":
        return TIER_BYTES_PER_S["host"]
    return INTERCONNECTS[interconnect or DEFAULT_INTERCONNECT].bytes_per_second


def _engines(config: Config) -> str:
    """The label's ", 1 prefill + 1 decode engines" or ", 2 replicas" ("" for one engine)."""
    parallel = config.parallel
    if parallel.prefill_engines:
        return f", {parallel.prefill_engines} prefill + {parallel.decode_engines} decode engines"
    return f", {parallel.data_parallel_size} replicas" if parallel.data_parallel_size > 1 else ""


def comm_share(steps: Sequence[StepStats]) -> float:
    """The share of the steps' time in collectives and transfers between devices."""
    total = sum(s.forward_time for s in steps)
    return sum(s.comm_time for s in steps) / total if total else 0.0


def add_arguments(parser) -> None:
    add_workload_arguments(parser)
    parser.add_argument("--request-rate", type=flags.rates, default=[float("inf")],
                        metavar="RATES", help="requests/s, comma-separated for several runs (default: inf)")
    parser.add_argument("--goodput", nargs="+", metavar="METRIC:MS", default=[])
    parser.add_argument("--json", dest="json_path", metavar="OUT", help="the runs and the cost model, as JSON")
