"""Messages that cross process boundaries (msgspec, no pickle).

Every message is an array-like msgspec Struct; a decoder is built per type.
Between the frontend and the engine process each message is two ZMQ frames:
one byte naming its type (``MessageType``), then the msgpack body. The
engine core and its workers exchange ``StepInput`` and ``RunnerOutput``
(directly in one process; over a transport when the workers run elsewhere).
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from conveyor.sampling import SamplingParams


class LoraAdapter(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A LoRA adapter a request runs under (the frontend names each one it serves)."""

    name: str
    # a PEFT adapter directory
    path: str
    # unique among the adapters one server has served (a name loaded again gets a new id)
    id: int


class KVTransfer(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A request whose prompt another engine prefills (prefill/decode disaggregation): that engine's KV
    connector stores the prompt's blocks, this engine's connector waits for them, loads them and computes the
    rest. A connector that moves no blocks between engines ignores it (the prompt is computed)."""

    # the prompt's leading full blocks the other engine stores
    num_blocks: int
    # seconds to wait for them; what has not come by then is computed
    timeout: float


class EngineRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # lower runs first under the priority policy
    priority: int = 0
    # time.time() when the request reached the server
    arrival_time: float = 0.0
    # tokens that end the generation (the tokenizer's end-of-sequence ids) unless params.ignore_eos
    eos_token_ids: list[int] = []
    # the LoRA adapter the request runs under; None: the base model
    lora: LoraAdapter | None = None
    # its prompt's KV comes from a prefill engine; None: this engine computes the prompt
    kv_transfer: KVTransfer | None = None


class TokenLogprob(msgspec.Struct, array_like=True, gc=False):
    # log-probability of the token under the model (before sampling filters)
    logprob: float
    # most likely alternatives, best first
    top_ids: list[int]
    top_logprobs: list[float]
    # the token's place among the whole vocabulary by logprob: 1 + the tokens more likely (0: not counted)
    rank: int = 0


class RequestOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int] = []
    # one entry per new token when the request asked for logprobs
    new_logprobs: list[TokenLogprob] | None = None
    # "stop" | "length" | "abort" | "error" once the request is done
    finish_reason: str | None = None
    # error text when finish_reason is "error" or the request was rejected
    error: str | None = None
    # for a rejected request, the HTTP status that describes why (400 too long, 429 queue full, ...)
    error_status: int = 0
    num_prompt_tokens: int = 0
    # prompt tokens whose KV came from the prefix cache
    num_cached_tokens: int = 0
    # on the first token: seconds from arrival to the first step that ran the request
    queue_time: float = 0.0
    # with params.prompt_logprobs: entries for the prompt positions this step computed, in order
    # (the first one is for prompt position prompt_logprobs_start)
    prompt_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs_start: int = 0
    # for a rejected request, the field at fault where one is ("structured": its language does not compile)
    error_param: str | None = None
    # with params.pooling: the embedding, float32 little-endian [hidden_size] (the request's last output)
    embedding: bytes = b""
    # structured output, on the last output: the answer was brought to a close (the grammar's completion forced
    # as max_tokens ran out), so that it parses
    grammar_closed: bool = False
    # for a rejected request, seconds after which it may be sent again (HTTP Retry-After); 0: not said
    retry_after: float = 0.0


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The scheduler's queues now, and what it has done since it started."""

    # in a step's stats, the batch that step ran (its requests that ended included) while any request is left
    num_running: int = 0
    num_waiting: int = 0
    # the rest are cumulative
    num_preemptions: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_rejected: int = 0
    # run-to-completion batching: slot-steps a batch held for requests already finished (or never there)
    num_wasted_slots: int = 0
    # speculative decoding: tokens proposed, and of those the ones the model accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class KVCacheStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The KV cache manager's blocks now; counters are cumulative. A layout leaves at 0 what it does not have."""

    # fraction of the blocks in use, 0..1
    usage: float = 0.0
    num_blocks: int = 0
    num_free_blocks: int = 0
    # tokens per block
    block_size: int = 0
    # token slots held by requests, and the tokens they actually store
    reserved_tokens: int = 0
    used_tokens: int = 0
    # prefix caching: full blocks findable by later requests, tokens looked up and found, blocks reused for others
    num_cached_blocks: int = 0
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_evictions: int = 0
    # contiguous slabs: the longest run of free token slots
    largest_hole_tokens: int = 0


class ConnectorStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A KV connector's tiers (conveyor.connector): each by its name ("host", "disk"); counters are cumulative."""

    # blocks each tier holds now, and the most it holds
    blocks: dict[str, int] = {}
    capacity_blocks: dict[str, int] = {}
    # prompt tokens loaded from each tier instead of computed
    hit_tokens: dict[str, int] = {}
    # bytes read from and written to each tier
    read_bytes: dict[str, int] = {}
    written_bytes: dict[str, int] = {}
    # stored blocks found unreadable (truncated, corrupt, another model's) and skipped
    num_errors: int = 0
    # requests whose prompt blocks came from a prefill engine, by outcome: "arrived" (all of them in time),
    # "timed_out" (the rest computed); the bytes they waited for, and the seconds they waited
    transfers: dict[str, int] = {}
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0


class KVOwners(msgspec.Struct, array_like=True, gc=False):
    """Which running request holds which KV blocks (a block in two lists is a shared prefix block)."""

    request_ids: list[str]
    # per request, its blocks in order
    block_ids: list[list[int]]


class StepStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one engine step did and how long its parts took (or a snapshot between steps: no tokens)."""

    step: int
    # time.time() at the end of the step
    timestamp: float
    scheduler: SchedulerStats
    kv: KVCacheStats
    # tokens computed: of prompts (or of outputs recomputed after a preemption), and of decodes (each decode's
    # new token and any draft tokens it checks)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    # requests in the step with prompt tokens (a whole prompt or a chunk), and decoding
    num_prefill_seqs: int = 0
    num_decode_seqs: int = 0
    # seconds: choosing the batch; building inputs + the forward pass; sampling; recording the results
    schedule_time: float = 0.0
    forward_time: float = 0.0
    sample_time: float = 0.0
    update_time: float = 0.0
    # several workers (tensor/pipeline parallelism): each one's seconds on the step, by rank; the mean of
    # their seconds in collectives and transfers; the share of their time spent waiting for the previous
    # pipeline stage (the pipeline's bubbles)
    rank_times: list[float] = []
    comm_time: float = 0.0
    bubble_fraction: float = 0.0
    # by rank: seconds in collectives and transfers, and waiting for the previous stage; and the mean over
    # ranks of their collectives (all-reduces, gathers) and the bytes each rank sent in them
    rank_comm: list[float] = []
    rank_wait: list[float] = []
    num_collectives: float = 0.0
    collective_bytes: float = 0.0
    # what the step computed and moved (conveyor.perf.roofline), and the share of the device's peaks its
    # forward pass reached (0 where a peak is unknown)
    flops: float = 0.0
    bytes_moved: float = 0.0
    mfu: float = 0.0
    mbu: float = 0.0
    # the KV cache's owners, on a step at most every KV_OWNERS_EVERY_S seconds and when none runs any more
    kv_owners: KVOwners | None = None
    # the KV connector's tiers (none without a connector)
    connector: ConnectorStats | None = None


class EngineOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What the engine publishes after a step (or after taking requests it rejected)."""

    outputs: list[RequestOutput]
    stats: StepStats | None = None


class EngineReady(msgspec.Struct, array_like=True, gc=False):
    """The engine process's first message: the model is loaded and the KV cache sized."""

    pid: int
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    # requests of max_model_len tokens that fit in the KV cache at once
    max_concurrency: float
    # seconds from process start to ready
    load_time: float
    # where the model runs ("cpu", "cuda:0") and the attention backend chosen for it
    device: str = ""
    attention: str = ""
    # bytes of the weights as stored (quantized layers at their packed size)
    weight_bytes: int = 0
    # the devices' peaks together (conveyor.perf.peaks; 0: unknown): dense FLOP/s in the model dtype, bytes/s
    peak_flops: float = 0.0
    peak_bytes_per_second: float = 0.0
    # the quant method, and the bytes of the linear layers, embedding and head by the format each is kept in
    # ("copies": second copies for decode steps)
    quant: str = ""
    weight_formats: dict[str, int] = msgspec.field(default_factory=dict)
    # workers per pipeline stage, and stages
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # where max_model_len came from: the config's key, the model's context length, or that length capped at what
    # the KV cache holds for one request (with the key that raises it)
    max_model_len_note: str = ""
    # what the quant method does to a checkpoint quantized already ("": nothing to say)
    quant_note: str = ""


class ScheduledRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request's share of a step, as the workers see it."""

    request_id: str
    # position of the first token computed this step (the tokens before it are in the KV cache)
    start: int
    # the tokens computed this step, at positions start, start + 1, ...
    token_ids: list[int]
    # the request's KV blocks, in order, from block_offset on (the workers keep those before: conveyor.engine.deltas);
    # the whole table covers every position up to start + len(token_ids)
    block_ids: list[int] = []
    # sent the first time the workers see the request (they keep them); None after
    params: SamplingParams | None = None
    # whether a token is sampled after this step (the chunk reaches the last known token)
    sample: bool = False
    # when a token is sampled under a repetition/presence/frequency penalty: the prompt (the first time) and the
    # outputs since the last such step (the workers keep both and fill them in whole)
    prompt_token_ids: list[int] = []
    output_token_ids: list[int] = []
    # with params.prompt_logprobs: the prompt tokens that rows 0, 1, ... of this step predict
    prompt_logprob_token_ids: list[int] = []
    # speculative decoding: proposed tokens, the last ones of token_ids; the step checks them and samples after
    # the last one it accepts
    draft_token_ids: list[int] = []
    # the workers' LoRA slot of the request's adapter; -1: the base model
    lora_slot: int = -1
    # the index in the request's table of block_ids[0]
    block_offset: int = 0
    # async scheduling: its one input token (token_ids is [-1]) is the one the worker sampled for it in the step
    # before, which the engine has not seen yet
    follows: bool = False
    # params.min_tokens, sent each step while the output is short of it: the tokens that may not come yet (the
    # end-of-sequence and stop ids), and how many tokens must come before they may (with drafts, a step samples
    # several: only its first ones are held back)
    banned_token_ids: list[int] = []
    min_tokens_left: int = 0


class StepInput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What the workers compute in one step."""

    # single-token decodes first, then prefill chunks
    requests: list[ScheduledRequest]
    num_decodes: int
    # requests that ended since the last step: workers drop what they keep for them
    finished_request_ids: list[str] = []
    # entries under a grammar (structured output), and their rows of the token bitmask: int32
    # [len(grammar_rows), ceil(vocab / 32)], little-endian; bit t set where token t may come next
    grammar_rows: list[int] = []
    bitmask: bytes = b""
    # what the KV connector's worker side does before the forward pass (its own format; conveyor.connector)
    kv_connector: bytes = b""


class RunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What the workers give back for one step, per entry of ``StepInput.requests``."""

    # the new token, or None for a prefill chunk that stops short of the last known token
    sampled: list[int | None]
    # logprobs of the new token when its params ask for them
    logprobs: list[TokenLogprob | None]
    # entries for the rows of ScheduledRequest.prompt_logprob_token_ids, when there are any
    prompt_logprobs: list[list[TokenLogprob] | None] = []
    # speculative decoding, per entry when any has drafts: the drafts accepted (they come before the sampled
    # token), with their logprobs where asked
    accepted: list[list[int]] = []
    accepted_logprobs: list[list[TokenLogprob] | None] = []
    # speculative decoding with a draft model: per entry, the tokens it proposes to follow this step's
    draft_token_ids: list[list[int]] = []
    # per entry when any request's pooling finished this step: its embedding (float32 little-endian
    # [hidden_size], the final hidden states pooled), else None
    embeddings: list[bytes | None] = []
    # seconds: building inputs + the forward pass, and sampling
    forward_time: float = 0.0
    sample_time: float = 0.0
    # seconds of forward_time in collectives and transfers between workers, and waiting for the previous
    # pipeline stage's activations (this worker's; the executor adds every worker's in ``ranks``)
    comm_time: float = 0.0
    wait_time: float = 0.0
    # this worker's collectives in the step (all-reduces and gathers within its tensor-parallel group) and the
    # bytes each sent in
    num_collectives: int = 0
    collective_bytes: int = 0
    ranks: list[RankTimes] = []
    # blocks the KV connector's worker side could not fill before the forward pass (``KVConnectorWorker.apply``;
    # every worker's, merged): the engine recomputes the requests that read them
    kv_load_failed: list[int] = []


class RankTimes(msgspec.Struct, array_like=True, gc=False):
    """One worker's seconds in one step (tensor or pipeline parallelism)."""

    # forward + sample
    busy: float
    # in collectives and transfers
    comm: float
    # waiting for the previous stage
    wait: float
    # collectives, and the bytes it sent in them
    num_collectives: int = 0
    collective_bytes: int = 0


class MessageType(bytes, enum.Enum):
    """The first frame of every frontend <-> engine message."""

    # frontend -> engine
    ADD = b"a"  # EngineRequest
    ABORT = b"x"  # list[str]: request ids
    FINISH = b"s"  # list[str]: request ids the frontend found a stop string in: the scheduler ends them as stop
    SHUTDOWN = b"q"  # empty body: finish the current step and exit
    CONFIGURE = b"c"  # dict: scheduler options to change at run time (Scheduler.reconfigure)
    # engine -> frontend
    READY = b"r"  # EngineReady
    OUTPUTS = b"o"  # EngineOutputs
    FAILED = b"f"  # str: why the engine could not start (it exits next)


MESSAGE_BODIES: dict[MessageType, type] = {
    MessageType.ADD: EngineRequest,
    MessageType.ABORT: list[str],
    MessageType.FINISH: list[str],
    MessageType.SHUTDOWN: type(None),
    MessageType.CONFIGURE: dict[str, Any],
    MessageType.READY: EngineReady,
    MessageType.OUTPUTS: EngineOutputs,
    MessageType.FAILED: str,
}
_encoder = msgspec.msgpack.Encoder()
_decoders = {kind: msgspec.msgpack.Decoder(body) for kind, body in MESSAGE_BODIES.items()}


def encode(kind: MessageType, body: object = None) -> list[bytes]:
    """The two frames of one message."""
    return [kind.value, _encoder.encode(body)]


def decode(frames: list[bytes]) -> tuple[MessageType, object]:
    """The type and typed body of a message; raises ValueError for an unknown type or a bad body."""
    if len(frames) != 2:
        raise ValueError(f"expected 2 frames, got {len(frames)}")
    kind = MessageType(bytes(frames[0]))
    try:
        return kind, _decoders[kind].decode(frames[1])
    except msgspec.DecodeError as e:  # ValidationError is a DecodeError
        raise ValueError(f"bad {kind.name} message: {e}") from None
