"""The HTTP routes' handlers (``http`` serves them): each API's request parsed, run through the frontend, and
answered in that API's shape."""

from __future__ import annotations

import hmac
import importlib.resources
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import FileResponse, Response

from conveyor.plugins.transport import anthropic_api, embeddings_api, responses_api
from conveyor.plugins.transport import openai_api as api
from conveyor.plugins.transport.openai_call import Call, Emit
from conveyor.plugins.transport.openapi import openapi_document
from conveyor.plugins.transport.request_body import decode_body
from conveyor.plugins.transport.responses_reply import Reply
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
from conveyor.plugins.transport.tokenizing import Tokenizing
from conveyor.plugins.transport.tool_calls import Tools
from conveyor.sampling import SamplingParams, StructuredOutput
from conveyor.transport import Frontend, RequestError

logger = logging.getLogger("conveyor")

# the dashboard's page, script and its chart library (uPlot, MIT), served from the package
STATIC = importlib.resources.files("conveyor.serving") / "static"


class Routes:
    def __init__(self, frontend: Frontend, api_key: str | None, max_body_bytes: int,
                 store: responses_api.ResponseStore):
        self.frontend = frontend
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.store = store
        # prompts are tokenized in these threads, not on the event loop
        self.tokenizing = Tokenizing()

    async def not_found(self, request: Request, exc: Exception) -> Response:
        return error_response(RequestError(f"no route {request.method} {request.url.path}", 404))

    async def not_allowed(self, request: Request, exc: Exception) -> Response:
        return error_response(RequestError(f"{request.method} is not allowed on {request.url.path}", 405))

    async def internal_error(self, request: Request, exc: Exception) -> Response:
        logger.exception("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(RequestError(f"internal error: {type(exc).__name__}: {exc}", 500))

    async def health(self, request: Request) -> Response:
        if self.frontend.draining:
            return error_response(RequestError("the server is shutting down", 503))
        if not self.frontend.engine_alive:
            return error_response(RequestError("the engine is not running (starting or restarting)", 503))
        return json_response({"status": "ok"})

    async def openapi(self, request: Request) -> Response:
        frontend = self.frontend
        return json_response(openapi_document(self.api_key is not None, [frontend.model_name, *frontend.adapters],
                                              frontend.max_model_len, frontend.tokenizer.vocab_size))

    async def metrics(self, request: Request) -> Response:
        body = self.frontend.metrics.render(self.frontend.engine_alive, self.frontend.num_in_flight)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def dashboard(self, request: Request) -> Response:
        """The page (no data in it: it asks ``/dashboard/data``, with the key where the server has one)."""
        return FileResponse(str(STATIC / "dashboard.html"))

    async def dashboard_data(self, request: Request) -> Response:
        if (denied := self._check_key(request)) is not None:
            return denied
        frontend = self.frontend
        feed = frontend.metrics.dashboard
        feed.read_metrics(lambda: frontend.metrics.render(frontend.engine_alive, frontend.num_in_flight))
        return json_response({"model": frontend.model_name, "in_flight": frontend.num_in_flight, **feed.snapshot()})

    async def models(self, request: Request) -> Response:
        if (denied := self._check_key(request)) is not None:
            return denied
        if not self.frontend.max_model_len:  # (vLLM lists nothing before its engine is up: scripts wait on this)
            return error_response(RequestError("the engine is starting", 503))
        base = self.frontend.model_name
        models = [{"id": base, "object": "model", "created": 0, "owned_by": "conveyor",
                   "max_model_len": self.frontend.max_model_len}]
        models += [{"id": name, "object": "model", "created": 0, "owned_by": "conveyor", "parent": base,
                    "max_model_len": self.frontend.max_model_len} for name in self.frontend.adapters]
        return json_response({"object": "list", "data": models})

    async def load_lora_adapter(self, request: Request) -> Response:
        """``{"lora_name", "lora_path"}``: serve a PEFT adapter directory of the server's machine under a name."""
        try:
            body = await self._adapter_body(request, api.LoadLoraRequest)
            self.frontend.add_adapter(body.lora_name, body.lora_path)
        except RequestError as e:
            return error_response(e)
        return json_response({"lora_name": body.lora_name, "status": "loaded"})

    async def unload_lora_adapter(self, request: Request) -> Response:
        """``{"lora_name"}``: stop serving an adapter."""
        try:
            body = await self._adapter_body(request, api.UnloadLoraRequest)
            self.frontend.remove_adapter(body.lora_name)
        except RequestError as e:
            return error_response(e)
        return json_response({"lora_name": body.lora_name, "status": "unloaded"})

    async def _adapter_body(self, request: Request, kind: type[msgspec.Struct]) -> Any:
        """The body of an adapter call, which needs the API key (a server without one refuses them: they name
        files on the server's machine)."""
        self._admin_key(request, "loading and unloading LoRA adapters")
        return decode_body(await self._read_body(request), kind)

    def _admin_key(self, request: Request, what: str) -> None:
        """Refuse an administrative call: 403 on a server without an API key, 401 without the right key."""
        if self.api_key is None:
            raise RequestError(f"{what} needs an API key on this server ([[transport]] api_key_env)", 403)
        if (denied := self._key_error(request)) is not None:
            raise denied

    async def admin_scheduler(self, request: Request) -> Response:
        """GET: the scheduler's options now; POST ``{"ttft_slo_ms": ..., ...}``: change those its plugin allows
        at run time (the latency targets), in every engine; both need the API key."""
        try:
            self._admin_key(request, "the scheduler's admin route")
            if request.method == "GET":
                scheduler = self.frontend.scheduler
                if scheduler is None:
                    raise RequestError("this server has no scheduler options to show", 404)
                return json_response({"plugin": scheduler.plugin, **msgspec.to_builtins(scheduler.options)})
            try:
                changes = msgspec.json.decode(await self._read_body(request))
            except msgspec.DecodeError as e:
                raise RequestError(f"the body is not valid JSON: {e}", 400) from None
            if not isinstance(changes, dict) or not changes:
                raise RequestError("the body must be a JSON object of scheduler options to change, e.g. "
                                   '{"itl_slo_ms": 150}', 400)
            return json_response(self.frontend.reconfigure_scheduler(changes))
        except RequestError as e:
            return error_response(e)

    def _check_key(self, request: Request, dialect: Dialect = OPENAI) -> Response | None:
        error = self._key_error(request)
        return None if error is None else error_response(error, dialect)

    def _key_error(self, request: Request) -> RequestError | None:
        if self.api_key is None:
            return None
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            key = request.headers.get("x-api-key", "")
        if hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            return None
        return RequestError("invalid or missing API key (send Authorization: Bearer KEY, or x-api-key: KEY)", 401)

    async def _read_body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise RequestError(f"the body has {declared} bytes; the limit is {self.max_body_bytes}", 413)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise RequestError(f"the body exceeds the limit of {self.max_body_bytes} bytes", 413)
            chunks.append(chunk)
        return b"".join(chunks)

    async def _parse(self, request: Request, kind: type[msgspec.Struct]) -> Any:
        return decode_body(await self._read_body(request), kind)

    async def completions(self, request: Request) -> Response | EventStream:
        return await self._handle(request, chat=False)

    async def chat_completions(self, request: Request) -> Response | EventStream:
        return await self._handle(request, chat=True)

    async def _handle(self, request: Request, chat: bool) -> Response | EventStream:
        created = int(time.time())
        if (denied := self._check_key(request)) is not None:
            return denied
        try:
            if chat:
                call = await self._chat_call(await self._parse(request, api.ChatCompletionRequest), created)
            else:
                call = await self._completion_call(await self._parse(request, api.CompletionRequest), created)
        except RequestError as e:
            return error_response(e)
        if call.body.stream:
            return EventStream(call.stream)
        if (refused := await self._run(request, call, OPENAI)) is not None:
            return refused
        return json_response(call.result())

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
        messages, context = tools.messages(body.messages, self.frontend.tokenizer.chat_template)
        # (continuing the last message opens no new turn, whatever add_generation_prompt says; vLLM refuses both
        # at once, which a client that leaves add_generation_prompt at its default true then meets)
        context.update(add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
                       continue_final_message=body.continue_final_message)
        return await self.tokenizing.run(self.frontend.encode_chat, messages, **context), tools

    async def _chat_call(self, body: api.ChatCompletionRequest, created: int, id_prefix: str | None = None) -> Call:
        """A chat completions call (also what a Responses or a Messages request runs as), checked; ``created``:
        when the request came (Unix seconds).

        Raises:
            RequestError: 400/404/503, the request refused.
        """
        prompt_ids, tools = await self._chat_prompt(body)
        params = api.sampling_params(body, None)  # (chat: until the end of the context)
        if (schema := tools.forced_schema()) is not None:
            if params.structured is not None:
                raise RequestError("tool_choice forces a call, which response_format cannot constrain too", 400,
                                   "tool_choice")
            params.structured = StructuredOutput(json=schema)
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
