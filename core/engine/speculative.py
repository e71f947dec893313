"""Speculative decoding's proposers: n-gram prompt lookup, and a draft model's proposals.

After each step, a request about to decode looks for the latest earlier
place where its last ``n`` tokens occurred (``ngram_max`` down to
``ngram_min``), in its prompt or its output, and proposes the tokens that
followed there. The next step computes the request's last token and the
proposals in one forward pass (as a short prompt chunk); the sampler accepts
proposals while they are what the model would have drawn (greedy: the
argmax; sampled: rejection sampling, which keeps the model's distribution)
and adds one token of its own after them. Repetitive work (summaries, edits
of a given text, code) accepts many; the rest costs a little more compute
per step. With a draft model (``conveyor.worker.drafter``) the worker
proposes instead, and the engine core hands its proposals on the same way.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from conveyor.config import EngineConfig
from conveyor.messages import RunnerOutput
from conveyor.request import Request, RequestStatus


def propose_ngram(tokens: list[int], n_max: int, n_min: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the last ``n`` tokens (longest n
    first); [] when none occurs."""
    array = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        # windows that end before the last token, so that a token follows each
        windows = sliding_window_view(array[:-1], n)
        matches = np.flatnonzero((windows == array[-n:]).all(axis=1))
        if matches.size:
            start = int(matches[-1]) + n
            return tokens[start : start + k]
    return []


def room_for_drafts(request: Request, k: int) -> int:
    """Proposals a request may take for its next step: up to ``k`` where it decodes next, 0 for a request under a
    penalty or a grammar (its next token depends on the ones before in ways the check does not follow)."""
    params = request.params
    if (request.status != RequestStatus.RUNNING or request.num_uncomputed_tokens != 1
            or params.has_penalties or params.structured is not None):
        return 0
    return max(0, min(k, request.max_total_tokens - request.num_tokens - 1))


class NgramProposer:
    def __init__(self, config: EngineConfig):
        self.k = config.num_speculative_tokens
        self.n_max = config.ngram_max
        self.n_min = min(config.ngram_min, config.ngram_max)

    def propose(self, requests: list[Request], result: RunnerOutput) -> None:
        """Set ``draft_token_ids`` of each request that decodes next."""
        for request in requests:
            if room := room_for_drafts(request, self.k):
                request.draft_token_ids = propose_ngram(request.all_token_ids(), self.n_max, self.n_min, room)


class DraftModelProposer:
    def __init__(self, config: EngineConfig):
        self.k = config.num_speculative_tokens

    def propose(self, requests: list[Request], result: RunnerOutput) -> None:
        """Set ``draft_token_ids`` of each request that decodes next from the draft model's proposals."""
        for request, drafts in zip(requests, result.draft_token_ids):
            if room := room_for_drafts(request, self.k):
                request.draft_token_ids = drafts[:room]
