"""Teacher-forced quality: perplexity of a text and next-token agreement with a reference model."""

from __future__ import annotations

import math

import torch

from conveyor.llm import LLM
from conveyor.request import Request
from conveyor.sampling import SamplingParams


def teacher_forced(llm: LLM, ids: list[int], chunk: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the text through the engine's model in prefill chunks of ``chunk`` tokens.

    Later chunks attend to K and V read back from the KV cache, so a
    quantized cache is part of what is measured.

    Returns:
        Per position (all but the last): the logprob of the true next token,
        and the model's most likely next token.
    """
    core = llm.engine
    request = Request("teacher-forced", ids, SamplingParams(max_tokens=1), core.max_model_len)
    target_logprobs, predictions = [], []
    device = core.device
    try:
        with torch.inference_mode():
            for start in range(0, len(ids) - 1, chunk):
                n = min(chunk, len(ids) - 1 - start)
                if not core.kvcache.allocate(request, n):
                    raise ValueError(f"the KV cache cannot hold {start + n} tokens")
                attention = core.kvcache.prepare([request], [n], 0)
                positions = torch.arange(start, start + n, device=device)
                hidden = core.model.forward(torch.tensor(ids[start : start + n], device=device), positions, attention)
                logprobs = torch.log_softmax(core.model.compute_logits(hidden).float(), dim=-1)
                targets = torch.tensor(ids[start + 1 : start + n + 1], device=device)
                target_logprobs.append(logprobs.gather(1, targets[:, None])[:, 0].cpu())
                predictions.append(logprobs.argmax(dim=-1).cpu())
                request.num_computed_tokens += n
    finally:
        core.kvcache.free(request)
    return torch.cat(target_logprobs), torch.cat(predictions)


def perplexity(target_logprobs: torch.Tensor) -> float:
    return math.exp(-float(target_logprobs.double().mean()))


def agreement(predictions: torch.Tensor, reference: torch.Tensor) -> float:
    """Fraction of positions where both models' most likely next token is the same."""
    return float((predictions == reference).double().mean())
