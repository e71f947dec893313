"""The frontend: prompts to token ids, engine outputs to text, per-request metrics.

Every transport (HTTP, ZMQ, a third-party one) serves clients through one
``EngineFrontend`` (the ``conveyor.transport.Frontend`` protocol), and the
offline ``LLM`` runs on one too: it checks a request against the model's
limits, submits it to the engine client, turns the token stream into text
incrementally (whole UTF-8 characters only, stop strings cut), and records
TTFT, ITL, queue time and end-to-end latency.
"""

from __future__ import annotations

import itertools
import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from conveyor.batches.files import FileStore
from conveyor.config import LoraConfig, PluginSpec
from conveyor.engine.client import EngineClient, EngineUnavailable
from conveyor.messages import EngineRequest, LoraAdapter
from conveyor.model.detokenizer import TextStream
from conveyor.model.tokenizer import ChatTemplateError, Tokenizer
from conveyor.request import RequestRejected, length_error
from conveyor.sampling import SamplingParams
from conveyor.scheduling.slo import met_targets, targets_of
from conveyor.serving.metrics import ServerMetrics
from conveyor.transport import Chunk, RequestError

if TYPE_CHECKING:
    from conveyor.scheduler import Scheduler

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

logger = logging.getLogger("conveyor")


class EngineFrontend:
    """Tokenizes, submits, detokenizes; shared by all transports of a server."""

    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, model_name: str, metrics: ServerMetrics,
                 lora: LoraConfig | None = None, reasoning_parser: str = "", pooling: str = "last",
                 scheduler: PluginSpec | None = None, scheduler_class: type[Scheduler] | None = None,
                 aliases: Sequence[str] = ()):
        """
        Args:
            lora: the ``[lora]`` table: its adapters are served from the start.
            reasoning_parser: ``[model] reasoning_parser``: how replies' thinking is told from their answer.
            pooling: ``[model] pooling``: how embeddings pool the hidden states.
            scheduler: the ``[scheduler]`` table, and its plugin's class: requests are judged against its latency
                targets (goodput), which ``reconfigure_scheduler`` changes at run time.
            aliases: ``[model] aliases``: other names requests may give the model.

        Raises:
            ValueError: an adapter of ``lora`` cannot be served (the message names it and says why).
        """
        self.engine = engine
        self.scheduler = scheduler
        self.scheduler_class = scheduler_class
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.aliases = tuple(aliases)
        self.metrics = metrics
        self.reasoning_parser = reasoning_parser
        self.pooling = pooling
        # set when the server stops taking requests (shutdown)
        self.draining = False
        # the Batch API's files ([batch] dir; conveyor.serving.server opens them)
        self.files: FileStore | None = None
        self._ids = itertools.count()
        self._eos_token_ids = sorted(tokenizer.eos_token_ids)
        self.lora = lora or LoraConfig()
        # LoRA adapters clients may name, by name
        self.adapters: dict[str, LoraAdapter] = {}
        self._adapter_ids = itertools.count(1)
        for name, path in self.lora.adapters.items():
            try:
                self.add_adapter(name, path)
            except RequestError as e:
                raise ValueError(f"[lora] adapters.{name}: {e}") from None
        self.metrics.set_targets(*self.targets(0))

    def targets(self, priority: int) -> tuple[float, float]:
        """The scheduler's (TTFT, ITL) targets in seconds for a request of ``priority`` (0: none)."""
        return targets_of(self.scheduler.options if self.scheduler else None, priority)

    def reconfigure_scheduler(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Change scheduler options while serving (those its plugin's ``runtime_options`` name: the latency
        targets for the built-in one); a restarted engine keeps them. Returns the scheduler's options now.

        Raises:
            RequestError: 400 naming a key that may not change, or a value its option does not allow.
        """
        if self.scheduler is None or self.scheduler_class is None:
            raise RequestError("this server's scheduler cannot change at run time", 400)
        try:
            options = self.scheduler_class.changed_options(self.scheduler.options, changes)
        except ValueError as e:
            raise RequestError(str(e), 400) from None
        self.engine.reconfigure_scheduler(changes)
        self.scheduler = msgspec.structs.replace(self.scheduler, options=options)
        self.metrics.set_targets(*self.targets(0))
        logger.info("scheduler options changed: %s", changes)
        return {"plugin": self.scheduler.plugin, **msgspec.to_builtins(options)}

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def engine_alive(self) -> bool:
        return self.engine.alive

    @property
    def healthy(self) -> bool:
        return self.engine.alive and not self.draining

    @property
    def num_in_flight(self) -> int:
        return self.engine.num_in_flight

    def adapter(self, model: str | None) -> LoraAdapter | None:
        """The LoRA adapter a request's ``model`` names: ``NAME`` or ``BASE:NAME`` (None: the base model).

        Raises:
            RequestError: 404, no such model.
        """
        if model is None or model == self.model_name or model in self.aliases:
            return None
        base, sep, name = model.partition(":")
        adapter = self.adapters.get(name if sep and (base == self.model_name or base in self.aliases) else model)
        if adapter is None:
            names = ", ".join(repr(n) for n in [self.model_name, *self.aliases, *self.adapters])
            raise RequestError(f"the model {model!r} does not exist; this server has {names}", 404, "model")
        return adapter

    def add_adapter(self, name: str, path: str) -> LoraAdapter:
        """Serve the LoRA adapter at ``path`` as ``name`` (the workers load it when a request first needs it).

        Raises:
            RequestError: 400, LoRA is off, the name is taken or not allowed, or the directory is not an adapter.
        """
        from conveyor.model.lora_config import read_adapter_config

        if not self.lora.max_loras:
            raise RequestError("LoRA is off on this server ([lora] max_loras = 0)", 400, "lora_name")
        if not name or ":" in name or name == self.model_name:
            raise RequestError(f"lora_name {name!r} is not allowed (non-empty, no ':', not the base model's name)",
                               400, "lora_name")
        if name in self.adapters:
            raise RequestError(f"an adapter named {name!r} is already loaded (unload it first)", 400, "lora_name")
        try:
            read_adapter_config(path, self.lora.max_lora_rank)
        except ValueError as e:
            raise RequestError(str(e), 400, "lora_path") from None
        adapter = self.adapters[name] = LoraAdapter(name, str(path), next(self._adapter_ids))
        return adapter

    def remove_adapter(self, name: str) -> None:
        """Stop serving an adapter (requests already running under it finish).

        Raises:
            RequestError: 404, no adapter of that name.
        """
        if self.adapters.pop(name, None) is None:
            raise RequestError(f"no adapter named {name!r} is loaded", 404, "lora_name")

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}-{time.monotonic_ns() % 10**9:09d}"

    def encode(self, prompt: str | list[int], field: str = "prompt", *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text (``add_special_tokens``: with the BOS the model asks for), or token ids given as they
        are. A long text takes seconds: transports call it in a worker thread, which it leaves the GIL to.

        Raises:
            RequestError: 400, naming ``field``.
        """
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens)
        if isinstance(prompt, list) and all(_is_integer(t) for t in prompt):
            prompt = [int(t) for t in prompt]  # (1.0 is an integer in JSON)
            vocab = self.tokenizer.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise RequestError(f"{field}: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", 400, field)
            return list(prompt)
        raise RequestError(f"{field} must be a string or a list of token ids", 400, field)

    def encode_chat(self, messages: list[dict[str, Any]], field: str = "messages", **context: Any) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template (``context``: more template
        variables, e.g. ``tools``); like ``encode``, it leaves the GIL to other threads while it tokenizes."""
        try:
            return self.tokenizer.encode_chat(messages, **context)
        except ChatTemplateError as e:
            raise RequestError(f"{field}: {e}", 400, field) from None

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Refuse what the model cannot do (400) and new work while starting or draining (503)."""
        self._refuse_new_work()
        problem = length_error(len(prompt_ids), params.max_tokens, self.max_model_len, bool(params.pooling))
        if problem is not None:
            raise RequestError(problem[0], 400, problem[1])
        try:
            params.check_vocabulary(self.tokenizer.vocab_size)
        except ValueError as e:
            raise RequestError(str(e), 400, "logit_bias") from None

    def _refuse_new_work(self) -> None:
        if self.draining:
            raise RequestError("the server is shutting down", 503)
        if not self.max_model_len:
            raise RequestError("the engine is starting", 503)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, request_id: str, priority: int = 0,
        lora: LoraAdapter | None = None,
    ) -> AsyncIterator[Chunk]:
        """Run one sequence (under ``lora``, an adapter from ``adapter()``); yield its chunks until the one with
        a finish_reason.

        Iterate inside ``contextlib.aclosing``: leaving early aborts the request.

        Raises:
            RequestError: refused (400/429/503), or the engine failed it (5xx).
        """
        self._refuse_new_work()  # (the request itself was checked by its transport; the engine refuses it too)
        start = time.perf_counter()
        request = EngineRequest(request_id, prompt_ids, params, priority, time.time(), self._eos_token_ids, lora)
        text = TextStream(self.tokenizer, params)
        num_output = 0
        last_token: float | None = None
        ttft = 0.0
        gaps: list[float] = []
        reason: str | None = None
        began = False
        self.metrics.dashboard.pending(request_id, len(prompt_ids))
        try:
            async with aclosing(self.engine.generate(request)) as outputs:
                began = True
                async for output in outputs:
                    if output.error is not None:
                        status = output.error_status or 500
                        reason = "rejected" if status < 500 else "error"  # (the engine refused it: not a run)
                        raise RequestError(output.error, status, output.error_param, output.retry_after)
                    now = time.perf_counter()
                    if output.new_token_ids:
                        if last_token is None:
                            ttft = now - start
                            self.metrics.first_token(ttft, output.queue_time, len(prompt_ids),
                                                     len(output.new_token_ids))
                            self.metrics.dashboard.answered(request_id)
                        else:
                            gaps.append(now - last_token)
                            self.metrics.next_token(gaps[-1], len(output.new_token_ids))
                        last_token = now
                        num_output += len(output.new_token_ids)
                    reason = output.finish_reason
                    delta = text.add(output.new_token_ids, final=reason is not None)
                    if text.stopped:  # (a stop string in the last token allowed ends it as a stop too)
                        reason = "stop"
                        if output.finish_reason is None:  # (the engine ends it as stop, not abort)
                            self.engine.end_at_stop_string(request_id)
                    yield Chunk(
                        delta,
                        output.new_token_ids,
                        output.new_logprobs,
                        reason,
                        len(prompt_ids),
                        num_output,
                        output.num_cached_tokens,
                        output.prompt_logprobs,
                        output.prompt_logprobs_start,
                        text.matched if reason is not None else None,
                        output.embedding,
                        output.grammar_closed,
                    )
                    if reason is not None:
                        return
        except EngineUnavailable as e:
            reason = "rejected"  # (raised before the engine took it: not a run)
            raise RequestError(str(e), 503) from None
        except RequestRejected as e:
            reason = "rejected"
            raise RequestError(str(e), e.status, retry_after=e.retry_after) from None
        finally:
            self.metrics.dashboard.answered(request_id)
            if began and reason != "rejected":
                outcome = reason or "abort"
                self.metrics.request_done(outcome, time.perf_counter() - start, num_output)
                if outcome in ("stop", "length") and num_output:
                    self.metrics.request_slo(*met_targets(ttft, gaps, self.targets(priority)))

    async def run_choices(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        n: int,
        *,
        request_id: str,
        priority: int = 0,
        on_chunk: Callable[[int, Chunk], Awaitable[None]],
        lora: LoraAdapter | None = None,
    ) -> None:
        """Run ``n`` sequences of one prompt at once, calling ``on_chunk(index, chunk)`` as they come.

        With a seed, sequence i uses seed + i, so the choices differ and are reproducible.
        """

        async def one(index: int) -> None:
            p = params
            if index and params.seed is not None:
                p = msgspec.structs.replace(params, seed=params.seed + index)
            rid = request_id if n == 1 else f"{request_id}-{index}"
            async with aclosing(self.generate(prompt_ids, p, request_id=rid, priority=priority, lora=lora)) as chunks:
                async for chunk in chunks:
                    await on_chunk(index, chunk)

        if n == 1:
            await one(0)
            return
        try:
            async with anyio.create_task_group() as tg:
                for index in range(n):
                    tg.start_soon(one, index)
        except BaseExceptionGroup as group:
            errors = group.subgroup(RequestError)
            if errors is not None and errors.exceptions and len(errors.exceptions) == len(group.exceptions):
                raise _first_error(errors) from None
            raise


def _first_error(group: BaseExceptionGroup) -> RequestError:
    error = group.exceptions[0]
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    assert isinstance(error, RequestError)
    return error


def _is_integer(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())
