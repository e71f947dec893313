"""The offline API: ``LLM(config).generate(prompts, params)``.

It is the server without the server: the same frontend (limits, incremental
detokenization, stop strings) over an in-process engine client, whose step
loop runs while ``generate`` does.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from pathlib import Path
from typing import Any, Self

import anyio
import msgspec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from conveyor.config import Config, ConfigError, load_config
from conveyor.engine.core import EngineCore
from conveyor.engine.inproc import InprocClient
from conveyor.messages import LoraAdapter, TokenLogprob
from conveyor.model.tokenizer import load_tokenizer
from conveyor.sampling import SamplingParams
from conveyor.serving.frontend import EngineFrontend
from conveyor.serving.metrics import ServerMetrics
from conveyor.transport import RequestError, embedding_floats, unit_length

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

# a plain prompt, a chat conversation ([{"role": ..., "content": ...}, ...]), or token ids
Prompt = str | list[dict[str, Any]] | list[int]


class Completion(msgspec.Struct):
    """The result for one prompt."""

    text: str
    token_ids: list[int]
    # "stop" (end of sequence, stop token or stop string) or "length"
    finish_reason: str
    prompt_token_ids: list[int]
    # one entry per generated token when SamplingParams.logprobs was set
    logprobs: list[TokenLogprob] | None = None
    # one entry per prompt token after the first when SamplingParams.prompt_logprobs was set
    prompt_logprobs: list[TokenLogprob] | None = None
    # seconds from the call to generate() to this prompt's first token, and to its last
    time_to_first_token: float = 0.0
    latency: float = 0.0
    # with SamplingParams.pooling: the prompt's embedding (the final hidden states pooled, not normalized)
    embedding: list[float] | None = None


# Offline, throughput beats the latency of any one request: a larger step budget than the server's
# (vLLM's offline class does the same), where the config sets none.
OFFLINE_DEFAULTS = {"scheduler.max_num_batched_tokens": 2048}


def _with_offline_defaults(path: str | Path | None, overrides: Mapping[str, Any]) -> Config:
    """The config at ``path`` with ``overrides``, plus each of OFFLINE_DEFAULTS that neither sets and that the
    chosen plugin has."""
    config = load_config(path, overrides)
    raw = {}
    if path is not None:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    extra = {}
    for dotted, value in OFFLINE_DEFAULTS.items():
        table, key = dotted.split(".")
        options = getattr(config, table).options
        if dotted not in overrides and key not in raw.get(table, {}) and hasattr(options, key):
            extra[dotted] = value
    return load_config(path, {**overrides, **extra}) if extra else config


class LLM:
    """Generate text in-process, with the same engine the server runs.

    Args:
        config: a TOML file, a Config, or None for the built-in defaults. Where a file (or the built-in
            defaults) sets no step budget, the offline one applies (OFFLINE_DEFAULTS); a Config is taken as is.
        overrides: ``{"section.key": value}``, the same keys as ``--set``.
    """

    def __init__(self, config: str | Path | Config | None = None, overrides: Mapping[str, Any] | None = None):
        if isinstance(config, Config):
            if overrides:
                raise ValueError("overrides apply to a config file; edit the Config object instead")
            self.config = config
        else:
            self.config = _with_offline_defaults(config, overrides or {})
        self.engine = EngineCore(self.config)
        self.tokenizer = load_tokenizer(self.config.model, source=self.config.source_of("model"))
        self.client = InprocClient(self.engine)
        name = self.config.model.served_name
        try:
            self.frontend = EngineFrontend(self.client, self.tokenizer, name, ServerMetrics(name), self.config.lora)
        except ValueError as e:
            self.engine.shutdown()
            raise ConfigError(f"{self.config.source}: {e}") from None
        self._ids = itertools.count()
        self.closed = False

    def close(self) -> None:
        """Stop the engine's workers (worker processes under tensor or pipeline parallelism); once is enough."""
        if not self.closed:
            self.closed = True
            self.engine.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def add_lora(self, name: str, path: str | Path) -> None:
        """Serve the PEFT LoRA adapter directory ``path`` as ``name`` (``generate(..., lora=name)``).

        Raises:
            ValueError: LoRA is off ([lora] max_loras = 0), the name is taken, or ``path`` is not an adapter.
        """
        try:
            self.frontend.add_adapter(name, str(path))
        except RequestError as e:
            raise ValueError(e.message) from None

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt; chat conversations go through the chat template, token ids are checked.

        Raises:
            ValueError: a malformed conversation or a token id outside the vocabulary.
        """
        try:
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
                return self.frontend.encode_chat(prompt)
            return self.frontend.encode(prompt)
        except RequestError as e:
            raise ValueError(e.message) from None

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[Completion]:
        """Complete every prompt, batched together; all or nothing.

        Args:
            prompts: a string, a chat conversation, token ids, or a list of any of them.
            params: one SamplingParams for all prompts, or one per prompt.
            lora: the LoRA adapter (its name) for all prompts, or one per prompt (None: the base model).

        Returns:
            One Completion per prompt, in order.

        Raises:
            ValueError: a prompt the engine refuses (too long, empty, ...); no prompt runs then.
            RuntimeError: the engine failed a request, or this LLM is closed.
        """
        if self.closed:
            raise RuntimeError("this LLM is closed (close() or its with block ended); make a new one")
        if isinstance(prompts, str) or (prompts and not isinstance(prompts[0], (str, list))):
            prompts = [prompts]  # one string, one conversation, or one list of token ids
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        if lora is None or isinstance(lora, str):
            lora = [lora] * len(prompts)
        if len(lora) != len(prompts):
            raise ValueError(f"got {len(lora)} adapters for {len(prompts)} prompts")
        prompt_ids = [self.encode(p) for p in prompts]
        for p in params:
            p.check_vocabulary(self.tokenizer.vocab_size)  # (a logit_bias id past the vocabulary: ValueError)
        try:
            adapters = [self.frontend.adapter(name) for name in lora]
        except RequestError as e:
            raise ValueError(e.message) from None
        run = functools.partial(anyio.run, self._generate, prompt_ids, list(params), adapters)
        try:
            if not _in_event_loop():
                return run()
            with ThreadPoolExecutor(1) as thread:  # (a notebook's, or asyncio.run's, loop runs in this thread)
                return thread.submit(run).result()
        except BaseExceptionGroup as group:
            errors = group.subgroup(RequestError)
            if errors is None:
                raise
            error = errors.exceptions[0]
            while isinstance(error, BaseExceptionGroup):
                error = error.exceptions[0]
            raise (ValueError if error.status < 500 else RuntimeError)(error.message) from None

    def embed(self, prompts: Prompt | Sequence[Prompt], normalize: bool = True,
              pooling: str | None = None) -> list[list[float]]:
        """One embedding per prompt: its final hidden states pooled (``pooling``: "last" or "mean"; None: the
        config's ``[model] pooling``), scaled to length 1 where ``normalize``.

        Raises:
            ValueError: a prompt the engine refuses (too long, empty, ...).
        """
        params = SamplingParams(max_tokens=1, temperature=0, pooling=pooling or self.config.model.pooling)
        vectors = [c.embedding for c in self.generate(prompts, params)]
        return [unit_length(v) if normalize else v for v in vectors]

    async def _generate(self, prompt_ids: list[list[int]], params: list[SamplingParams],
                        adapters: list[LoraAdapter | None]) -> list[Completion]:
        results: list[Completion | None] = [None] * len(prompt_ids)
        start = time.perf_counter()

        async def one(index: int) -> None:
            request_id = f"offline-{next(self._ids)}"
            text: list[str] = []
            tokens: list[int] = []
            logprobs: list[TokenLogprob] = []
            prompt_logprobs: list[TokenLogprob] = []
            embedding = None
            first_token = None
            reason = "abort"
            chunks = self.frontend.generate(prompt_ids[index], params[index], request_id=request_id,
                                            lora=adapters[index])
            async with aclosing(chunks):
                async for chunk in chunks:
                    if chunk.token_ids and first_token is None:
                        first_token = time.perf_counter() - start
                    text.append(chunk.text)
                    tokens += chunk.token_ids
                    logprobs += chunk.logprobs or []
                    prompt_logprobs += chunk.prompt_logprobs or []
                    reason = chunk.finish_reason or reason
                    if chunk.embedding:
                        embedding = embedding_floats(chunk.embedding, normalize=False)
            p = params[index]
            results[index] = Completion(
                "".join(text), tokens, reason, prompt_ids[index],
                logprobs=logprobs if p.logprobs is not None else None,
                prompt_logprobs=prompt_logprobs if p.prompt_logprobs is not None else None,
                time_to_first_token=first_token or 0.0,
                latency=time.perf_counter() - start,
                embedding=embedding,
            )

        async with anyio.create_task_group() as engine:
            await engine.start(self.client.run)
            try:
                async with anyio.create_task_group() as requests:
                    for index in range(len(prompt_ids)):
                        requests.start_soon(one, index)
            finally:
                engine.cancel_scope.cancel()
        return results


def _in_event_loop() -> bool:
    """Whether an asyncio event loop runs in this thread (where ``anyio.run`` refuses to start another)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
