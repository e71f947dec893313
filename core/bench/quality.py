"""Teacher-forced quality: perplexity of a text and next-token agreement with a reference model."""

from __future__ import annotations

import math

import torch

from conveyor.entrypoints.llm import LLM
from conveyor.sampling import SamplingParams


def teacher_forced(llm: LLM, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the text through the engine as one prompt, asking for every prompt token's logprob.

    The prompt is computed in chunks of the scheduler's token budget: later
    chunks attend to K and V read back from the KV cache, so a quantized
    cache is part of what is measured.

    Returns:
        Per position (all but the last): the logprob of the true next token,
        and the model's most likely next token.
    """
    [completion] = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    entries = completion.prompt_logprobs
    assert entries is not None and len(entries) == len(ids) - 1
    return (torch.tensor([e.logprob for e in entries], dtype=torch.float64),
            torch.tensor([e.top_ids[0] for e in entries]))


def perplexity(target_logprobs: torch.Tensor) -> float:
    return math.exp(-float(target_logprobs.double().mean()))


def agreement(predictions: torch.Tensor, reference: torch.Tensor) -> float:
    """Fraction of positions where both models' most likely next token is the same."""
    return float((predictions == reference).double().mean())
