"""The ``http`` transport: an OpenAI-compatible API (Starlette on uvicorn) with SSE streaming.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET
/v1/models`` (the base model and its LoRA adapters), ``POST
/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (only with an API
key), ``GET /health`` (503 while the engine is down or the server drains),
``GET /metrics`` (Prometheus text), ``GET /openapi.json`` (this API as an
OpenAPI document), ``GET /dashboard`` (a live page of the engine's steps, KV
blocks, queues, latencies and the doctor's verdict; its data, ``GET
/dashboard/data``, needs the API key like the API). Errors use OpenAI's error JSON
with the status that says why. A client that disconnects, streaming or not,
aborts its request in the engine at once.
"""

from __future__ import annotations

import hmac
import importlib.resources
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, ClassVar

import anyio
import anyio.abc
import msgspec
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send

from conveyor.hookspecs import hookimpl
from conveyor.plugins.transport import openai_api as api
from conveyor.plugins.transport.openai_call import Call, Emit
from conveyor.plugins.transport.openapi import openapi_document
from conveyor.plugins.transport.tool_calls import Tools
from conveyor.sampling import StructuredOutput
from conveyor.transport import Frontend, RequestError, Transport

logger = logging.getLogger("conveyor")

# the dashboard's page, script and its chart library (uPlot, MIT), served from the package
STATIC = importlib.resources.files("conveyor.serving") / "static"

class HTTPOptions(msgspec.Struct, forbid_unknown_fields=True):
    # interface to listen on; 127.0.0.1 keeps the server private to this machine
    host: str = "127.0.0.1"
    # 0 picks a free port
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8000
    # name of an environment variable holding the API key clients must send as "Authorization: Bearer KEY";
    # empty: no key
    api_key_env: str = ""
    # largest request body, in bytes (HTTP 413 beyond)
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 4 * 1024 * 1024
    # seconds to wait for open connections when the server stops
    graceful_timeout: Annotated[float, msgspec.Meta(ge=0)] = 5.0


def json_response(body: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status, media_type="application/json")


def error_response(error: RequestError) -> Response:
    return json_response(api.error_body(error.message, error.status, error.param), error.status)


class _Server(uvicorn.Server):
    # The conveyor server owns SIGINT/SIGTERM: it drains requests before the HTTP server stops.
    def install_signal_handlers(self) -> None:
        pass

    def capture_signals(self):  # uvicorn >= 0.29
        import contextlib

        return contextlib.nullcontext()


class EventStream:
    """An SSE response fed by ``produce(emit, begin)``: ``begin()`` sends the status (200) and the headers, as the
    first ``emit`` does, and an error raised before that is a JSON error response with its own status. The client
    leaving cancels the producer."""

    def __init__(self, produce: Callable[[Emit, Callable[[], Awaitable[None]]], Awaitable[None]]):
        self.produce = produce

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")]
        started = False

        async def begin() -> None:
            nonlocal started
            if not started:
                started = True
                await send({"type": "http.response.start", "status": 200, "headers": headers})

        async def emit(event: dict[str, Any]) -> None:
            await begin()
            body = b"data: " + msgspec.json.encode(event) + b"\n\n"
            await send({"type": "http.response.body", "body": body, "more_body": True})

        try:
            finished = await until_disconnect(receive, self.produce(emit, begin))
        except RequestError as e:
            if not started:
                await error_response(e)(scope, receive, send)
                return
            await emit(api.error_body(e.message, e.status, e.param))  # after the 200 went out, an error is an event
            finished = True
        except OSError:  # the connection broke while sending
            return
        if not finished:
            return
        await begin()
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def until_disconnect(receive: Receive, work: Awaitable[Any]) -> bool:
    """Run ``work``; cancel it if the client disconnects first. Returns True when it finished."""
    finished = False
    error: RequestError | OSError | None = None
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            await work
            finished = True
        except (RequestError, OSError) as e:  # past the task group it would arrive in an ExceptionGroup
            error = e
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return finished


