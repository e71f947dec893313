"""The built-in schedulers as the registry knows them before their code is imported: their options, and where
each class is (``conveyor.hookspecs.Declaration``)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from conveyor.hookspecs import Declaration, hookimpl
from conveyor.scheduler import SchedulerOptions

Milliseconds = Annotated[float, msgspec.Meta(ge=0)]


class SloClass(msgspec.Struct, forbid_unknown_fields=True):
    """The targets of the requests of one priority (those of the scheduler's table where this says 0)."""

    priority: int
    ttft_slo_ms: Milliseconds = 0.0
    itl_slo_ms: Milliseconds = 0.0


class ContinuousOptions(SchedulerOptions, forbid_unknown_fields=True):
    # most requests running at once
    max_num_seqs: Annotated[int, msgspec.Meta(ge=1)] = 64
    # largest prefill chunk one request gets per step; 0: the whole budget
    long_prefill_token_threshold: Annotated[int, msgspec.Meta(ge=0)] = 0
    # fcfs: by arrival; priority: lower `priority` first, then by arrival
    policy: Literal["fcfs", "priority"] = "fcfs"
    # P99 target for the time to first token, in ms (0: none); with it or itl_slo_ms set, the step budget, the
    # decode batch, the order of the waiting prompts and admission follow the targets every step (docs/serving.md,
    # "Latency targets"); both may change while serving (POST /v1/admin/scheduler)
    ttft_slo_ms: Milliseconds = 0.0
    # P99 target for the inter-token latency, in ms (0: none): a step takes as many prompt tokens as keep it
    # within this, by a model of step time fitted as the engine runs
    itl_slo_ms: Milliseconds = 0.0
    # a request whose TTFT target the queue ahead already makes it miss: "reject" (429 with Retry-After) or
    # "queue" (it waits all the same)
    slo_admission: Literal["reject", "queue"] = "reject"
    # without an ITL target: a step beside decodes takes only the prompt tokens that keep its predicted time (the
    # step-time model's) within this many times that of the decodes alone, so that a long prompt arriving does
    # not stall the requests decoding (their ITL P99 stays near this multiple of their P50); 0: the whole budget
    decode_stretch: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    # other targets for requests of some priorities (a target a class leaves at 0 is the table's), e.g.
    # [{priority = 1, ttft_slo_ms = 30000, itl_slo_ms = 500}] for batch work
    slo_classes: list[SloClass] = []  # noqa: RUF012 -- msgspec copies a mutable default for each Struct


class BatchOptions(SchedulerOptions, forbid_unknown_fields=True):
    # token budget of one step; a batch's prompts are split into steps under it
    max_num_batched_tokens: Annotated[int, msgspec.Meta(ge=1)] = 8192


class StaticOptions(BatchOptions, forbid_unknown_fields=True):
    # requests per batch
    batch_size: Annotated[int, msgspec.Meta(ge=1)] = 16
    # start a smaller batch once the oldest waiting request has waited this long
    max_wait_ms: Annotated[float, msgspec.Meta(ge=0)] = 1000.0


class DynamicOptions(BatchOptions, forbid_unknown_fields=True):
    # most requests per batch
    max_batch_size: Annotated[int, msgspec.Meta(ge=1)] = 16
    # how long a batch collects requests after the first one arrives
    window_ms: Annotated[float, msgspec.Meta(ge=0)] = 50.0


@hookimpl
def conveyor_register_schedulers(register):
    package = "conveyor.plugins.schedulers"
    register(Declaration("continuous", ContinuousOptions, f"{package}.continuous:ContinuousScheduler",
                         "Continuous batching: requests join and leave the batch at every step."))
    register(Declaration("static", StaticOptions, f"{package}.static:StaticScheduler",
                         "Static batching: fixed batches of ``batch_size``, each run to completion."))
    register(Declaration("dynamic", DynamicOptions, f"{package}.dynamic:DynamicScheduler",
                         "Dynamic batching: whatever arrived within a time window, run to completion."))
