"""Prompt logprobs as a step's outputs carry them: each request's new positions, none sent twice."""

from __future__ import annotations

from conveyor.messages import RequestOutput, RunnerOutput, StepInput
from conveyor.scheduler import ScheduledBatch


def add_prompt_logprobs(
    batch: ScheduledBatch, step: StepInput, result: RunnerOutput, outputs: list[RequestOutput]
) -> list[RequestOutput]:
    """Attach each request's new prompt logprobs to its output (one made if the step sampled nothing);
    positions sent before (a recomputation after preemption) are not sent again."""
    by_id = {o.request_id: o for o in outputs}
    for request, entry, logprobs in zip(batch.requests, step.requests, result.prompt_logprobs):
        if not logprobs:
            continue
        first = entry.start + 1  # the prompt position row 0 predicts
        skip = max(0, request.num_prompt_logprobs + 1 - first)
        if skip >= len(logprobs):
            continue
        output = by_id.get(request.request_id)
        if output is None:
            output = by_id[request.request_id] = RequestOutput(request.request_id,
                                                               num_prompt_tokens=request.num_prompt_tokens)
            outputs.append(output)
        output.prompt_logprobs = logprobs[skip:]
        output.prompt_logprobs_start = first + skip
        request.num_prompt_logprobs = first + len(logprobs) - 1
    return outputs