class HTTPTransport(Transport):
    """OpenAI-compatible HTTP."""

    name: ClassVar[str] = "http"
    Options: ClassVar[type[msgspec.Struct]] = HTTPOptions

    def __init__(self, options: HTTPOptions):
        super().__init__(options)
        self.api_key: str | None = None
        if options.api_key_env:
            self.api_key = os.environ.get(options.api_key_env) or None
            if self.api_key is None:
                raise ValueError(
                    f"[transport] api_key_env = {options.api_key_env!r}: that environment variable is not set"
                )

    def url(self, port: int) -> str:
        return f"http://{self.options.host}:{port}"

    async def serve(self, frontend: Frontend, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        listener = self._listen()
        config = uvicorn.Config(self.app(frontend), log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=self.options.graceful_timeout)
        server = _Server(config)

        async def run() -> None:
            # Shielded: when the server stops, uvicorn closes its connections itself (graceful_timeout).
            with anyio.CancelScope(shield=True):
                await server.serve(sockets=[listener])

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            while not server.started:
                await anyio.sleep(0.01)
            task_status.started(self.url(listener.getsockname()[1]))
            try:
                await anyio.sleep_forever()
            finally:
                server.should_exit = True

    def _listen(self) -> socket.socket:
        """The listening socket, bound here so that a busy port is a clear error, not a uvicorn exit."""
        host, port = self.options.host, self.options.port
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((host, port))
        except OSError as e:
            listener.close()
            raise OSError(f"[transport] http cannot listen on {host}:{port}: {e.strerror}") from None
        return listener

    def app(self, frontend: Frontend) -> Starlette:
        routes = _Routes(frontend, self.api_key, self.options.max_body_bytes)
        return Starlette(
            routes=[
                Route("/v1/completions", routes.completions, methods=["POST"]),
                Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
                Route("/v1/models", routes.models, methods=["GET"]),
                Route("/v1/load_lora_adapter", routes.load_lora_adapter, methods=["POST"]),
                Route("/v1/unload_lora_adapter", routes.unload_lora_adapter, methods=["POST"]),
                Route("/health", routes.health, methods=["GET"]),
                Route("/metrics", routes.metrics, methods=["GET"]),
                Route("/openapi.json", routes.openapi, methods=["GET"]),
                Route("/dashboard", routes.dashboard, methods=["GET"]),
                Route("/dashboard/data", routes.dashboard_data, methods=["GET"]),
                Mount("/dashboard/static", StaticFiles(packages=[("conveyor.serving", "static")])),
            ],
            exception_handlers={404: routes.not_found, 405: routes.not_allowed, Exception: routes.internal_error},
        )


class _Routes:
    def __init__(self, frontend: Frontend, api_key: str | None, max_body_bytes: int):
        self.frontend = frontend
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

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
        if self.api_key is None:
            raise RequestError("loading and unloading LoRA adapters needs an API key on this server "
                               "([[transport]] api_key_env)", 403)
        if (denied := self._key_error(request)) is not None:
            raise denied
        return api.decode_body(await self._read_body(request), kind)

    def _check_key(self, request: Request) -> Response | None:
        error = self._key_error(request)
        return None if error is None else error_response(error)

    def _key_error(self, request: Request) -> RequestError | None:
        if self.api_key is None:
            return None
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            return None
        return RequestError("invalid or missing API key (send Authorization: Bearer KEY)", 401)

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
        return api.decode_body(await self._read_body(request), kind)

    async def completions(self, request: Request) -> Response | EventStream:
        return await self._handle(request, chat=False)

    async def chat_completions(self, request: Request) -> Response | EventStream:
        return await self._handle(request, chat=True)

    async def _handle(self, request: Request, chat: bool) -> Response | EventStream:
        if (denied := self._check_key(request)) is not None:
            return denied
        try:
            tools = None
            if chat:
                body = await self._parse(request, api.ChatCompletionRequest)
                tools = Tools(body.tools, body.tool_choice)
                messages, context = tools.messages(body.messages, self.frontend.tokenizer.chat_template)
                prompt_ids = self.frontend.encode_chat(messages, **context)
                default_max_tokens = None  # chat: until the end of the context
            else:
                body = await self._parse(request, api.CompletionRequest)
                prompt = body.prompt
                if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                    if len(prompt) != 1:
                        raise RequestError("send one prompt per request (a list of prompts is not supported)", 400,
                                           "prompt")
                    prompt = prompt[0]
                prompt_ids = self.frontend.encode(prompt, "prompt")
                default_max_tokens = 16  # OpenAI's default for completions
            params = api.sampling_params(body, default_max_tokens)
            if tools is not None and (schema := tools.forced_schema()) is not None:
                if params.structured is not None:
                    raise RequestError("tool_choice forces a call, which response_format cannot constrain too", 400,
                                       "tool_choice")
                params.structured = StructuredOutput(json=schema)
            self.frontend.check(prompt_ids, params)
            lora = self.frontend.adapter(body.model)
        except RequestError as e:
            return error_response(e)
        call = Call(self.frontend, body, prompt_ids, params, chat, tools, lora)
        if body.stream:
            return EventStream(call.stream)
        try:
            if not await until_disconnect(request.receive, call.run()):
                return Response(status_code=499)  # nobody is listening
        except RequestError as e:
            return error_response(e)
        return json_response(call.result())


@hookimpl
def conveyor_register_transports(register) -> None:
    register(HTTPTransport)
