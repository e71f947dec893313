"""The model runner: one step's tensors in, a sampled token per finished sequence out."""

from __future__ import annotations

import time

import torch

from conveyor.attention.backend import AttentionBackend, StepAttention
from conveyor.messages import RunnerOutput, ScheduledRequest, StepInput, TokenLogprob
from conveyor.model.llama import LlamaModel
from conveyor.worker.sampler import Sampler, token_logprobs


class ModelRunner:
    """Runs one forward pass over a step's requests and samples."""

    def __init__(self, model: LlamaModel, attention: AttentionBackend, sampler: Sampler):
        self.model = model
        self.attention = attention
        self.sampler = sampler
        self.device = model.device

    @torch.inference_mode()
    def execute(self, step: StepInput) -> RunnerOutput:
        """
        Args:
            step: the requests, decodes first, each with the tokens it computes and where its KV lives.

        Returns:
            Per request, the sampled token (None for a prefill chunk that stops
            short of the last known token), its logprobs, and prompt logprobs where asked.
        """
        began = time.perf_counter()
        self.sampler.forget(step.finished_request_ids)
        input_ids: list[int] = []
        positions: list[int] = []
        # rows of the hidden states whose logits are needed: the last row of each sampled request, and
        # the rows of requests that asked for prompt logprobs
        sample_rows: list[int] = []
        sampled_entries: list[int] = []
        prompt_rows: list[tuple[int, int, int]] = []  # (entry, first row, rows)
        for i, request in enumerate(step.requests):
            first = len(input_ids)
            input_ids.extend(request.token_ids)
            positions.extend(range(request.start, request.start + len(request.token_ids)))
            if request.sample:
                sample_rows.append(len(input_ids) - 1)
                sampled_entries.append(i)
            if request.prompt_logprob_token_ids:
                prompt_rows.append((i, first, len(request.prompt_logprob_token_ids)))
        hidden = self.model.forward(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            StepAttention(self.attention, step),
        )
        output = RunnerOutput([None] * len(step.requests), [None] * len(step.requests))
        if prompt_rows:
            output.prompt_logprobs = self._prompt_logprobs(hidden, step.requests, prompt_rows)
        logits = None
        if sample_rows:
            logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        middle = time.perf_counter()
        output.forward_time = middle - began
        if logits is not None:
            tokens, entries = self.sampler.sample(logits, [step.requests[i] for i in sampled_entries])
            for i, token, entry in zip(sampled_entries, tokens, entries):
                output.sampled[i] = token
                output.logprobs[i] = entry
            output.sample_time = time.perf_counter() - middle
        return output

    def _prompt_logprobs(
        self, hidden: torch.Tensor, requests: list[ScheduledRequest], prompt_rows: list[tuple[int, int, int]]
    ) -> list[list[TokenLogprob] | None]:
        entries: list[list[TokenLogprob] | None] = [None] * len(requests)
        for i, first, rows in prompt_rows:
            request = requests[i]
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[first : first + rows]), dim=-1)
            entries[i] = token_logprobs(logprobs, request.prompt_logprob_token_ids, request.params.prompt_logprobs)
        return entries
