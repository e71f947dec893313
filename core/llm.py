"""The offline API: ``LLM(config).generate(prompts, params)``."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Union

import msgspec

from conveyor.config import Config, load_config
from conveyor.engine import EngineCore
from conveyor.messages import EngineRequest, TokenLogprob
from conveyor.model.detokenizer import TextStream
from conveyor.sampling import SamplingParams

logger = logging.getLogger("conveyor")

# a plain prompt, or a chat conversation: [{"role": ..., "content": ...}, ...]
Prompt = Union[str, list[dict[str, Any]]]


class Completion(msgspec.Struct):
    """The result for one prompt."""

    text: str
    token_ids: list[int]
    # "stop" (end of sequence, stop token or stop string) or "length"
    finish_reason: str
    prompt_token_ids: list[int]
    # one entry per generated token when SamplingParams.logprobs was set
    logprobs: list[TokenLogprob] | None = None
    # seconds from the call to generate() to this prompt's first token, and to its last
    time_to_first_token: float = 0.0
    latency: float = 0.0


class LLM:
    """Generate text in-process, with the same engine the server runs.

    Args:
        config: a TOML file, a Config, or None for the built-in defaults.
        overrides: ``{"section.key": value}``, the same keys as ``--set``.
    """

    def __init__(self, config: str | Path | Config | None = None, overrides: Mapping[str, Any] | None = None):
        if isinstance(config, Config):
            if overrides:
                raise ValueError("overrides apply to a config file; edit the Config object instead")
            self.config = config
        else:
            self.config = load_config(config, overrides)
        self.engine = EngineCore(self.config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt; chat conversations go through the chat template."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return self.tokenizer.encode_chat(prompt)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Complete every prompt, batched together.

        Args:
            prompts: a string, a chat conversation, or a list of either.
            params: one SamplingParams for all prompts, or one per prompt.

        Returns:
            One Completion per prompt, in order.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], dict)):
            prompts = [prompts]
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        prompt_ids = [self.encode(p) for p in prompts]
        added: list[str] = []
        try:
            for request_id, tokens, p in zip(ids, prompt_ids, params):
                self.engine.add_request(EngineRequest(request_id, tokens, p, arrival_time=time.time()))
                added.append(request_id)
        except Exception:
            self.engine.abort(added)  # all or nothing
            raise
        streams = {i: TextStream(self.tokenizer, p) for i, p in zip(ids, params)}
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        logprobs: dict[str, list[TokenLogprob]] = {i: [] for i in ids}
        reasons: dict[str, str] = {}
        first_token: dict[str, float] = {}
        done: dict[str, float] = {}
        start = time.perf_counter()
        while self.engine.has_unfinished():
            step_outputs, stats = self.engine.step()
            if stats is None:  # a batching scheduler is still collecting requests
                time.sleep(0.001)
            for output in step_outputs:
                rid = output.request_id
                if rid in reasons:
                    continue
                now = time.perf_counter() - start
                first_token.setdefault(rid, now)
                tokens[rid].extend(output.new_token_ids)
                logprobs[rid].extend(output.new_logprobs or ())
                stream = streams[rid]
                stream.add(output.new_token_ids, final=output.finish_reason is not None)
                if output.finish_reason is not None:
                    reasons[rid] = output.finish_reason
                elif stream.stopped:
                    reasons[rid] = "stop"
                    self.engine.abort([rid])
                if rid in reasons:
                    done[rid] = now
        return [
            Completion(
                text=streams[i].text,
                token_ids=tokens[i],
                finish_reason=reasons[i],
                prompt_token_ids=pids,
                logprobs=logprobs[i] if p.logprobs is not None else None,
                time_to_first_token=first_token.get(i, 0.0),
                latency=done.get(i, 0.0),
            )
            for i, pids, p in zip(ids, prompt_ids, params)
        ]
