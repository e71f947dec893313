"""OpenAI's embeddings (``POST /v1/embeddings``) and vLLM's ``POST /tokenize`` and ``POST /detokenize``.

An embedding is the prompt's final hidden states (after the last norm) pooled
as ``[model] pooling`` says: the last token's, or the mean of every token's.
Each input runs as its own request (``SamplingParams.pooling``) that computes
its prompt and ends with the vector, without a token; the vectors are
L2-normalized unless the request sends vLLM's ``normalize: false``.
"""

from __future__ import annotations

import base64
import sys
from array import array
from contextlib import aclosing
from typing import Annotated, Any, Literal

import anyio
import msgspec

from conveyor.api.calls import check_named
from conveyor.api.tool_calls import ToolDef, Tools
from conveyor.sampling import SamplingParams
from conveyor.transport import Frontend, RequestError, embedding_floats

# inputs one embeddings request may carry (OpenAI's limit); each is a request of its own in the engine
MAX_INPUTS = 2048
Int = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
TokenIds = list[Int]


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    # a text, texts, token ids, or lists of token ids
    input: str | list[str | Int | TokenIds]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    # the vector's length: only this model's own (the vectors are not truncated)
    dimensions: int | None = None
    user: str | None = None
    # vLLM's: false returns the pooled hidden states as they are
    normalize: bool = True


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    # a text, or a conversation (rendered with the model's chat template); exactly one
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    # a text: prepend the BOS the model asks for
    add_special_tokens: bool = True
    # a conversation: end with the assistant's turn opened
    add_generation_prompt: bool = True
    # a conversation: the tools shown to the model, as chat completions shows them
    tools: list[ToolDef] | None = None
    # also each token's text
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    tokens: TokenIds
    model: str | None = None


def inputs(body: EmbeddingRequest) -> list[str | list[int]]:
    """The request's inputs, one prompt each.

    Raises:
        RequestError: 400 naming ``input``: none, too many.
    """
    given = body.input
    if not given:
        raise RequestError("input must not be empty", 400, "input")
    kinds = {type(item) for item in given} if isinstance(given, list) else {str}
    if len(kinds) > 1:
        raise RequestError("input: a list of texts, of token ids, or of lists of token ids; not a mix", 400,
                           "input")
    prompts: list[Any] = [given] if isinstance(given, str) or kinds == {int} else list(given)
    if len(prompts) > MAX_INPUTS:
        raise RequestError(f"input has {len(prompts)} entries; at most {MAX_INPUTS} are allowed", 400, "input")
    return prompts


def prompts(frontend: Frontend, body: EmbeddingRequest, pooling: str) -> list[list[int]]:
    """The request's inputs as token ids, each checked (this tokenizes them: the transport calls it in a worker
    thread).

    Raises:
        RequestError: an input refused (400 naming ``input``, 404 model, 503).
    """
    if frontend.adapter(body.model) is not None:
        raise RequestError("embeddings are of the base model, not of a LoRA adapter", 400, "model")
    given_inputs = inputs(body)
    params = _params(pooling)
    prompts = []
    for i, given in enumerate(given_inputs):
        field = "input" if len(given_inputs) == 1 else f"input[{i}]"
        ids = frontend.encode(given, field)
        if not ids:
            raise RequestError(f"{field} is empty", 400, field)
        check_named(frontend, ids, params, field)
        prompts.append(ids)
    return prompts


def _params(pooling: str) -> SamplingParams:
    return SamplingParams(max_tokens=1, temperature=0, pooling=pooling)


async def embed(frontend: Frontend, body: EmbeddingRequest, prompts: list[list[int]], pooling: str) -> dict[str, Any]:
    """The embeddings response: every input (``prompts``, from ``prompts()``) pooled with ``pooling`` ("last" or
    "mean"), at once.

    Raises:
        RequestError: an input refused (429, 503).
    """
    params = _params(pooling)
    vectors: list[bytes] = [b""] * len(prompts)
    request_id = frontend.new_request_id("embd")

    refused: list[RequestError] = []

    async def one(index: int) -> None:
        try:
            async with aclosing(frontend.generate(prompts[index], params,
                                                  request_id=f"{request_id}-{index}")) as chunks:
                async for chunk in chunks:
                    if chunk.embedding:
                        vectors[index] = chunk.embedding
        except RequestError as e:
            refused.append(e)
            group.cancel_scope.cancel()  # (the others are aborted)

    async with anyio.create_task_group() as group:
        for index in range(len(prompts)):
            group.start_soon(one, index)
    if refused:
        raise refused[0]
    data = []
    for index, vector in enumerate(vectors):
        if not vector:  # (aborted: the server is draining)
            raise RequestError(f"input[{index}] ended without its embedding", 503)
        values = embedding_floats(vector, body.normalize)
        if body.dimensions is not None and body.dimensions != len(values):
            raise RequestError(f"dimensions={body.dimensions}: this model's embeddings have {len(values)}",
                               400, "dimensions")
        encoded: Any = base64.b64encode(_le_bytes(values)).decode() if body.encoding_format == "base64" else values
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    tokens = sum(map(len, prompts))
    return {"object": "list", "data": data, "model": body.model or frontend.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _le_bytes(values: list[float]) -> bytes:
    """float32 little-endian, as OpenAI's base64 encoding holds them."""
    packed = array("f", values)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def tokenize(frontend: Frontend, body: TokenizeRequest) -> dict[str, Any]:
    """``{"count", "max_model_len", "tokens"}`` (and ``"token_strs"`` where asked), as vLLM answers (this
    tokenizes: the transport calls it in a worker thread, as it does ``detokenize``).

    Raises:
        RequestError: 400: neither or both of prompt and messages; tools with a prompt; a conversation or tools
            the template refuses.
    """
    frontend.adapter(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise RequestError("send exactly one of prompt and messages", 400, "prompt")
    if body.prompt is not None:
        if body.tools is not None:
            raise RequestError("tools go with messages, not with a prompt", 400, "tools")
        ids = frontend.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        # (rendered as chat completions renders them, whatever tool_choice: it does not change the prompt)
        messages, context = Tools(body.tools, None).messages(body.messages, frontend.tokenizer.chat_template)
        ids = frontend.encode_chat(messages, add_generation_prompt=body.add_generation_prompt, **context)
    answer: dict[str, Any] = {"count": len(ids), "max_model_len": frontend.max_model_len, "tokens": ids}
    if body.return_token_strs:
        answer["token_strs"] = [frontend.tokenizer.token_text(t) for t in ids]
    return answer


def detokenize(frontend: Frontend, body: DetokenizeRequest) -> dict[str, Any]:
    """``{"prompt": text}``: the tokens' text (special tokens kept, as vLLM does).

    Raises:
        RequestError: 400 naming ``tokens``: an id outside the vocabulary.
    """
    frontend.adapter(body.model)
    ids = frontend.encode(list(body.tokens), "tokens")
    return {"prompt": frontend.tokenizer.decode(ids, skip_special_tokens=False)}
