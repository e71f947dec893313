"""The HTTP server's own routes (its health, metrics, OpenAPI document and dashboard; the served models and their
LoRA adapters; the scheduler's admin route), and what every route shares: the API key's check and the body read
within its size limit. ``http_routes.Routes`` adds the APIs' routes."""

from __future__ import annotations

import hmac
import importlib.resources
import logging
import time
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import FileResponse, RedirectResponse, Response

from conveyor.api import openai_api as api
from conveyor.api import responses_api
from conveyor.api.tokenizing import Tokenizing
from conveyor.plugins.transport.openapi import openapi_document
from conveyor.plugins.transport.request_body import decode_body
from conveyor.plugins.transport.sse import OPENAI, Dialect, error_response, json_response
from conveyor.transport import Frontend, RequestError

logger = logging.getLogger("conveyor")

# the dashboard's page, script and its chart library (uPlot, MIT), served from the package
STATIC = importlib.resources.files("conveyor.serving") / "static"


class ServerRoutes:
    """The server's own routes, and the state every route shares."""

    def __init__(self, frontend: Frontend, api_key: str | None, max_body_bytes: int,
                 store: responses_api.ResponseStore, strict_requests: bool = False):
        self.frontend = frontend
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.store = store
        # refuse request fields the API does not have (else: logged once per name, counted, ignored)
        self.strict_requests = strict_requests
        # prompts are tokenized in these threads, not on the event loop
        self.tokenizing = Tokenizing()
        # when the server started (Unix seconds): the served models' ``created``
        self.started = int(time.time())

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
        names = [frontend.model_name, *frontend.aliases, *frontend.adapters]
        return json_response(openapi_document(self.api_key is not None, names,
                                              frontend.max_model_len, frontend.tokenizer.vocab_size))

    async def metrics(self, request: Request) -> Response:
        body = self.frontend.metrics.render(self.frontend.engine_alive, self.frontend.num_in_flight)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def root(self, request: Request) -> Response:
        """``/`` is where a person types the server's address: the dashboard is the page there is to see."""
        return RedirectResponse("/dashboard", status_code=307)

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
        return json_response({"object": "list", "data": self._served_models()})

    async def model(self, request: Request) -> Response:
        """One of the models ``/v1/models`` lists, by any name a request may give it (the base model's, an
        adapter's, or ``BASE:NAME``)."""
        if (denied := self._check_key(request)) is not None:
            return denied
        if not self.frontend.max_model_len:
            return error_response(RequestError("the engine is starting", 503))
        try:
            adapter = self.frontend.adapter(request.path_params["model_id"])
        except RequestError as e:
            return error_response(e)
        model_id = request.path_params["model_id"]
        name = (model_id if model_id in self.frontend.aliases else self.frontend.model_name) if adapter is None \
            else adapter.name
        return json_response(next(model for model in self._served_models() if model["id"] == name))

    def _served_models(self) -> list[dict[str, Any]]:
        """The base model, its aliases, then each LoRA adapter (its ``parent`` the base), as OpenAI's model
        objects."""
        base = self.frontend.model_name
        common = {"object": "model", "created": self.started, "owned_by": "conveyor",
                  "max_model_len": self.frontend.max_model_len}
        return ([{"id": name, **common} for name in (base, *self.frontend.aliases)]
                + [{"id": name, **common, "parent": base} for name in self.frontend.adapters])

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
        return decode_body(await self._read_body(request), kind, self._unknown_fields)

    def _unknown_fields(self, names: list[str]) -> None:
        """Fields a request sent that its API does not have: a typo (``max_tokns``) or another server's extension
        (llama.cpp's ``n_predict``) would otherwise change nothing, unseen. vLLM logs them too.

        Raises:
            RequestError: 400 naming the first, under ``strict_requests``.
        """
        for name in names:
            if self.frontend.metrics.unknown_fields.count(name):
                logger.warning("a request carries the field %r, which the API does not have: %s (logged once a "
                               "field; all are counted in conveyor_request_unknown_fields_total)", name,
                               "refused" if self.strict_requests else "ignored")
        if self.strict_requests:
            raise RequestError(f"{names[0]}: the API has no such field (this server refuses unknown fields: "
                               "strict_requests)", 400, names[0])
