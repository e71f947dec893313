"""A completions or chat completions request made into a ``Call`` (checked, tokenized, constrained): what a
transport runs for it, and what a Responses or Messages request runs as, whatever carried the request."""

from __future__ import annotations

from conveyor.api import openai_api as api
from conveyor.api.chat import chat_prompt, constrain
from conveyor.api.openai_call import Call
from conveyor.api.tokenizing import Tokenizing
from conveyor.api.tool_calls import Tools
from conveyor.sampling import SamplingParams
from conveyor.transport import Frontend, RequestError


async def completion_call(frontend: Frontend, tokenizing: Tokenizing, body: api.CompletionRequest,
                          created: int) -> Call:
    """A completions call, checked; ``created``: when the request came (Unix seconds).

    Raises:
        RequestError: 400/404/503, the request refused.
    """
    params = api.sampling_params(body, 16)  # (OpenAI's default max_tokens for completions)
    prompts = await tokenizing.run(completion_prompts, frontend, api.prompts(body), params)
    return Call(frontend, body, prompts, params, False, created, None, frontend.adapter(body.model))


def completion_prompts(frontend: Frontend, prompts: list[str | list[int]], params: SamplingParams) -> list[list[int]]:
    """A completions request's prompts tokenized and checked (in a worker thread); in a batch, a refusal names
    ``prompt[i]``."""
    if len(prompts) == 1:
        prompt_ids = frontend.encode(prompts[0], "prompt")
        frontend.check(prompt_ids, params)
        return [prompt_ids]
    batch = []
    for i, prompt in enumerate(prompts):
        prompt_ids = frontend.encode(prompt, f"prompt[{i}]")
        check_named(frontend, prompt_ids, params, f"prompt[{i}]")
        batch.append(prompt_ids)
    return batch


def check_named(frontend: Frontend, prompt_ids: list[int], params: SamplingParams, field: str) -> None:
    """``frontend.check``, its refusal naming ``field`` (one input of several: ``prompt[i]``, ``input[i]``)."""
    try:
        frontend.check(prompt_ids, params)
    except RequestError as e:
        raise RequestError(f"{field}: {e.message}", e.status, field if e.status == 400 else None) from None


async def chat_turn(frontend: Frontend, tokenizing: Tokenizing,
                    body: api.ChatCompletionRequest) -> tuple[list[int], Tools]:
    """A chat request's prompt tokens, with its tools shown to the model, and the tools."""
    tools = Tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    prompt_ids = await tokenizing.run(chat_prompt, frontend, body.messages, tools,
                                      add_generation_prompt=body.add_generation_prompt,
                                      continue_final_message=body.continue_final_message)
    return prompt_ids, tools


async def chat_call(frontend: Frontend, tokenizing: Tokenizing, body: api.ChatCompletionRequest, created: int,
                    id_prefix: str | None = None) -> Call:
    """A chat completions call (also what a Responses or a Messages request runs as), checked; ``created``:
    when the request came (Unix seconds); ``id_prefix``: its id's (default OpenAI's).

    Raises:
        RequestError: 400/404/503, the request refused.
    """
    prompt_ids, tools = await chat_turn(frontend, tokenizing, body)
    params = api.sampling_params(body, None)  # (chat: until the end of the context)
    constrain(params, tools)
    try:
        frontend.check(prompt_ids, params)
    except RequestError as e:
        raise api.in_request_terms(e, body) from None
    return Call(frontend, body, [prompt_ids], params, True, created, tools, frontend.adapter(body.model), id_prefix)
