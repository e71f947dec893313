"""The engine-side state of one request."""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Collection

from conveyor.messages import EngineRequest, KVTransfer, LoraAdapter
from conveyor.sampling import SamplingParams

_arrival_counter = itertools.count()


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3
    # held by an admission gate (``conveyor.scheduler.AdmissionGate``) before it may be scheduled
    WAITING_FOR_ADAPTER = 4  # its LoRA adapter is not on the workers yet
    WAITING_FOR_GRAMMAR = 5  # its structured-output grammar compiles
    WAITING_FOR_KV = 6  # its KV blocks come from a slow tier (conveyor.connector)


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


def length_error(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                 pooling: bool = False) -> tuple[str, str] | None:
    """Why a request of this length can never run under ``max_model_len``, and the field at fault ("prompt" or
    "max_tokens"); None where it can. (The frontend refuses with it before queueing; the scheduler, given no
    max_tokens, holds every request it takes to the prompt's part of it.) A ``pooling`` request (an embedding)
    generates nothing: its prompt may fill the context, and max_tokens does not count."""
    if num_prompt_tokens == 0:
        return "the prompt is empty", "prompt"
    if pooling:
        if num_prompt_tokens > max_model_len:
            return f"the prompt has {num_prompt_tokens} tokens; max_model_len={max_model_len}", "prompt"
        return None
    if num_prompt_tokens >= max_model_len:
        message = f"the prompt has {num_prompt_tokens} tokens; max_model_len={max_model_len} leaves no room for output"
        return message, "prompt"
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        total = num_prompt_tokens + max_tokens
        message = (f"the prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
                   f"max_model_len={max_model_len}")
        return message, "max_tokens"
    return None


class RequestRejected(ValueError):
    """The engine cannot take this request; ``status`` is the HTTP status it maps to."""

    def __init__(self, message: str, status: int = 400, retry_after: float = 0.0):
        super().__init__(message)
        self.status = status
        # seconds after which the same request may be taken (a 429's Retry-After); 0: not said
        self.retry_after = retry_after


class Request:
    """A request's tokens and progress, owned by the scheduler."""

    __slots__ = (
        "added_at",
        "arrival_order",
        "arrival_time",
        "cache_salt",
        "closing",
        "draft_token_ids",
        "eos_token_ids",
        "finish_reason",
        "first_scheduled_time",
        "in_flight",
        "kv_transfer",
        "lora",
        "max_total_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_in_flight_tokens",
        "num_prompt_logprobs",
        "output_token_ids",
        "params",
        "priority",
        "prompt_token_ids",
        "queued_at",
        "request_id",
        "status",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_model_len: int,
        eos_token_ids: Collection[int] = (),
        priority: int = 0,
        arrival_time: float | None = None,
        lora: LoraAdapter | None = None,
        kv_transfer: KVTransfer | None = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.params = params
        self.priority = priority
        self.arrival_time = arrival_time or time.time()
        self.arrival_order = next(_arrival_counter)
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        # tokens whose K and V are in the cache
        self.num_computed_tokens = 0
        # prompt tokens found in the prefix cache at admission
        self.num_cached_tokens = 0
        limit = max_model_len if params.max_tokens is None else len(prompt_token_ids) + params.max_tokens
        # prompt + output never exceeds this
        self.max_total_tokens = min(limit, max_model_len)
        self.eos_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        # time.time() of the first step that ran this request
        self.first_scheduled_time: float | None = None
        # structured output: its answer is being brought to a close as max_tokens nears (the grammar gate forces
        # the closing tokens); the budget ends it, so it ends by length, saying that its text was closed
        self.closing = False
        # the scheduler's clock when the request last entered the waiting queue
        self.queued_at = 0.0
        # the scheduler's clock when the scheduler took it (a TTFT target counts from then)
        self.added_at = 0.0
        # with params.prompt_logprobs: prompt positions whose logprobs went out (recomputing never repeats them)
        self.num_prompt_logprobs = 0
        # steps holding it that the workers have not finished (pipeline stages keep several batches in flight,
        # each request in one; async scheduling schedules a request again while its last step runs)
        self.in_flight = 0
        # tokens it computes in those steps (its next step starts after them)
        self.num_in_flight_tokens = 0
        # speculative decoding: tokens proposed to follow the last one, checked in the next step
        self.draft_token_ids: list[int] = []
        # the LoRA adapter it runs under (None: the base model)
        self.lora = lora
        # what else its tokens' KV depends on (the adapter): prefix caching shares blocks only where it matches
        self.cache_salt = b"" if lora is None else f"lora {lora.id}".encode()
        # its prompt's KV comes from a prefill engine (the KV connector waits for it)
        self.kv_transfer = kv_transfer

    @classmethod
    def from_message(cls, msg: EngineRequest, max_model_len: int) -> Request:
        return cls(
            msg.request_id,
            msg.prompt_token_ids,
            msg.params,
            max_model_len,
            msg.eos_token_ids,
            msg.priority,
            msg.arrival_time or None,
            msg.lora,
            msg.kv_transfer,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Known tokens whose K and V are not in the cache yet (at least 1 while the request runs)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def queue_time(self) -> float:
        """Seconds from arrival to the first step that ran this request (0 until then)."""
        if self.first_scheduled_time is None:
            return 0.0
        return max(0.0, self.first_scheduled_time - self.arrival_time)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens ``start:end`` of prompt + output."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def min_tokens_ban(self, num_ahead: int) -> tuple[list[int], int]:
        """Under ``params.min_tokens``: the tokens the sampler may not draw yet (end-of-sequence and stop ids)
        and how many tokens must come first, for a step that samples after ``num_ahead`` tokens the engine has
        not recorded yet (async scheduling: the one its step in flight samples). ``([], 0)`` once they may, and
        under structured output (its grammar says where the output ends: banning that end could leave it no
        token to draw)."""
        left = self.params.min_tokens - self.num_output_tokens - num_ahead
        if left <= 0 or self.params.structured is not None:
            return [], 0
        banned = sorted(self.eos_token_ids.union(self.params.stop_token_ids))
        return banned, left if banned else 0

    def append_token(self, token_id: int) -> FinishReason | None:
        """Add a sampled token; return why the request ends now, if it does. End-of-sequence and stop tokens end
        it only from ``params.min_tokens`` on (the sampler does not draw them before; a token a grammar forces
        may still be one)."""
        self.output_token_ids.append(token_id)
        ends = token_id in self.params.stop_token_ids or token_id in self.eos_token_ids
        if ends and len(self.output_token_ids) >= self.params.min_tokens:
            return FinishReason.STOP
        if self.num_tokens >= self.max_total_tokens:
            return FinishReason.LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
