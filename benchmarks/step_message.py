"""Bytes of the step message the engine sends its workers: as sent (only what changed of each request,
conveyor.engine.deltas) and as it would be whole (every table, every parameter set, every penalty token); and
the decode step time through the mp executor with each.

    python benchmarks/step_message.py [--running 64] [--context 1000] [--penalty 1.1] [--tp 2]

Bytes: the real engine core and scheduler run over the simulator's executor (nothing is computed; the
model is Llama-3-8B's shape), with ``--running`` requests of ``--context``-token prompts admitted at once.
The executor encodes each step with msgpack, as the mp and Ray executors do, and a worker's rows
(``conveyor.worker.rows``) take it; each entry is then made whole from them and encoded again for the
comparison. Prints the bytes of the decode steps (every request decoding, contexts ``--context`` and more).

Worker preparation: the run's step messages are replayed into a worker's state, and each decode step's
preparation on the host is timed (median over the decode steps of 10 replays, CPU): the step applied to the
rows, its input buffers written (``conveyor.worker.inputs``) and its sampling parameters gathered, as the
worker does now; and, in the same run, the same steps the way the worker prepared them before
(``BeforeRows``: each entry rebuilt whole, every request's whole table row written again in Python, the
sampling parameters read from each entry's parameters).

Time (``--tp N``, N > 0): the same requests through ``[parallel] executor = "mp"`` with N worker processes
over a small model of random weights (``load_format = "dummy"``: 4 layers of 256, so that what a step
costs besides its matmuls shows), once as sent and once with every entry whole (the engine forgets what
the workers hold before each step, which is what the message was before), in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch

from conveyor.bench.costs import weight_bytes
from conveyor.bench.simulator import SimulatedExecutor, hardware_costs, resolve_model
from conveyor.config import load_config
from conveyor.engine.core import EngineCore
from conveyor.kvcache import DTYPE_BYTES
from conveyor.messages import EngineRequest, StepInput
from conveyor.registry import PluginRegistry
from conveyor.sampling import SamplingParams
from conveyor.worker.inputs import InputBuffers
from conveyor.worker.rows import BatchRows
from conveyor.worker.sampler import SamplingBuffers


class MeasuredExecutor(SimulatedExecutor):
    """The simulator's executor, measuring each step's message as sent and whole."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rows = BatchRows()
        # (decodes in the step, bytes as sent, bytes whole), and each step's message as sent
        self.sizes: list[tuple[int, int, int]] = []
        self.messages: list[bytes] = []

    def execute(self, step: StepInput) -> object:
        sent = msgspec.msgpack.encode(step)
        received = msgspec.msgpack.decode(sent, type=StepInput)
        self.rows.apply(received)
        for entry in received.requests:
            entry.block_ids, entry.block_offset = self.rows.table(entry), 0
        whole = msgspec.msgpack.encode(received)
        self.sizes.append((step.num_decodes, len(sent), len(whole)))
        self.messages.append(sent)
        return super().execute(step)


