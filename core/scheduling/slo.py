"""Latency targets the scheduler keeps: the step-time model it fits as it runs, and what it decides from it.

With ``[scheduler] ttft_slo_ms`` or ``itl_slo_ms`` set (the continuous scheduler), every step:

- **prompt budget**: a step's time is the inter-token latency of every request decoding in it, so the prompt
  tokens a step takes are the most whose predicted step time stays within the tightest ITL target of the
  running requests over the model's headroom (``prompt_budget``; the headroom is how far recent steps overran
  their predictions, their 99th percentile: a P99 target holds only if overruns are rare), between a floor that
  keeps prompts moving and the configured ``max_num_batched_tokens``. No decodes running: the whole budget
  (nothing to protect).
- **decode batch**: a waiting request starts only while the step with one more decode still fits the ITL
  target (``room_for_decode``).
- **order**: waiting prompts by their TTFT deadline (arrival + the target of their priority class), earliest
  first; requests preempted after their first token before any.
- **admission**: a new request whose TTFT the queue ahead of it already makes miss its target (``ttft_wait``:
  the prompt tokens ahead of it at the rate the ITL target leaves for prompts) is refused with 429 and a
  Retry-After of the seconds the backlog needs to drain that far (``slo_admission = "reject"``, the default),
  or queued all the same (``"queue"``). Running requests' ITL is protected first: the budget never grows to
  rescue a prompt's TTFT.

The model (``StepTimeModel``): seconds = a + b x prompt tokens + c x decodes + d x context tokens + e x
attended pairs, the simulator's calibrated cost model (``conveyor.bench.costs``) in the terms a scheduler
sees before it runs a step: the context tokens are the keys the step reads (each entry's start + n: a
decode's attention reads its context, a bandwidth cost), the pairs the (query, key) products (a prompt chunk
of n tokens at position p attends about n (p + n / 2) of them, a compute cost). It is fitted online by least
squares over the steps the engine reports (``Scheduler.observe_step``), older steps forgotten
exponentially, coefficients kept at or above 0; every prediction is scaled by the pace, the last
``PACE_STEPS`` steps' seconds over the fit's for them: a neighbour that takes part of the CPU (or leaves it)
moves the budget within a few steps, where the fit alone would take its horizon of hundreds. Until it has seen
a few steps, and a step with prompt tokens beside decodes, a step beside decodes takes
``PROBE_PROMPT_TOKENS`` prompt tokens at most (to learn what they cost without stalling the decodes), and
admission takes every request.

The idea of choosing each step's prompt budget from a latency model, and of goodput (requests meeting both
targets per second) as what to maximize, follows DistServe (Zhong et al., OSDI 2024) and SLOs-Serve (2025); the
cost model and the policy are this project's own.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

# features' scales, so that the least-squares problem is well conditioned: 1, tokens, decodes, context, pairs
_SCALES = np.array([1.0, 1e3, 1e2, 1e5, 1e7])
_FEATURES = len(_SCALES)
# steps observed before the model predicts
MIN_STEPS = 4
# a step is planned to take the ITL target divided by the headroom: this quantile of the ratios of the recent
# steps' times to what the model predicted for them (the model's error, and the device's jitter: a P99 target
# is met only if steps that overrun their prediction are rare), at least MIN_HEADROOM
HEADROOM_QUANTILE = 0.99
MIN_HEADROOM = 1.05
# the latest steps whose time over what the fit predicted for them (the pace) scales every prediction
PACE_STEPS = 9
# until RATIOS_NEEDED ratios are known
DEFAULT_HEADROOM = 1 / 0.9
RATIOS_NEEDED = 20
RATIOS_KEPT = 256
# the fewest prompt tokens a step with prompts waiting takes, however tight the ITL target: prompts keep moving
MIN_PROMPT_TOKENS = 16
# the most a step beside decodes takes before the model has seen what prompt tokens cost
PROBE_PROMPT_TOKENS = 64


class StepFeatures(NamedTuple):
    """What a step's time depends on, as a scheduler sees it before running the step."""

    prompt_tokens: int = 0
    decodes: int = 0
    # keys read: each entry's start + n
    context_tokens: int = 0
    # (query, key) products: each entry's n (start + (n + 1) / 2)
    pairs: float = 0.0

    def plus_prompt(self, start: int, n: int) -> StepFeatures:
        """These features with a prompt chunk of ``n`` tokens from position ``start`` added."""
        return StepFeatures(self.prompt_tokens + n, self.decodes, self.context_tokens + start + n,
                            self.pairs + n * (start + (n + 1) / 2))


