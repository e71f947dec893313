"""The model runner: batch tensors in, one sampled token per finished sequence out."""

from __future__ import annotations

import time

import torch

from conveyor.engine.sampler import Sampler
from conveyor.kvcache import KVCache
from conveyor.messages import TokenLogprob
from conveyor.model.llama import LlamaModel
from conveyor.scheduler import ScheduledBatch


class ModelRunner:
    """Runs one forward pass over a scheduled batch and samples."""

    def __init__(self, model: LlamaModel, kvcache: KVCache, sampler: Sampler):
        self.model = model
        self.kvcache = kvcache
        self.sampler = sampler
        self.device = model.device
        # seconds the last execute() spent before sampling (inputs + forward) and sampling
        self.forward_time = 0.0
        self.sample_time = 0.0

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[int | None], list[TokenLogprob | None]]:
        """
        Args:
            batch: the step's requests, decodes first, and how many tokens each computes.

        Returns:
            Per batch entry, the sampled token (None for a prefill chunk that
            stops short of the end of the known tokens) and its logprobs.
        """
        began = time.perf_counter()
        input_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        sample_entries: list[int] = []
        for i, (request, n) in enumerate(zip(batch.requests, batch.num_tokens)):
            start = request.num_computed_tokens
            input_ids.extend(request.token_ids(start, start + n))
            positions.extend(range(start, start + n))
            if start + n == request.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                sample_entries.append(i)
        attention = self.kvcache.prepare(batch.requests, batch.num_tokens, batch.num_decodes)
        hidden = self.model.forward(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            attention,
        )
        sampled: list[int | None] = [None] * len(batch)
        logprobs: list[TokenLogprob | None] = [None] * len(batch)
        if sample_rows:
            logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            middle = time.perf_counter()
            self.forward_time = middle - began
            tokens, entries = self.sampler.sample(logits, [batch.requests[i] for i in sample_entries])
            for i, token, entry in zip(sample_entries, tokens, entries):
                sampled[i] = token
                logprobs[i] = entry
            self.sample_time = time.perf_counter() - middle
        else:
            self.forward_time, self.sample_time = time.perf_counter() - began, 0.0
        return sampled, logprobs
