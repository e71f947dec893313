"""The ``http`` transport: OpenAI's and Anthropic's APIs (Starlette on uvicorn) with SSE streaming.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST
/v1/responses`` with ``GET`` and ``DELETE /v1/responses/{id}`` (OpenAI's
Responses API), ``POST /v1/messages`` and ``/v1/messages/count_tokens``
(Anthropic's Messages API), ``GET /v1/models`` (the base model and its LoRA
adapters) and ``GET /v1/models/{id}`` (one of them), ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
(only with an API key), ``GET`` and ``POST /v1/admin/scheduler`` (the
scheduler's options, and its latency targets changed while serving; only
with an API key, and left out of /openapi.json: an operator's route, not a
client's), ``GET /health`` (503 while the engine is down or the
server drains), ``GET /metrics`` (Prometheus text), ``GET /openapi.json``
(this API as an OpenAPI document), ``GET /dashboard`` (``GET /`` redirects there: a live page of the
engine's steps, KV blocks, queues, latencies and the doctor's verdict; its
data, ``GET /dashboard/data``, needs the API key like the API). The key
comes as ``Authorization: Bearer KEY`` or as ``x-api-key: KEY``
(Anthropic's clients). Errors use each API's error JSON with the status
that says why. A client that disconnects, streaming or not, aborts its
request in the engine at once.
"""

from __future__ import annotations

import os
import socket
from typing import ClassVar

import anyio
import anyio.abc
import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from conveyor.api import responses_api
from conveyor.plugins.transport.declarations import HTTPOptions
from conveyor.plugins.transport.http_routes import Routes
from conveyor.transport import Frontend, Transport


class _Server(uvicorn.Server):
    # The conveyor server owns SIGINT/SIGTERM: it drains requests before the HTTP server stops.
    def install_signal_handlers(self) -> None:
        pass

    def capture_signals(self):  # uvicorn >= 0.29
        import contextlib

        return contextlib.nullcontext()


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
                state = "is empty" if options.api_key_env in os.environ else "is not set"
                raise ValueError(f"[transport] api_key_env = {options.api_key_env!r}: that environment variable {state}")

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
        routes = Routes(frontend, self.api_key, self.options.max_body_bytes,
                         responses_api.ResponseStore(self.options.max_stored_responses), self.options.strict_requests)
        return Starlette(
            routes=[
                Route("/v1/completions", routes.completions, methods=["POST"]),
                Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
                Route("/v1/responses", routes.responses, methods=["POST"]),
                Route("/v1/responses/{response_id}", routes.stored_response, methods=["GET", "DELETE"]),
                Route("/v1/messages", routes.messages, methods=["POST"]),
                Route("/v1/messages/count_tokens", routes.count_tokens, methods=["POST"]),
                Route("/v1/embeddings", routes.embeddings, methods=["POST"]),
                Route("/v1/files", routes.upload_file, methods=["POST"]),
                Route("/v1/files", routes.list_files, methods=["GET"]),
                Route("/v1/files/{file_id}", routes.file, methods=["GET", "DELETE"]),
                Route("/v1/files/{file_id}/content", routes.file_content, methods=["GET"]),
                Route("/tokenize", routes.tokenize, methods=["POST"]),
                Route("/detokenize", routes.detokenize, methods=["POST"]),
                Route("/v1/models", routes.models, methods=["GET"]),
                Route("/v1/models/{model_id:path}", routes.model, methods=["GET"]),
                Route("/v1/load_lora_adapter", routes.load_lora_adapter, methods=["POST"]),
                Route("/v1/unload_lora_adapter", routes.unload_lora_adapter, methods=["POST"]),
                Route("/v1/admin/scheduler", routes.admin_scheduler, methods=["GET", "POST"]),
                Route("/health", routes.health, methods=["GET"]),
                Route("/metrics", routes.metrics, methods=["GET"]),
                Route("/openapi.json", routes.openapi, methods=["GET"]),
                Route("/", routes.root, methods=["GET"]),
                Route("/dashboard", routes.dashboard, methods=["GET"]),
                Route("/dashboard/data", routes.dashboard_data, methods=["GET"]),
                Mount("/dashboard/static", StaticFiles(packages=[("conveyor.serving", "static")])),
            ],
            exception_handlers={404: routes.not_found, 405: routes.not_allowed, Exception: routes.internal_error},
        )