def targets_of(options: Any, priority: int) -> tuple[float, float]:
    """The (TTFT, ITL) targets in seconds (0: none) that scheduler ``options`` set for a request of ``priority``:
    its class's in ``slo_classes``, else ``ttft_slo_ms`` and ``itl_slo_ms`` (a scheduler without them: none)."""
    ttft, itl = getattr(options, "ttft_slo_ms", 0.0), getattr(options, "itl_slo_ms", 0.0)
    for slo in getattr(options, "slo_classes", ()):
        if slo.priority == priority:
            ttft, itl = slo.ttft_slo_ms or ttft, slo.itl_slo_ms or itl
            break
    return ttft / 1000, itl / 1000


def itl_p99(gaps: Sequence[float]) -> float:
    """The P99 (nearest rank) of one request's gaps between tokens; 0 for none."""
    return sorted(gaps)[math.ceil(0.99 * len(gaps)) - 1] if gaps else 0.0


def met_targets(ttft_s: float, gaps: Sequence[float], targets: tuple[float, float]) -> tuple[bool, bool]:
    """Whether a request met its (TTFT, ITL) targets: its time to first token, and the P99 of its gaps between
    tokens (``itl_p99``); a target of 0 is always met."""
    ttft_target, itl_target = targets
    return (not ttft_target or ttft_s <= ttft_target), (not itl_target or itl_p99(gaps) <= itl_target)


def step_features(spans: Iterable[tuple[int, int]]) -> StepFeatures:
    """The features of a step whose entries start at position ``start`` and compute ``n`` tokens each
    (``spans``: (start, n) pairs); an entry of one token is a decode."""
    prompt = decodes = context = 0
    pairs = 0.0
    for start, n in spans:
        if n == 1:
            decodes += 1
        else:
            prompt += n
        context += start + n
        pairs += n * (start + (n + 1) / 2)
    return StepFeatures(prompt, decodes, context, pairs)


