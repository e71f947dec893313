"""``continuous``: continuous batching under a token budget, with chunked prefill
and preemption by recomputation; with latency targets, a budget chosen every step
to keep them (``conveyor.scheduling.slo``)."""

from __future__ import annotations

import math

from conveyor.plugins.schedulers.declarations import ContinuousOptions
from conveyor.request import Request, RequestRejected
from conveyor.scheduler import Scheduler
from conveyor.scheduling.slo import (
    MIN_PROMPT_TOKENS,
    StepFeatures,
    StepTimeModel,
    prompt_budget,
    room_for_decode,
    step_features,
    targets_of,
    ttft_wait,
)


class ContinuousScheduler(Scheduler):
    """Continuous batching: requests join and leave the batch at every step.

    Each step takes running requests first (oldest first), then waiting ones,
    until the token budget or max_num_seqs is reached; long prompts are split
    into chunks. When KV memory runs out, the newest (or lowest-priority)
    running request is preempted: its memory is freed and it is recomputed
    later.
    """

    name = "continuous"
    Options = ContinuousOptions
    runtime_options = frozenset({"ttft_slo_ms", "itl_slo_ms", "slo_admission", "slo_classes", "decode_stretch"})

    def __init__(self, options: ContinuousOptions, kvcache, max_model_len: int):
        super().__init__(options, kvcache, max_model_len)
        # how long a step takes, learnt from the steps run (used only with targets)
        self.step_model = StepTimeModel()

    @classmethod
    def max_running(cls, options: ContinuousOptions) -> int:
        return options.max_num_seqs

    def targets(self, request: Request) -> tuple[float, float]:
        """The (TTFT, ITL) targets of a request in seconds, by its priority class; 0: none."""
        return targets_of(self.options, request.priority)

    @property
    def has_targets(self) -> bool:
        options = self.options
        return bool(options.ttft_slo_ms or options.itl_slo_ms
                    or any(s.ttft_slo_ms or s.itl_slo_ms for s in options.slo_classes))

    def waiting_key(self, request: Request) -> tuple:
        # with targets, earliest TTFT deadline first; a request preempted after its first token before any
        deadline = ()
        if self.has_targets:
            ttft = self.targets(request)[0]
            deadline = (0 if request.num_output_tokens else 1, request.added_at + ttft if ttft else math.inf)
        if self.options.policy == "priority":
            return (request.priority, *deadline, request.arrival_order)
        return (*deadline, request.arrival_order)

    def pick_victim(self) -> Request | None:
        candidates = [r for r in self.running if not r.in_flight]
        if not candidates:
            return None
        if self.options.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_order))
        return candidates[-1]

    def can_admit(self, request: Request) -> bool:
        if len(self.running) >= self.options.max_num_seqs:
            return False
        if not self.running or not self.has_targets:
            return True
        # one more decode must leave the step within the tightest ITL target (protect the running first)
        itl = self._itl_target([*self.running, request])
        return room_for_decode(self.step_model, itl, self._decodes([*self.running, request]))

    def chunk_limit(self, budget: int) -> int:
        return min(budget, self.options.long_prefill_token_threshold or budget)

    def token_budget(self) -> int:
        most, stretch = self.options.max_num_batched_tokens, self.options.decode_stretch
        if not self.has_targets and not stretch:
            return most
        decoding = [r for r in self.running if r.num_uncomputed_tokens - r.num_in_flight_tokens <= 1]
        prefilling = [r.num_computed_tokens for r in self.running if r.num_uncomputed_tokens > 1]
        step = self._decodes(decoding)
        if self.has_targets:
            itl, floor, headroom = self._itl_target(self.running), MIN_PROMPT_TOKENS, None
        else:  # (the decodes' own step time, stretched: their noise is theirs with or without prompts, so no
            # headroom; a prompt moves by a token a step at least)
            itl, floor, headroom = stretch * self.step_model.predict(step) or math.inf, 1, 1.0
        budget = prompt_budget(self.step_model, itl, step, prefilling[0] if prefilling else 0,
                               max(most - step.decodes, 0), floor, headroom)
        return min(most, step.decodes + budget)

    def observe_step(self, spans: list[tuple[int, int]], seconds: float) -> None:
        if self.has_targets or self.options.decode_stretch:
            self.step_model.observe(step_features(spans), seconds)

    def check_admission(self, request: Request) -> None:
        ttft, _ = self.targets(request)
        if not ttft or self.options.slo_admission != "reject" or not self.step_model.ready:
            return
        uncached = self._uncached_tokens(request)
        # (at the fit's pace, not the latest steps': a neighbour slowing the machine for now is the load's doing, a
        # 429; one that stays is in the fit within its horizon)
        alone = ttft_wait(self.step_model, uncached, self.chunk_limit(self.options.max_num_batched_tokens),
                          StepFeatures(), paced=False)
        if alone > ttft:  # (a 429 would have clients retry what no wait can help)
            raise RequestRejected(
                f"its prompt alone would take about {alone:.1f} s to a first token, past this server's TTFT target "
                f"({ttft * 1000:.0f} ms), however idle the server: send a shorter prompt", 400)
        # (a P99 target: the wait as long as the steps' overruns of their predictions make it, the headroom)
        wait = self.predicted_ttft(request, uncached) * self.step_model.headroom
        if wait > ttft:
            raise RequestRejected(
                f"the first token would come in about {wait:.1f} s, past this server's TTFT target "
                f"({ttft * 1000:.0f} ms): the prompts ahead need that long at the load now; retry later", 429,
                retry_after=max(1.0, wait - ttft))

    def predicted_ttft(self, request: Request, uncached: int | None = None) -> float:
        """Seconds until ``request``'s first token if it joined the waiting queue now: the prompt tokens ahead of
        it (its own the prefix cache lacks, ``uncached`` where the caller counted them, the waiting requests' due
        before it, the running prompts' rest) at the prompt budget the ITL target leaves; and, where the decode
        batch is full, until the first running request can end."""
        model = self.step_model
        key = self.waiting_key(request)
        ahead = self._uncached_tokens(request) if uncached is None else uncached
        ahead += sum(r.num_uncomputed_tokens for r in self.running if r.num_uncomputed_tokens > 1)
        ahead += sum(r.num_uncomputed_tokens for r in self.waiting if self.waiting_key(r) <= key)
        step = self._decodes(self.running)
        itl = self._itl_target([*self.running, request])
        most = max(self.options.max_num_batched_tokens - step.decodes, 1)
        wait = ttft_wait(model, ahead, prompt_budget(model, itl, step, 0, most), step)
        full = len(self.running) >= self.options.max_num_seqs or not room_for_decode(
            model, itl, self._decodes([*self.running, request]))
        if full and self.running:  # (the fewest tokens a running request may still generate, as an upper bound)
            left = min(r.max_total_tokens - r.num_tokens for r in self.running)
            wait += left * model.predict(step)
        return wait

    def _uncached_tokens(self, request: Request) -> int:
        """The request's tokens less the prefix the device pool holds (a chat's earlier turns): what it computes."""
        cached = 0
        for digest in self.kvcache.prefix_digests(request):
            if not self.kvcache.is_cached(digest):
                break
            cached += 1
        return request.num_tokens - cached * self.kvcache.block_size

    def _itl_target(self, requests) -> float:
        """The tightest ITL target among ``requests`` (seconds; 0: none)."""
        return min((itl for r in requests if (itl := self.targets(r)[1])), default=0.0)

    @staticmethod
    def _decodes(requests) -> StepFeatures:
        """The features of a step in which each of ``requests`` decodes one token."""
        context = sum(r.num_tokens for r in requests)
        return StepFeatures(0, len(requests), context, float(context))
