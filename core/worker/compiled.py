"""Decode steps through compiled graphs: one per batch size, inputs in buffers allocated once.

A step whose requests are all single-token decodes (the steady state of a
busy server) runs in the graph of the smallest compiled batch size that holds
it. Its inputs are written in place into the runner's input buffers
(``conveyor.worker.inputs``: token, position, slot, block table row, context
length); the rows past its requests are padding that writes and reads the KV
storage's pad block, which no request owns. Prefill and mixed steps run
eagerly, over the same buffers.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from conveyor.attention.backend import AttentionBackend
from conveyor.messages import StepInput
from conveyor.model.decoder_model import DecoderModel
from conveyor.model.graph_ops import paged_decode_op, register_backend
from conveyor.worker.inputs import InputBuffers
from conveyor.worker.rows import BatchRows

logger = logging.getLogger("conveyor")


def use_inductor_cache(root: Path) -> None:
    """Keep inductor's compiled kernels under ``root`` (unless TORCHINDUCTOR_CACHE_DIR says otherwise), so a
    restart finds them instead of compiling again."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))


class CompiledDecode:
    """torch.compile'd decode forward passes (inductor), one graph per batch size."""

    def __init__(self, model: DecoderModel, attention: AttentionBackend, batch_sizes: list[int], max_model_len: int):
        self.model = model
        self.attention = attention
        self.backend_number = register_backend(attention)
        self.batch_sizes = sorted(set(batch_sizes))
        storage = attention.storage
        self.pad_slot = storage.pad_block * storage.block_size
        rows, width = self.batch_sizes[-1], -(-max_model_len // storage.block_size)
        # the runner's input buffers too; they hold the largest batch and the longest table from the start
        self.inputs = InputBuffers(storage.block_size, model.device, tokens=rows, rows=rows, width=width,
                                   pad_block=storage.pad_block)
        # One graph per batch size. Dynamo keeps graphs per code object, shared by every instance of this
        # class in the process (each guarded by its own model), so each instance adds its own room.
        torch._dynamo.config.recompile_limit += len(self.batch_sizes) + 1
        # on CUDA each graph is also captured as a CUDA graph (inductor's cudagraph trees) and replayed: one
        # launch per step instead of one per kernel
        mode = "reduce-overhead" if model.device.type == "cuda" else "default"
        self.forward = torch.compile(self._forward, fullgraph=True, dynamic=False, mode=mode)
        # steps run in a graph (start-up's compiling passes not counted)
        self.num_steps = 0

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        number = self.backend_number

        def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return paged_decode_op(q, k, v, slot_mapping, block_tables, context_lens, layer, number)

        return self.model.compute_logits(self.model.forward(input_ids, positions, attention))

    @torch.inference_mode()
    def compile_all(self) -> None:
        """Compile every batch size now (a forward pass of padding rows each), logging the time of each."""
        started = time.perf_counter()
        for size in self.batch_sizes:
            began = time.perf_counter()
            self._run(0, size)
            logger.info("compiled the decode graph for batch size %d in %.1f s", size, time.perf_counter() - began)
        logger.info("decode graphs for batch sizes %s ready in %.1f s", self.batch_sizes,
                    time.perf_counter() - started)

    def accepts(self, step: StepInput) -> bool:
        """Whether this step runs in a graph: single-token decodes only, no more than the largest batch size,
        no prompt logprobs, no LoRA adapter (a graph holds no adapter terms), no embedding."""
        requests = step.requests
        return (
            0 < len(requests) <= self.batch_sizes[-1]
            and step.num_decodes == len(requests)
            and all(len(r.token_ids) == 1 and not r.prompt_logprob_token_ids and r.lora_slot < 0
                    and not r.params.pooling for r in requests)
        )

    def run(self, step: StepInput, rows: BatchRows) -> torch.Tensor:
        """The step's logits ``[requests, vocab]`` float32 (where ``accepts(step)``; ``rows`` hold its
        requests' tables)."""
        n = len(step.requests)
        size = next(s for s in self.batch_sizes if s >= n)
        self.num_steps += 1
        self.inputs.write(step, rows)
        return self._run(n, size)[:n]

    def _run(self, n: int, size: int) -> torch.Tensor:
        # rows n .. size pad the batch: they must not write over a request's slots (an earlier, larger step
        # left its rows there)
        inputs = self.inputs
        inputs.slot_mapping.array[n:size] = self.pad_slot
        inputs.block_tables.array[n:size, 0] = self.attention.storage.pad_block
        inputs.context_lens.array[n:size] = 1
        inputs.input_ids.array[n:size] = 0
        inputs.positions.array[n:size] = 0
        return self.forward(inputs.input_ids.view(size), inputs.positions.view(size), inputs.slot_mapping.view(size),
                            inputs.block_tables.view(size), inputs.context_lens.view(size))
