"""The model runner: one step's tensors in, a sampled token per finished sequence out."""

from __future__ import annotations

import time

import torch

from conveyor.attention.backend import AttentionBackend
from conveyor.messages import RunnerOutput, ScheduledRequest, StepInput, TokenLogprob
from conveyor.model.decoder_model import DecoderModel
from conveyor.model.lora import Adapters
from conveyor.model.native_decode import NativeDecode
from conveyor.worker.compiled import CompiledDecode
from conveyor.worker.drafter import Drafter
from conveyor.worker.inputs import InputBuffers
from conveyor.worker.sampler import Sampler, token_logprobs


class ModelRunner:
    """Runs one forward pass over a step's requests and samples."""

    def __init__(self, model: DecoderModel, attention: AttentionBackend, sampler: Sampler,
                 compiled: CompiledDecode | None = None, adapters: Adapters | None = None,
                 drafter: Drafter | None = None, native_decode: bool = True):
        """
        Args:
            compiled: graphs for steps of decodes only (the others run eagerly); None: every step eagerly.
            adapters: the model's LoRA slots ([lora] max_loras > 0).
            drafter: the draft model ([engine] speculative = "draft"), which follows every step (eagerly).
            native_decode: steps of decodes run every layer in one C++ call where the model allows
                (``conveyor.model.native_decode``); False: layer by layer.
        """
        self.model = model
        self.attention = attention
        self.sampler = sampler
        self.compiled = compiled
        self.adapters = adapters
        self.drafter = drafter
        self.native_decode = NativeDecode.build(model, attention) if native_decode else None
        self.device = model.device
        # the step's input tensors (the compiled graphs take them too)
        self.inputs = compiled.inputs if compiled is not None else InputBuffers(
            attention.storage.block_size, self.device, pad_block=attention.storage.pad_block)
        # one row per running request (the worker applies each step to them; the sampler keeps its state there)
        self.rows = sampler.rows

    @torch.inference_mode()
    def execute(self, step: StepInput) -> RunnerOutput:
        """
        Args:
            step: the requests, decodes first, each with the tokens it computes and where its KV lives,
                applied to ``rows`` already.

        Returns:
            Per request, the sampled token (None for a prefill chunk that stops
            short of the last known token), its logprobs, and prompt logprobs where asked.
            Workers other than the driver (TP rank 0 of the last pipeline stage) return only their times.
        """
        began = time.perf_counter()
        if self.adapters is not None:
            self.adapters.prepare([(r.lora_slot, len(r.token_ids)) for r in step.requests])
        if self.compiled is not None and self.compiled.accepts(step):
            logits = self.compiled.run(step, self.rows)
            rows = [i for i, r in enumerate(step.requests) if r.sample]  # (a one-token prompt chunk may not)
            if len(rows) < len(step.requests):
                logits = logits[torch.tensor(rows, device=self.device)]
            output = RunnerOutput([None] * len(step.requests), [None] * len(step.requests))
            return self._sample(step, logits if rows else None, rows, output, began)
        rows = 0
        # rows of the hidden states whose logits are needed: the last row of each sampled request (and the
        # rows before it that predict its draft tokens), and the rows of requests that asked for prompt logprobs
        sample_rows: list[int] = []
        sampled_entries: list[int] = []
        prompt_rows: list[tuple[int, int, int]] = []  # (entry, first row, rows)
        pooled_rows: list[tuple[int, int, int]] = []  # (entry, first row, rows): requests that want an embedding
        for i, request in enumerate(step.requests):
            first, rows = rows, rows + len(request.token_ids)
            if request.params.pooling:
                pooled_rows.append((i, first, len(request.token_ids)))
            elif request.sample:
                sample_rows.extend(range(rows - 1 - len(request.draft_token_ids), rows))
                sampled_entries.append(i)
            if request.prompt_logprob_token_ids:
                prompt_rows.append((i, first, len(request.prompt_logprob_token_ids)))
        model, group = self.model, self.model.group
        carried = None
        if not model.first_stage:
            carried = group.recv_prev((2, rows, model.spec.hidden_size), model.dtype, self.device)
        inputs = self.inputs.prepare(step, self.attention, self.rows)
        if self.native_decode is not None and self.native_decode.accepts(inputs.attention, rows):
            hidden = self.native_decode.forward(inputs.input_ids, inputs.positions, inputs.attention)
        else:
            hidden = model.forward(inputs.input_ids, inputs.positions, inputs.attention, carried)
        if not model.last_stage:
            group.send_next(hidden)
            return self._timed(RunnerOutput([], []), began)
        output = RunnerOutput([None] * len(step.requests), [None] * len(step.requests))
        # every TP worker of the last stage computes its part of the logits; the driver samples
        if prompt_rows:
            output.prompt_logprobs = self._prompt_logprobs(hidden, step.requests, prompt_rows)
        logits = None
        if sample_rows:
            # (every row, in order, where each request samples one token: a decode step's usual case, which
            # then skips a gather that took 50-90 us with the caches cold after the layers: one stream, 2-core EPYC)
            selected = hidden if len(sample_rows) == rows else hidden[torch.tensor(sample_rows, device=self.device)]
            logits = model.compute_logits(selected)
        if not group.placement.driver:
            return self._timed(RunnerOutput([], []), began)
        if pooled_rows:
            output.embeddings = self._pool(hidden, step.requests, pooled_rows)
        output = self._sample(step, logits, sampled_entries, output, began)
        if self.drafter is not None:
            drafting = time.perf_counter()
            output.draft_token_ids = self.drafter.propose(step, output, self.rows)
            output.forward_time += time.perf_counter() - drafting
        return output

    def _sample(self, step: StepInput, logits: torch.Tensor | None, sampled_entries: list[int],
                output: RunnerOutput, began: float) -> RunnerOutput:
        """Sample a token for each of ``sampled_entries`` (the requests the rows of ``logits`` belong to)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        middle = time.perf_counter()
        if logits is not None and any(step.requests[i].draft_token_ids for i in sampled_entries):
            logits = self._verify(step, logits, sampled_entries, output)
            sampled_entries = [i for i in sampled_entries if not step.requests[i].draft_token_ids]
        if logits is not None:
            allowed = None
            if step.grammar_rows:  # (structured output: the rows of logits under a grammar, and their bitmask)
                row_of = {entry: row for row, entry in enumerate(sampled_entries)}
                bitmask = torch.frombuffer(bytearray(step.bitmask), dtype=torch.int32).view(len(step.grammar_rows), -1)
                allowed = ([row_of[entry] for entry in step.grammar_rows], bitmask)
            tokens, entries = self.sampler.sample(logits, [step.requests[i] for i in sampled_entries], allowed)
            for i, token, entry in zip(sampled_entries, tokens, entries):
                output.sampled[i] = token
                output.logprobs[i] = entry
        output.sample_time = time.perf_counter() - middle
        return self._timed(output, began, middle)

    def _verify(self, step: StepInput, logits: torch.Tensor, sampled_entries: list[int],
                output: RunnerOutput) -> torch.Tensor | None:
        """Check the draft tokens of the entries that have them (their rows of ``logits``: one per draft and
        one after); returns the logits of the other entries (a row each), or None when there are none."""
        output.accepted = [[] for _ in step.requests]
        output.accepted_logprobs = [None] * len(step.requests)
        plain_rows: list[int] = []
        row = 0
        for i in sampled_entries:
            request = step.requests[i]
            drafts = len(request.draft_token_ids)
            if not drafts:
                plain_rows.append(row)
                row += 1
                continue
            tokens, entries = self.sampler.verify(logits[row : row + drafts + 1], request)
            output.accepted[i], output.sampled[i] = tokens[:-1], tokens[-1]
            output.accepted_logprobs[i], output.logprobs[i] = entries[:-1], entries[-1]
            row += drafts + 1
        return logits[torch.tensor(plain_rows, device=logits.device)] if plain_rows else None

    def _timed(self, output: RunnerOutput, began: float, middle: float | None = None) -> RunnerOutput:
        """Fill in the step's times (``middle``: where sampling began)."""
        output.forward_time = (middle or time.perf_counter()) - began
        counts = self.model.group.take_counts()
        output.comm_time, output.wait_time = counts.comm_time, counts.wait_time
        output.num_collectives, output.collective_bytes = counts.num_collectives, counts.collective_bytes
        return output

    def _pool(self, hidden: torch.Tensor, requests: list[ScheduledRequest],
              pooled_rows: list[tuple[int, int, int]]) -> list[bytes | None]:
        """The embeddings of the pooling requests whose prompt this step finished (float32 bytes), None for the
        other entries; a "mean" request's earlier chunks are summed as they pass (from zero at position 0,
        which a recomputation after preemption starts from again)."""
        embeddings: list[bytes | None] = [None] * len(requests)
        for i, first, rows in pooled_rows:
            request = requests[i]
            if request.params.pooling == "last":
                if not request.sample:
                    continue  # (an earlier chunk: only the prompt's last row counts)
                vector = hidden[first + rows - 1].float()
            else:
                states = hidden[first : first + rows].float()
                row = self.rows.row(request)
                total, count = row.sums if request.start and row.sums is not None else (None, 0)
                total = states.sum(0) if total is None else total + states.sum(0)
                count += rows
                row.sums = None if request.sample else (total, count)
                if not request.sample:
                    continue
                vector = total / count
            embeddings[i] = vector.cpu().numpy().astype("<f4").tobytes()
        return embeddings

    def _prompt_logprobs(
        self, hidden: torch.Tensor, requests: list[ScheduledRequest], prompt_rows: list[tuple[int, int, int]]
    ) -> list[list[TokenLogprob] | None]:
        entries: list[list[TokenLogprob] | None] = [None] * len(requests)
        for i, first, rows in prompt_rows:
            request = requests[i]
            logits = self.model.compute_logits(hidden[first : first + rows])
            if logits is None:
                continue  # another TP worker's part of the vocabulary; the driver has the whole
            logprobs = torch.log_softmax(logits, dim=-1)
            entries[i] = token_logprobs(logprobs, request.prompt_logprob_token_ids, request.params.prompt_logprobs)
        return entries
