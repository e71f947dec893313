"""The HTTP routes' handlers (``http`` serves them): each API's request parsed, run through the frontend, and
answered in that API's shape (the server's own routes, the key's check and the body's reading: ``server_routes``)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from conveyor.api.chat import chat_prompt, constrain
from conveyor.api.tool_calls import Tools
from conveyor.plugins.transport import anthropic_api, embeddings_api, responses_api
from conveyor.plugins.transport import openai_api as api
from conveyor.plugins.transport.legacy_functions import LegacyFunctions
from conveyor.plugins.transport.openai_call import Call, Emit
from conveyor.plugins.transport.responses_reply import Reply
from conveyor.plugins.transport.server_routes import ServerRoutes
from conveyor.plugins.transport.sse import (
    ANTHROPIC,
    OPENAI,
    RESPONSES,
    Dialect,
    EventStream,
    error_response,
    json_response,
    until_disconnect,
)
from conveyor.sampling import SamplingParams
from conveyor.transport import Frontend, RequestError


class Routes(ServerRoutes):
    """Every route: the server's own (``ServerRoutes``) and the APIs'."""

    async def completions(self, request: Request) -> Response | EventStream:
        return await self._handle(request, chat=False)

    async def chat_completions(self, request: Request) -> Response | EventStream:
        return await self._handle(request, chat=True)

    async def _handle(self, request: Request, chat: bool) -> Response | EventStream:
        created = int(time.time())
        if (denied := self._check_key(request)) is not None:
            return denied
        legacy = LegacyFunctions()  # (chat's functions and function_call: answered in their shape)
        try:
            if chat:
                legacy = LegacyFunctions(await self._parse(request, api.ChatCompletionRequest))
                call = await self._chat_call(legacy.request, created)
            else:
                call = await self._completion_call(await self._parse(request, api.CompletionRequest), created)
        except RequestError as e:
            return error_response(legacy.rename(e))
        if call.body.stream:
            return EventStream(legacy.stream(call.stream))
        if (refused := await self._run(request, call, OPENAI, legacy.rename)) is not None:
            return refused
        return json_response(legacy.reply(call.result()))

    async def _run(self, request: Request, call: Call, dialect: Dialect,
                   rename: Callable[[RequestError], RequestError] = lambda e: e) -> Response | None:
        """Run a call to its end: None, or the response that ends it early (a refusal, its field named by
        ``rename``, or the client gone)."""
        try:
            if not await until_disconnect(request.receive, call.run()):
                return Response(status_code=499)  # nobody is listening
        except RequestError as e:
            return error_response(rename(e), dialect)
        return None

    async def _completion_call(self, body: api.CompletionRequest, created: int) -> Call:
        params = api.sampling_params(body, 16)  # (OpenAI's default max_tokens for completions)
        prompts = await self.tokenizing.run(self._completion_prompts, api.prompts(body), params)
        return Call(self.frontend, body, prompts, params, False, created, None, self.frontend.adapter(body.model))

    def _completion_prompts(self, prompts: list[str | list[int]], params: SamplingParams) -> list[list[int]]:
        """A completions request's prompts tokenized and checked (in a worker thread); in a batch, a refusal names
        ``prompt[i]``."""
        if len(prompts) == 1:
            prompt_ids = self.frontend.encode(prompts[0], "prompt")
            self.frontend.check(prompt_ids, params)
            return [prompt_ids]
        batch = []
        for i, prompt in enumerate(prompts):
            field = f"prompt[{i}]"
            prompt_ids = self.frontend.encode(prompt, field)
            try:
                self.frontend.check(prompt_ids, params)
            except RequestError as e:
                raise RequestError(f"{field}: {e.message}", e.status, field if e.status == 400 else None) from None
            batch.append(prompt_ids)
        return batch

    async def _chat_prompt(self, body: api.ChatCompletionRequest) -> tuple[list[int], Tools]:
        tools = Tools(body.tools, body.tool_choice, body.parallel_tool_calls)
        prompt_ids = await self.tokenizing.run(chat_prompt, self.frontend, body.messages, tools,
                                               add_generation_prompt=body.add_generation_prompt,
                                               continue_final_message=body.continue_final_message)
        return prompt_ids, tools

    async def _chat_call(self, body: api.ChatCompletionRequest, created: int, id_prefix: str | None = None) -> Call:
        """A chat completions call (also what a Responses or a Messages request runs as), checked; ``created``:
        when the request came (Unix seconds).

        Raises:
            RequestError: 400/404/503, the request refused.
        """
        prompt_ids, tools = await self._chat_prompt(body)
        params = api.sampling_params(body, None)  # (chat: until the end of the context)
        constrain(params, tools)
        try:
            self.frontend.check(prompt_ids, params)
        except RequestError as e:
            raise api.in_request_terms(e, body) from None
        return Call(self.frontend, body, [prompt_ids], params, True, created, tools, self.frontend.adapter(body.model),
                    id_prefix)

    async def responses(self, request: Request) -> Response | EventStream:
        """OpenAI's Responses API (``responses_api``)."""
        created = int(time.time())
        if (denied := self._check_key(request)) is not None:
            return denied
        try:
            body = await self._parse(request, responses_api.ResponsesRequest)
            chat, conversation = responses_api.to_chat(body, self.store)
            call = await self._chat_call(chat, created, "resp")
        except RequestError as e:
            return error_response(responses_api.in_responses_terms(e))
        reply = Reply(call, body)

        def keep(response: dict[str, Any]) -> None:
            if body.store:
                self.store.put(response, conversation + responses_api.assistant_messages(response))

        if body.stream:
            async def produce(emit: Emit, begin: Callable[[], Awaitable[None]]) -> None:
                try:
                    keep(await reply.stream(emit, begin))
                except RequestError as e:
                    raise responses_api.in_responses_terms(e) from None

            return EventStream(produce, RESPONSES)
        if (refused := await self._run(request, call, OPENAI, responses_api.in_responses_terms)) is not None:
            return refused
        response = reply.response()
        keep(response)
        return json_response(response)

    async def stored_response(self, request: Request) -> Response:
        """``GET``: a stored response; ``DELETE``: forget it."""
        if (denied := self._check_key(request)) is not None:
            return denied
        response_id = request.path_params["response_id"]
        try:
            if request.method == "DELETE":
                self.store.delete(response_id)
                return json_response({"id": response_id, "object": "response", "deleted": True})
            return json_response(self.store.get(response_id))
        except RequestError as e:
            return error_response(e)

    async def messages(self, request: Request) -> Response | EventStream:
        """Anthropic's Messages API (``anthropic_api``)."""
        created = int(time.time())
        if (denied := self._check_key(request, ANTHROPIC)) is not None:
            return denied
        try:
            body = await self._parse(request, anthropic_api.MessagesRequest)
            call = await self._chat_call(anthropic_api.to_chat(body), created, "msg")
        except RequestError as e:
            return error_response(e, ANTHROPIC)
        if body.stream:
            return EventStream(lambda emit, begin: anthropic_api.stream(call, emit, begin), ANTHROPIC)
        if (refused := await self._run(request, call, ANTHROPIC)) is not None:
            return refused
        return json_response(anthropic_api.message(call))

    async def count_tokens(self, request: Request) -> Response:
        """The prompt tokens a Messages request would take, tools included (``{"input_tokens": N}``)."""
        if (denied := self._check_key(request, ANTHROPIC)) is not None:
            return denied
        try:
            body = await self._parse(request, anthropic_api.CountTokensRequest)
            self.frontend.adapter(body.model)  # (a model this server does not have is a 404, as in create)
            prompt_ids, _ = await self._chat_prompt(anthropic_api.to_chat(body))
        except RequestError as e:
            return error_response(e, ANTHROPIC)
        return json_response({"input_tokens": len(prompt_ids)})

    async def embeddings(self, request: Request) -> Response:
        """OpenAI's embeddings (``embeddings_api``)."""
        if (denied := self._check_key(request)) is not None:
            return denied
        try:
            body = await self._parse(request, embeddings_api.EmbeddingRequest)
            pooling = self.frontend.pooling
            prompts = await self.tokenizing.run(embeddings_api.prompts, self.frontend, body, pooling)
            done: dict[str, Any] = {}

            async def run() -> None:
                done.update(await embeddings_api.embed(self.frontend, body, prompts, pooling))

            if not await until_disconnect(request.receive, run()):
                return Response(status_code=499)
        except RequestError as e:
            return error_response(e)
        return json_response(done)

    async def tokenize(self, request: Request) -> Response:
        """vLLM's ``/tokenize``: a text's or a conversation's token ids."""
        return await self._answer(request, embeddings_api.TokenizeRequest, embeddings_api.tokenize)

    async def detokenize(self, request: Request) -> Response:
        """vLLM's ``/detokenize``: token ids' text."""
        return await self._answer(request, embeddings_api.DetokenizeRequest, embeddings_api.detokenize)

    async def _answer(self, request: Request, kind: type[msgspec.Struct],
                      answer: Callable[[Frontend, Any], dict[str, Any]]) -> Response:
        """A route answered at once from its parsed body (no engine work; tokenizing, so in a worker thread)."""
        if (denied := self._check_key(request)) is not None:
            return denied
        try:
            body = await self._parse(request, kind)
            return json_response(await self.tokenizing.run(answer, self.frontend, body))
        except RequestError as e:
            return error_response(e)
