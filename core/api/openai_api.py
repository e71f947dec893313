"""The OpenAI API's request bodies and response objects (completions and chat completions).

Requests are msgspec Structs, so a wrong type is reported with the field's
path; fields that OpenAI clients send and Conveyor does not use are
accepted and ignored. vLLM's extra sampling fields (``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``priority``, ...) are accepted too,
and its structured-output fields beside OpenAI's ``response_format``:
``structured_outputs`` ({"json" | "regex" | "choice" | "grammar": ...}) and
the older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``;
and its ``prompt_logprobs`` (``prompt_logprobs`` below).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

import msgspec

from conveyor.api.tool_calls import FunctionDef, ToolDef
from conveyor.messages import TokenLogprob
from conveyor.model.tokenizer import Tokenizer
from conveyor.sampling import SamplingParams, StructuredOutput
from conveyor.transport import RequestError

MAX_N = 16
# prompts one completions request may carry (a batch: each prompt is n requests of its own in the engine)
MAX_PROMPTS = 64
# integers travel to the engine as 64-bit msgpack ints; larger ones are a 400, not a failed send
Int = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


class LoadLoraRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    # a PEFT adapter directory on the server's machine
    lora_path: str


class UnloadLoraRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class JSONSchemaFormat(msgspec.Struct):
    name: str = "response"
    # JSON Schema; None: any JSON object
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True):
    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Common(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # token id -> bias in [-100, 100]; the ids are JSON's strings, which SamplingParams reads and checks
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: Int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: Int = 0
    stop_token_ids: list[Int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: Int = 0
    # each prompt token's logprob and its top N alternatives (0..20; not with stream, as vLLM has it)
    prompt_logprobs: Int | None = None
    # structured output
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_Common, kw_only=True):
    # a string or a list of token ids; or a batch: a list of strings, or of lists of token ids
    prompt: str | list[Any]
    logprobs: Int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int | None = None


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[dict[str, Any]]
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    tools: list[ToolDef] | None = None
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # the deprecated forms of tools and tool_choice ("none" | "auto" | {"name": ...}): legacy_functions
    functions: list[FunctionDef] | None = None
    function_call: str | dict[str, Any] | None = None
    # vLLM's extras: the template's generation prompt; or the last (assistant) message continued instead
    add_generation_prompt: bool = True
    continue_final_message: bool = False


def prompts(request: CompletionRequest) -> list[str | list[int]]:
    """A completions request's prompts: a text or a list of token ids is one, a list of texts or of token-id lists
    a batch (each checked later, as the frontend tokenizes it).

    Raises:
        RequestError: 400 naming ``prompt``: more than MAX_PROMPTS.
    """
    prompt = request.prompt
    batch = isinstance(prompt, list) and any(all(isinstance(p, kind) for p in prompt) for kind in (str, list))
    if not prompt or not batch:
        return [prompt]  # (token ids, or a mix that the frontend refuses)
    if len(prompt) > MAX_PROMPTS:
        raise RequestError(f"prompt has {len(prompt)} prompts; at most {MAX_PROMPTS} are allowed", 400, "prompt")
    return list(prompt)


def sampling_params(request: CompletionRequest | ChatCompletionRequest, default_max_tokens: int | None) -> SamplingParams:
    """The engine's SamplingParams for an API request.

    Raises:
        RequestError: 400 naming the out-of-range field.
    """
    if not 1 <= request.n <= MAX_N:
        raise RequestError(f"n={request.n} must be between 1 and {MAX_N}", 400, "n")
    if request.stream_options is not None and not request.stream:
        raise RequestError("Stream options can only be defined when `stream=True`.", 400, "stream_options")
    if request.stream and (request.prompt_logprobs or 0) > 0:
        raise RequestError("`prompt_logprobs` are not available when `stream=True`.", 400, "prompt_logprobs")
    if isinstance(request, ChatCompletionRequest):
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        if request.top_logprobs is not None and not request.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", 400, "top_logprobs")
    else:
        max_tokens = request.max_tokens
        logprobs = request.logprobs
        if request.echo:
            raise RequestError("echo=true is not supported", 400, "echo")
        if request.suffix:
            raise RequestError("suffix is not supported", 400, "suffix")
        if request.best_of not in (None, request.n):
            raise RequestError("best_of different from n is not supported", 400, "best_of")
    try:
        params = SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=request.top_k or 0,
            min_p=request.min_p,
            seed=request.seed,
            repetition_penalty=request.repetition_penalty,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            logit_bias=request.logit_bias or {},
            stop=request.stop or [],
            stop_token_ids=request.stop_token_ids or [],
            include_stop_str_in_output=request.include_stop_str_in_output,
            ignore_eos=request.ignore_eos,
            min_tokens=request.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=request.prompt_logprobs,
            skip_special_tokens=request.skip_special_tokens,
            structured=structured_output(request),
        )
    except ValueError as e:
        message = str(e)
        head = message.split(" ", 1)[0].split("=", 1)[0]  # "top_p=0 must ...", "stop strings must ..."
        param = head if head in type(request).__struct_fields__ else None
        if param == "logprobs" and isinstance(request, ChatCompletionRequest):
            param = "top_logprobs"
        raise in_request_terms(RequestError(message, 400, param), request) from None
    if request.stream:
        params.prompt_logprobs = None  # (0, which vLLM takes with stream: a stream returns none)
    return params


def in_request_terms(error: RequestError, request: CompletionRequest | ChatCompletionRequest) -> RequestError:
    """A refusal that names max_tokens (the engine's name for the limit), naming max_completion_tokens instead
    where a chat request set the limit with that field."""
    if getattr(request, "max_completion_tokens", None) is None:
        return error
    message = re.sub(r"\bmax_tokens\b", "max_completion_tokens", error.message)
    param = "max_completion_tokens" if error.param == "max_tokens" else error.param
    return RequestError(message, error.status, param, error.retry_after)


# vLLM's structured-output fields -> the language each names
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_output(request: CompletionRequest | ChatCompletionRequest) -> StructuredOutput | None:
    """The language the request constrains its output to, from whichever field it used (at most one).

    Raises:
        RequestError: 400 when two fields ask for it, or one asks for nothing.
    """
    given = {}
    fmt = request.response_format
    if fmt is not None and fmt.type == "json_object":
        given["response_format"] = StructuredOutput(json_object=True)
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise RequestError("response_format: type 'json_schema' needs a json_schema", 400, "response_format")
        schema = fmt.json_schema.schema
        given["response_format"] = (StructuredOutput(json=json.dumps(schema)) if schema is not None
                                    else StructuredOutput(json_object=True))
    for field, kind in GUIDED_FIELDS.items():
        if (value := getattr(request, field)) is not None:
            given[field] = _structured(kind, value, field)
    if request.structured_outputs is not None:
        chosen = {k: v for k, v in msgspec.structs.asdict(request.structured_outputs).items() if v is not None}
        if len(chosen) != 1:
            raise RequestError(f"structured_outputs takes exactly one of json, regex, choice, grammar, json_object; "
                               f"got {', '.join(chosen) or 'none'}", 400, "structured_outputs")
        (kind, value), = chosen.items()
        given["structured_outputs"] = _structured(kind, value, "structured_outputs")
    if len(given) > 1:
        raise RequestError(f"structured output asked for twice: {', '.join(given)}", 400, next(iter(given)))
    return next(iter(given.values()), None)


def structured_field(request: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The field that asked for structured output (``structured_output`` allows one), if one did."""
    fmt = request.response_format
    if fmt is not None and fmt.type in ("json_object", "json_schema"):
        return "response_format"
    fields = (*GUIDED_FIELDS, "structured_outputs")
    return next((field for field in fields if getattr(request, field) is not None), None)


def _structured(kind: str, value: Any, field: str) -> StructuredOutput:
    if kind == "json":
        return StructuredOutput(json=value if isinstance(value, str) else json.dumps(value))
    if kind == "json_object":
        return StructuredOutput(json_object=bool(value))
    try:
        return StructuredOutput(**{kind: value})
    except ValueError as e:
        raise RequestError(f"{field}: {e}", 400, field) from None


def chat_logprobs(tokenizer: Tokenizer, token_ids: list[int], logprobs: list[TokenLogprob]) -> dict[str, Any]:
    """Chat completions' ``logprobs`` object: each token named as ``logprob_token`` names it, with its exact bytes."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        name, data = logprob_token(tokenizer, token_id)
        return {"token": name, "logprob": logprob, "bytes": list(data)}

    content = []
    for token_id, lp in zip(token_ids, logprobs):
        item = entry(token_id, lp.logprob)
        item["top_logprobs"] = [entry(t, v) for t, v in zip(lp.top_ids, lp.top_logprobs)]
        content.append(item)
    return {"content": content}


def completion_logprobs(
    tokenizer: Tokenizer, token_ids: list[int], logprobs: list[TokenLogprob], text_offset: int
) -> dict[str, Any]:
    """Completions' ``logprobs`` object; ``text_offset`` is where these tokens start in the choice's text (its
    length before them, in characters)."""
    tokens, token_logprobs, top, pieces = [], [], [], []
    for token_id, lp in zip(token_ids, logprobs):
        name, data = logprob_token(tokenizer, token_id)
        tokens.append(name)
        pieces.append(data)
        token_logprobs.append(lp.logprob)
        # (keyed by name: tokens that are each part of a character stay apart by their bytes)
        top.append({logprob_token(tokenizer, t)[0]: v for t, v in zip(lp.top_ids, lp.top_logprobs)})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": text_offsets(pieces, text_offset)}


def logprob_token(tokenizer: Tokenizer, token_id: int) -> tuple[str, bytes]:
    """A token's name in logprobs, as OpenAI writes it, and its bytes: its text; or, where its bytes are no UTF-8
    by themselves (part of a character that tokens split), "bytes:" and each byte as ``\\xNN``, so that such
    tokens stay apart (each one's text alone is U+FFFD)."""
    data = tokenizer.token_bytes(token_id)
    try:
        data.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data), data
    return tokenizer.token_text(token_id), data


def text_offsets(pieces: list[bytes], start: int) -> list[int]:
    """Where each token begins in the text, in characters: at the character its first byte is part of, so that
    the tokens of a character that tokens split all begin at it (UTF-8: a character is a lead byte and the
    continuation bytes 0x80-0xBF after it). ``start``: the text's characters before the first token; a first
    token that continues a character (begun in an earlier chunk of a stream) begins at that character, ``start``.
    """
    joined = b"".join(pieces)
    # the character the bytes so far end in (before the first: the one they continue, else none yet)
    character = start if joined[:1] and 0x80 <= joined[0] < 0xC0 else start - 1
    offsets = []
    for piece in pieces:
        offsets.append(character if piece[:1] and 0x80 <= piece[0] < 0xC0 else character + 1)
        character += sum(1 for b in piece if not 0x80 <= b < 0xC0)
    return offsets


def prompt_logprobs(tokenizer: Tokenizer, prompt_ids: list[int],
                    entries: list[TokenLogprob | None]) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: for each prompt token, None (the first, which nothing predicts) or token id ->
    ``{logprob, rank, decoded_token}`` for the prompt's token (its rank: 1 + the tokens of the vocabulary more
    likely), then its top alternatives (ranks 1, 2, ...); a logprob of -inf is -9999.0, as vLLM sends it."""

    def logprob(token_id: int, value: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": max(value, -9999.0), "rank": rank, "decoded_token": tokenizer.token_text(token_id)}

    result: list[dict[str, dict[str, Any]] | None] = []
    for token_id, entry in zip(prompt_ids, entries):
        if entry is None:
            result.append(None)
            continue
        top = {str(t): logprob(t, v, i) for i, (t, v) in enumerate(zip(entry.top_ids, entry.top_logprobs), start=1)}
        result.append({str(token_id): logprob(token_id, entry.logprob, entry.rank or None), **top})
    return result


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def envelope(request_id: str, obj: str, model: str, created: int, choices: list[dict[str, Any]],
             **extra: Any) -> dict[str, Any]:
    """A response object, or a chunk of a stream (``created``: when the request came, the same in every chunk)."""
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices, **extra}


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": status}}
