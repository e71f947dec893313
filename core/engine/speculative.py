"""Speculative decoding's proposer: n-gram prompt lookup.

After each step, a request about to decode looks for the latest earlier
place where its last ``n`` tokens occurred (``ngram_max`` down to
``ngram_min``), in its prompt or its output, and proposes the tokens that
followed there. The next step computes the request's last token and the
proposals in one forward pass (as a short prompt chunk); the sampler accepts
proposals while they are what the model would have drawn (greedy: the
argmax; sampled: rejection sampling, which keeps the model's distribution)
and adds one token of its own after them. Repetitive work (summaries, edits
of a given text, code) accepts many; the rest costs a little more compute
per step.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from conveyor.config import EngineConfig
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


class NgramProposer:
    def __init__(self, config: EngineConfig):
        self.k = config.num_speculative_tokens
        self.n_max = config.ngram_max
        self.n_min = min(config.ngram_min, config.ngram_max)

    def propose(self, requests: list[Request]) -> None:
        """Set ``draft_token_ids`` of each request that decodes next (none for requests under a penalty or a
        grammar, whose next token depends on the ones before in ways the check does not follow)."""
        for request in requests:
            params = request.params
            if (request.status != RequestStatus.RUNNING or request.num_uncomputed_tokens != 1
                    or params.has_penalties or params.structured is not None):
                continue
            room = min(self.k, request.max_total_tokens - request.num_tokens - 1)
            if room > 0:
                request.draft_token_ids = propose_ngram(request.all_token_ids(), self.n_max, self.n_min, room)