SMALL = {"architectures": ["LlamaForCausalLM"], "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512,
         "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "rope_theta": 10000.0,
         "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "tie_word_embeddings": False}


class Planner:
    """An attention backend's planning, as the kernels over block tables take it (the default)."""

    batch_invariant = False
    prefills_as_decodes = False
    storage = None

    def plan_decodes(self, tables):
        return tables

    def plan_prefills(self, tables):
        return tables


@dataclass
class HeldBefore:
    params: SamplingParams
    table: list[int]
    prompt: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    last_sampled: int = -1


class BeforeRows:
    """The worker's state as it was before its rows: each entry made whole again on every step (parameters, the
    whole table, penalty tokens), then every request's table row written again into the input buffers."""

    def __init__(self, block_size: int):
        self.held: dict[str, HeldBefore] = {}
        self.inputs = InputBuffers(block_size, torch.device("cpu"))
        self.sampling = SamplingBuffers(torch.device("cpu"))

    def prepare(self, step: StepInput) -> None:
        for request_id in step.finished_request_ids:
            self.held.pop(request_id, None)
        for entry in step.requests:
            if entry.params is not None:
                held = self.held[entry.request_id] = HeldBefore(entry.params, entry.block_ids)
            else:
                held = self.held[entry.request_id]
                entry.params = held.params
                del held.table[entry.block_offset :]
                held.table.extend(entry.block_ids)
                entry.block_ids = held.table
                entry.block_offset = 0
            if entry.follows:
                entry.token_ids = [max(held.last_sampled, 0)]
            if entry.prompt_token_ids:
                held.prompt = entry.prompt_token_ids
            if entry.sample and entry.params.has_penalties:
                held.outputs.extend(entry.output_token_ids)
                entry.prompt_token_ids, entry.output_token_ids = held.prompt, held.outputs
        self.inputs.prepare(step, Planner())
        self.sampling.tensors([r.params for r in step.requests])


class WithRows:
    """The worker's state now: one row per request, the step applied to them and gathered from them."""

    def __init__(self, block_size: int):
        self.rows = BatchRows()
        self.inputs = InputBuffers(block_size, torch.device("cpu"))
        self.sampling = SamplingBuffers(torch.device("cpu"))

    def prepare(self, step: StepInput) -> None:
        self.rows.apply(step)
        self.inputs.prepare(step, Planner(), self.rows)
        self.sampling.take(self.rows, self.rows.index(step.requests))


def preparation_ms(messages: list[bytes], worker: type, block_size: int, replays: int = 10) -> float:
    """Median host time of a decode step's preparation, over the decode steps of ``replays`` replays of the
    run's messages (each into a fresh worker state; messages decoded before the clock starts)."""
    times = []
    for _ in range(replays):
        state = worker(block_size)
        for step in [msgspec.msgpack.decode(m, type=StepInput) for m in messages]:
            start = time.perf_counter()
            state.prepare(step)
            if step.num_decodes == len(step.requests):
                times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def decode_step_ms(args, whole: bool) -> float:
    """Median wall time of the decode steps through the mp executor (``whole``: every entry sent whole)."""
    with tempfile.TemporaryDirectory() as shape:
        Path(shape, "config.json").write_text(json.dumps(SMALL))
        config = load_config(None, {"model.path": shape, "model.load_format": "dummy", "model.dtype": "float32",
                                    "model.max_model_len": args.context + args.output + 16,
                                    "parallel.tensor_parallel_size": args.tp, "parallel.executor": "mp",
                                    "engine.num_threads": 1, "scheduler.max_num_seqs": args.running,
                                    "scheduler.max_num_batched_tokens": 8192, "kvcache.memory_gb": 1.0})
        core = EngineCore(config)
    try:
        if whole:
            fill = core.sent.fill

            def fill_whole(entry, request, table, penalties):
                core.sent.forget([request.request_id])
                fill(entry, request, table, penalties)

            core.sent.fill = fill_whole
        params = SamplingParams(max_tokens=args.output, ignore_eos=True, temperature=0.8, top_p=0.95,
                                repetition_penalty=args.penalty, seed=1)
        for i in range(args.running):
            prompt = [(7 * i + 13 * j) % (SMALL["vocab_size"] - 1) + 1 for j in range(args.context)]
            assert core.add_request(EngineRequest(f"t{i}", prompt, params)) is None
        times = []
        while core.has_unfinished():
            start = time.perf_counter()
            _, stats = core.step()
            if stats is not None and stats.num_decode_seqs == args.running and not stats.num_prefill_seqs:
                times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3
    finally:
        core.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--running", type=int, default=64)
    parser.add_argument("--context", type=int, default=1000, help="prompt tokens of each request")
    parser.add_argument("--output", type=int, default=32, help="tokens each request decodes")
    parser.add_argument("--penalty", type=float, default=1.0, help="repetition penalty (1: none)")
    parser.add_argument("--tp", type=int, default=0, help="also time decode steps through the mp executor with "
                        "this many tensor-parallel workers (0: bytes only)")
    args = parser.parse_args()

    config = load_config(None, {"scheduler.max_num_seqs": args.running, "scheduler.max_waiting": args.running,
                                "scheduler.max_num_batched_tokens": args.running * args.context,
                                "kvcache.block_size": 16, "model.dtype": "bfloat16", "quant.plugin": "none"})
    spec = resolve_model("llama-3-8b")
    peaks, cost = hardware_costs("h200", config, spec)
    weights = weight_bytes(spec, DTYPE_BYTES[config.model.dtype])
    registry = PluginRegistry.of(config)
    executor = MeasuredExecutor(config, registry, spec, cost, weights, int(peaks.memory_bytes - weights - 2**31))
    core = EngineCore(config, registry, executor=executor, peaks=peaks)
    params = SamplingParams(max_tokens=args.output, ignore_eos=True, temperature=0.8, top_p=0.95,
                            repetition_penalty=args.penalty, seed=1)
    for i in range(args.running):
        prompt = [(7 * i + 13 * j) % 32000 + 1 for j in range(args.context)]
        assert core.add_request(EngineRequest(f"r{i}", prompt, params)) is None
    while core.has_unfinished():
        core.step()
    core.shutdown()

    decodes = [(sent, whole) for n, sent, whole in executor.sizes if n == args.running]
    first = executor.sizes[0]
    sent = statistics.median(s for s, _ in decodes)
    whole = statistics.median(w for _, w in decodes)
    print(f"{args.running} requests, {args.context}-token prompts, {args.output} tokens each, "
          f"repetition_penalty {args.penalty}, blocks of 16 tokens")
    print(f"  first step (every prompt):  {first[1]:>9,} bytes sent, {first[2]:>9,} whole")
    print(f"  decode steps ({len(decodes)}), median: {sent:>9,.0f} bytes sent, {whole:>9,.0f} whole "
          f"({whole / sent:.1f}x fewer; {sent / args.running:.1f} bytes a request)", flush=True)
    block_size = config.kvcache.options.block_size
    before = preparation_ms(executor.messages, BeforeRows, block_size)
    rows = preparation_ms(executor.messages, WithRows, block_size)
    print(f"  worker preparation of a decode step (host, median): {before:.3f} ms before (entries made whole, "
          f"every table row written), {rows:.3f} ms with rows (diffs applied, rows gathered)", flush=True)
    if args.tp:
        print(f"decode step through the mp executor, TP={args.tp}, a 4-layer model of width 256, one thread a "
              "worker (median):", flush=True)
        for label, whole_entries in (("as sent", False), ("whole", True), ("as sent, again", False)):
            print(f"  {label:<15} {decode_step_ms(args, whole_entries):7.2f} ms", flush=True)


if __name__ == "__main__":
    main()