class StepTimeModel:
    """seconds = a + b x prompt tokens + c x decodes + d x context tokens + e x pairs, fitted to the steps
    observed.

    Least squares with exponential forgetting (a step ``horizon`` steps old weighs 1/e as much as the newest)
    and a tiny ridge toward 0, so that a term no step has exercised contributes nothing; a coefficient the fit
    makes negative is dropped and the rest fitted again (as ``conveyor.bench.costs.calibrate`` does).
    """

    def __init__(self, horizon: int = 256, ridge: float = 1e-9):
        self.decay = math.exp(-1.0 / horizon)
        self.ridge = ridge
        self.gram = np.zeros((_FEATURES, _FEATURES))
        self.moments = np.zeros(_FEATURES)
        self.count = 0
        # steps seen with prompt tokens beside decodes (what a prompt token costs a decode's latency)
        self.mixed_count = 0
        self.coefficients = np.zeros(_FEATURES)  # per unit of each feature (unscaled)
        # steps with decodes: their seconds over the seconds predicted for them before they were observed
        self.ratios: deque[float] = deque(maxlen=RATIOS_KEPT)
        # what a step's planned time is divided by: how far recent steps overran their predictions (the
        # HEADROOM_QUANTILE of the ratios, at least MIN_HEADROOM; DEFAULT_HEADROOM until RATIOS_NEEDED are known)
        self.headroom = DEFAULT_HEADROOM
        # the latest steps' (seconds, the fit's prediction for them), and the pace: their seconds over the fit's,
        # what predictions are scaled by (how much faster or slower the machine runs now than the steps the fit
        # remembers; a sum, so that the large steps weigh most: a tiny step's ratio is mostly noise)
        self.recent: deque[tuple[float, float]] = deque(maxlen=PACE_STEPS)
        self.pace = 1.0

    @property
    def ready(self) -> bool:
        return self.count >= MIN_STEPS

    def observe(self, features: StepFeatures, seconds: float) -> None:
        if self.ready and (fitted := self._fitted(features)) > 0:
            if features.decodes:  # (how far the step overran what was predicted for it)
                self.ratios.append(seconds / (fitted * self.pace))
                if len(self.ratios) >= RATIOS_NEEDED:
                    ratios = sorted(self.ratios)
                    self.headroom = max(MIN_HEADROOM, ratios[math.ceil(HEADROOM_QUANTILE * len(ratios)) - 1])
            self.recent.append((seconds, fitted))
            self.pace = sum(s for s, _ in self.recent) / sum(f for _, f in self.recent)
        x = np.array([1.0, *features]) / _SCALES
        self.gram = self.decay * self.gram + np.outer(x, x)
        self.moments = self.decay * self.moments + x * seconds
        self.count += 1
        self.mixed_count += bool(features.prompt_tokens and features.decodes)
        self._fit()

    def _fit(self) -> None:
        active = list(range(_FEATURES))
        fit = np.zeros(0)
        while active:
            gram = self.gram[np.ix_(active, active)] + self.ridge * np.eye(len(active))
            fit = np.linalg.solve(gram, self.moments[active])
            if (fit >= 0).all():
                break
            del active[int(np.argmin(fit))]
        coefficients = np.zeros(_FEATURES)
        coefficients[active] = fit
        self.coefficients = coefficients / _SCALES

    def _fitted(self, features: StepFeatures) -> float:
        return float(self.coefficients[0] + np.dot(self.coefficients[1:], features))

    def predict(self, features: StepFeatures, paced: bool = True) -> float:
        """Seconds of a step of ``features``: the fit's, at the pace of the latest steps unless not ``paced``."""
        return (self.pace if paced else 1.0) * self._fitted(features)


def prompt_budget(model: StepTimeModel, itl_target_s: float, step: StepFeatures, start: int, most: int,
                  floor: int = MIN_PROMPT_TOKENS, headroom: float | None = None) -> int:
    """Prompt tokens a step of ``step``'s decodes may take (a chunk from position ``start``) so that its predicted
    time stays within the ITL target over the headroom (the model's where not given): at least ``floor``, at most
    ``most``."""
    if not step.decodes or not itl_target_s:
        return most
    if not model.ready or not model.mixed_count:
        return min(PROBE_PROMPT_TOKENS, most)
    limit = itl_target_s / (model.headroom if headroom is None else headroom)
    low, high = 0, most  # (the predicted time grows with the tokens: the largest that fits, by bisection)
    while low < high:
        mid = (low + high + 1) // 2
        if model.predict(step.plus_prompt(start, mid)) <= limit:
            low = mid
        else:
            high = mid - 1
    return max(min(floor, most), low)


def room_for_decode(model: StepTimeModel, itl_target_s: float, step: StepFeatures) -> bool:
    """Whether a step of ``step``'s decodes and the fewest prompt tokens a step takes is predicted within the
    ITL target over the model's headroom."""
    if not itl_target_s or not model.ready:
        return True
    return model.predict(step.plus_prompt(0, MIN_PROMPT_TOKENS)) <= itl_target_s / model.headroom


def ttft_wait(model: StepTimeModel, tokens_ahead: int, budget: int, step: StepFeatures, paced: bool = True) -> float:
    """Predicted seconds until ``tokens_ahead`` prompt tokens (a new request's own and those before it) are
    computed, at ``budget`` prompt tokens a step beside ``step``'s decodes (at the latest steps' pace unless not
    ``paced``)."""
    if tokens_ahead <= 0 or not model.ready:
        return 0.0
    chunk = min(max(budget, 1), tokens_ahead)
    return math.ceil(tokens_ahead / chunk) * model.predict(step.plus_prompt(0, chunk), paced)
