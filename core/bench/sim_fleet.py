"""Several engines in ``conveyor simulate``: data-parallel replicas, and prefill/decode disaggregation.

Each engine is simulated on its own virtual clock (``simulate``), one after another: requests are dealt to the
engines of a role in turn (round robin, where the server routes by load and prefix: on a uniform workload the
two agree), which is exact as long as the engines do not wait on each other. With prefill and decode engines
they do, one way only: a request reaches its decode engine when its prefill engine has made its one token and
the prompt's KV has crossed the link (its bytes at the link's bandwidth: ``--interconnect`` between GPUs,
``TIER_BYTES_PER_S["host"]`` through shared memory on a CPU). So the prefill engines run first, then the decode
engines with those arrival times; on a decode engine a prompt's full blocks are found (``HandedOver``) and only
its last, partial block is computed, as the real decode engine does. A request's TTFT counts from its arrival
at the prefill engine to its first token from the decode engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec

from conveyor.bench.sim_workload import SimRequest
from conveyor.config import Config
from conveyor.connector import KVConnector
from conveyor.kvcache import DTYPE_BYTES
from conveyor.messages import StepStats
from conveyor.model.spec import ModelSpec
from conveyor.request import Request


class HandedOver(KVConnector):
    """A decode engine's view of the prompts a prefill engine computed: every full block of a prompt is there
    to load, at no cost of its own (the transfer is charged to the request's arrival)."""

    name = "handed-over"

    def __init__(self):
        super().__init__(None, None, "", lambda payload: [])

    def lookup(self, request: Request, digests: list[bytes]) -> int:
        return len(digests)

    def load(self, digest: bytes, block: int) -> None:
        pass

    def save(self, digest: bytes, block: int) -> None:
        pass

    def take_payload(self) -> bytes:
        return b""


def simulate_fleet(config: Config, spec: ModelSpec, requests: Sequence[SimRequest], arrivals: Sequence[float],
                   cost, peaks, transfer_bytes_per_s: float) -> tuple[list, float, list[StepStats]]:
    """``simulate`` for the engines ``config.parallel`` asks for: one, ``data_parallel_size`` replicas, or
    ``prefill_engines`` and ``decode_engines``.

    Args:
        transfer_bytes_per_s: the link a prompt's KV crosses from a prefill engine to a decode engine.

    Returns:
        As ``simulate``: every request's record (``RequestRecord``, in the order of ``requests``), the run's
        virtual duration, and every engine's step stats.
    """
    parallel = config.parallel
    one = msgspec.structs.replace(config, parallel=msgspec.structs.replace(
        parallel, data_parallel_size=1, prefill_engines=0, decode_engines=0))
    one._registry = getattr(config, "_registry", None)
    if parallel.prefill_engines:
        return _disaggregated(one, parallel.prefill_engines, parallel.decode_engines, spec, requests, arrivals, cost,
                              peaks, transfer_bytes_per_s)
    return _dealt(one, parallel.data_parallel_size, spec, requests, arrivals, cost, peaks)


def _dealt(config: Config, engines: int, spec: ModelSpec, requests: Sequence[SimRequest],
           arrivals: Sequence[float], cost, peaks,
           connector: Callable[[], KVConnector] | None = None) -> tuple[list, float, list[StepStats]]:
    """Requests dealt in turn to ``engines`` engines, each simulated (with a KV connector of its own from
    ``connector``, if given); the records back in the requests' order."""
    from conveyor.bench.simulator import simulate

    records: list = [None] * len(requests)
    duration, steps = 0.0, []
    for engine in range(engines):
        mine = range(engine, len(requests), engines)
        if not mine:
            continue
        got, took, stepped = simulate(config, spec, [requests[i] for i in mine], [arrivals[i] for i in mine], cost,
                                      peaks, connector=connector() if connector is not None else None)
        for i, record in zip(mine, got):
            record.index = i
            records[i] = record
        duration, steps = max(duration, took), steps + stepped
    return records, duration, steps


def _disaggregated(config: Config, num_prefill: int, num_decode: int, spec: ModelSpec,
                   requests: Sequence[SimRequest], arrivals: Sequence[float], cost, peaks,
                   transfer_bytes_per_s: float) -> tuple[list, float, list[StepStats]]:
    prefills = [SimRequest(r.prompt_token_ids, 1) for r in requests]
    prefilled, _, prefill_steps = _dealt(config, num_prefill, spec, prefills, arrivals, cost, peaks)
    # the whole model's K and V of one token (every layer, every KV head), as the decode engine's pool holds it
    kv_bytes = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * DTYPE_BYTES[config.model.dtype]
    handed = [i for i, record in enumerate(prefilled) if record.ok and record.ttft is not None]
    ready = [prefilled[i].start + prefilled[i].ttft + len(requests[i].prompt_token_ids) * kv_bytes
             / transfer_bytes_per_s for i in handed]
    decoded, duration, decode_steps = _dealt(config, num_decode, spec, [requests[i] for i in handed], ready, cost,
                                             peaks, connector=HandedOver)
    records = list(prefilled)
    for i, arrived, record in zip(handed, ready, decoded):
        waited = arrived - prefilled[i].start
        record.index, record.start = i, prefilled[i].start
        record.ttft = None if record.ttft is None else record.ttft + waited
        record.e2e = None if record.e2e is None else record.e2e + waited
        records[i] = record
    return records, duration, prefill_steps + decode_steps
