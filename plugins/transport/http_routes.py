"""The HTTP routes' handlers (``http`` serves them): each API's request parsed, run through the frontend, and
answered in that API's shape (the server's own routes, the key's check and the body's reading: ``server_routes``)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from conveyor.api import anthropic_api, calls, embeddings_api, responses_api
from conveyor.api import openai_api as api
from conveyor.api.legacy_functions import LegacyFunctions
from conveyor.api.openai_call import Call, Emit
from conveyor.api.responses_reply import Reply
from conveyor.plugins.transport.file_routes import FileRoutes
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
from conveyor.transport import Frontend, RequestError


class Routes(FileRoutes):
    """Every route: the server's own (``ServerRoutes``), the Files API's (``FileRoutes``) and the APIs'."""

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
                call = await calls.chat_call(self.frontend, self.tokenizing, legacy.request, created)
            else:
                call = await calls.completion_call(self.frontend, self.tokenizing,
                                                  await self._parse(request, api.CompletionRequest), created)
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

    async def responses(self, request: Request) -> Response | EventStream:
        """OpenAI's Responses API (``responses_api``)."""
        created = int(time.time())
        if (denied := self._check_key(request)) is not None:
            return denied
        try:
            body = await self._parse(request, responses_api.ResponsesRequest)
            chat, conversation = responses_api.to_chat(body, self.store)
            call = await calls.chat_call(self.frontend, self.tokenizing, chat, created, "resp")
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
            call = await calls.chat_call(self.frontend, self.tokenizing, anthropic_api.to_chat(body), created, "msg")
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
            prompt_ids, _ = await calls.chat_turn(self.frontend, self.tokenizing, anthropic_api.to_chat(body))
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
