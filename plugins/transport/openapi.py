"""The HTTP API as an OpenAPI 3.1 document, served at ``GET /openapi.json``.

The request bodies' schemas come from the msgspec Structs the routes decode
them with (``openai_api``, ``responses_api``, ``anthropic_api``), narrowed by the ranges the server enforces (from
the same constants its checks use) and by what it serves now (model names,
``max_model_len``, the vocabulary); responses are described by status, with
the API's error object (OpenAI's, or Anthropic's on ``/v1/messages``) for every refusal.
"""

from __future__ import annotations

from typing import Any

import msgspec

from conveyor.api import anthropic_api, embeddings_api, responses_api
from conveyor.api import openai_api as api
from conveyor.batches.files import UPLOAD_PURPOSES
from conveyor.sampling import (
    MAX_CHOICES,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)

ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": "integer"}},
    }},
}
ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {"type": {"const": "error"}, "error": {
        "type": "object", "required": ["type", "message"],
        "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}},
}
# status -> when a route answers it
REFUSALS = {
    "400": "a field out of range or malformed (param names it)",
    "401": "the API key is missing or wrong (servers with a key)",
    "404": "no such model (or stored response, or file; the Files API where [batch] dir is not set)",
    "411": "an upload without a Content-Length",
    "413": "the body (or an uploaded file) is over the size limit",
    "429": "the waiting queue is full, or the TTFT target cannot be met at the load now (Retry-After)",
    "503": "the engine is starting, restarting or the server is draining",
}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*statuses: str, schema: str = "Error") -> dict[str, Any]:
    return {status: _json({"$ref": f"#/components/schemas/{schema}"}, REFUSALS[status]) for status in statuses}


def _narrow(properties: dict[str, Any], limits: dict[str, dict[str, Any]]) -> None:
    """A struct's properties narrowed to the server's limits (a nullable field stays nullable)."""
    for field, limit in limits.items():
        original = properties[field]
        nullable = {"type": "null"} in original.get("anyOf", [])
        properties[field] = {"anyOf": [limit, {"type": "null"}]} if nullable else dict(limit)
        if "default" in original:
            properties[field]["default"] = original["default"]


def _limits(models: list[str], max_model_len: int, vocab_size: int) -> dict[str, dict[str, Any]]:
    """The ranges the server enforces on request fields (from the same constants its checks use), and the model
    names it serves: what the structs' types alone do not say."""
    tokens = {"type": "integer", "minimum": 1, "maximum": max(1, max_model_len - 1)}
    token_ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}}
    # what the chat template takes (conveyor.model.tokenizer): text or text parts, which only an assistant's
    # message (one that called tools) may leave out
    text = {"anyOf": [{"type": "string"}, {"type": "array", "items": {
        "type": "object", "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]}
    message = {"anyOf": [
        {"type": "object", "required": ["role", "content"],
         "properties": {"role": {"enum": ["system", "developer", "user", "tool"]}, "content": text}},
        {"type": "object", "required": ["role"],
         "properties": {"role": {"const": "assistant"}, "content": {"anyOf": [text, {"type": "null"}]}}},
    ]}
    logprobs = {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}
    stop = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_STRING_CHARS}
    penalty = {"type": "number", "minimum": -MAX_PENALTY, "maximum": MAX_PENALTY}
    return {
        "model": {"enum": models},
        "prompt": {"anyOf": [{"type": "string", "minLength": 1}, token_ids,  # (one prompt, or a batch of them)
                             {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1,
                              "maxItems": api.MAX_PROMPTS},
                             {"type": "array", "items": token_ids, "minItems": 1, "maxItems": api.MAX_PROMPTS}]},
        "messages": {"type": "array", "minItems": 1, "items": message},
        "max_tokens": tokens,
        "max_completion_tokens": tokens,
        "n": {"type": "integer", "minimum": 1, "maximum": api.MAX_N},
        "logprobs": logprobs,
        "top_logprobs": logprobs,
        "prompt_logprobs": logprobs,
        "stop": {"anyOf": [stop, {"type": "array", "items": stop, "maxItems": MAX_STOP_STRINGS}]},
        "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0},
                           "maxItems": MAX_STOP_TOKEN_IDS},
        "temperature": {"type": "number", "minimum": 0},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": -1},
        "min_p": {"type": "number", "minimum": 0, "maximum": 1},
        "presence_penalty": penalty,
        "frequency_penalty": penalty,
        "repetition_penalty": {"type": "number", "exclusiveMinimum": 0},
        "min_tokens": {"type": "integer", "minimum": 0},
        # token ids as JSON object keys: decimal strings (ids past the vocabulary are refused)
        "logit_bias": {"type": "object", "maxProperties": MAX_LOGIT_BIAS_TOKENS,
                       "propertyNames": {"pattern": "^(0|[1-9][0-9]*)$", "maxLength": len(str(vocab_size - 1))},
                       "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS,
                                                "maximum": MAX_LOGIT_BIAS}},
        "guided_choice": {"type": "array", "minItems": 1, "maxItems": MAX_CHOICES,
                          "items": {"type": "string", "minLength": 1}},
        "suffix": {"type": "string", "maxLength": 0},  # (not supported: only an empty one)
    }


def _chat_dependencies(chat: dict[str, Any]) -> None:
    """What a chat field needs of the others: top_logprobs needs logprobs=true; a tool_choice that forces a call
    needs tools; the legacy functions and function_call are not given beside tools and tool_choice. Tools and
    tool_choice (and the legacy fields) take the forms the server reads (a function with a name)."""
    name = {"type": "string", "minLength": 1}
    function = {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {"name": name}}}}
    chat["properties"]["tool_choice"] = {"anyOf": [{"enum": ["none", "auto", "required"]}, function,
                                                   {"type": "null"}]}
    chat["properties"]["tools"] = {"anyOf": [{"type": "array", "items": function}, {"type": "null"}]}
    chat["dependentSchemas"] = {"top_logprobs": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}}
    chat["if"] = {"required": ["tool_choice"], "properties": {"tool_choice": {"anyOf": [{"const": "required"},
                                                                                        function]}}}
    chat["then"] = {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}
    # the legacy functions and function_call: not beside the fields that replaced them; one that may call needs
    # functions
    legacy_function = function["properties"]["function"]
    chat["properties"]["functions"] = {"anyOf": [{"type": "array", "items": legacy_function}, {"type": "null"}]}
    chat["properties"]["function_call"] = {"anyOf": [{"enum": ["none", "auto"]}, legacy_function, {"type": "null"}]}
    given = {"not": {"type": "null"}}
    replaced = (("functions", "tools"), ("function_call", "tool_choice"), ("function_call", "tools"))
    chat["allOf"] = [{"not": {"required": [old, new], "properties": {old: given, new: given}}} for old, new in replaced]
    chat["allOf"].append({
        "if": {"required": ["function_call"], "properties": {"function_call": {"anyOf": [{"const": "auto"},
                                                                                          {"type": "object"}]}}},
        "then": {"required": ["functions"], "properties": {"functions": {"type": "array", "minItems": 1}}}})


# a generating route's answer
GENERATED = {"description": "the completion (JSON), or with stream=true server-sent events of chunks",
             "content": {"application/json": {"schema": {"type": "object"}},
                         "text/event-stream": {"schema": {"type": "string"}}}}


def _schemas(models: list[str], max_model_len: int, vocab_size: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The request bodies' references, and the schemas, held to this server's limits (``openapi_document``'s
    arguments)."""
    structs = [api.CompletionRequest, api.ChatCompletionRequest, api.LoadLoraRequest, api.UnloadLoraRequest,
               responses_api.ResponsesRequest, anthropic_api.MessagesRequest, anthropic_api.CountTokensRequest,
               embeddings_api.EmbeddingRequest, embeddings_api.TokenizeRequest, embeddings_api.DetokenizeRequest]
    refs, components = msgspec.json.schema_components(structs, ref_template="#/components/schemas/{name}")
    limits = _limits(models, max_model_len, vocab_size)
    chat_only = {"top_logprobs", "max_completion_tokens", "messages"}
    completion_only = {"logprobs", "prompt", "suffix"}
    for name, fields in (("CompletionRequest", set(limits) - chat_only),
                         ("ChatCompletionRequest", set(limits) - completion_only)):  # (chat's logprobs: a bool)
        _narrow(components[name]["properties"], {field: limits[field] for field in fields})
    _chat_dependencies(components["ChatCompletionRequest"])
    # a json_schema response format carries its schema
    components["ResponseFormat"]["if"] = {"properties": {"type": {"const": "json_schema"}}}
    components["ResponseFormat"]["then"] = {"required": ["json_schema"], "properties": {
        "json_schema": {"$ref": "#/components/schemas/JSONSchemaFormat"}}}
    streamed = {"required": ["stream"], "properties": {"stream": {"const": True}}}
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        dependencies = components[name].setdefault("dependentSchemas", {})
        dependencies["stream_options"] = streamed
        # (prompt logprobs are not streamed: above 0, not with stream true)
        dependencies["prompt_logprobs"] = {"anyOf": [{"properties": {"prompt_logprobs": {"enum": [0, None]}}},
                                                     {"not": streamed}]}
    sampling = {field: limits[field] for field in ("model", "temperature", "top_p")}
    _narrow(components["ResponsesRequest"]["properties"], sampling | {"max_output_tokens": limits["max_tokens"]})
    # (Messages holds temperature and top_k to Anthropic's ranges, which its struct states: kept as they are)
    _narrow(components["MessagesRequest"]["properties"], {field: limits[field] for field in ("model", "top_p")} | {
        "max_tokens": limits["max_tokens"], "stop_sequences": limits["stop"]["anyOf"][1]})
    token_ids = limits["prompt"]["anyOf"][1]
    text = {"type": "string", "minLength": 1}
    _narrow(components["EmbeddingRequest"]["properties"], {"model": limits["model"], "input": {"anyOf": [
        text, token_ids, {"type": "array", "minItems": 1, "maxItems": embeddings_api.MAX_INPUTS, "items": text},
        {"type": "array", "minItems": 1, "maxItems": embeddings_api.MAX_INPUTS, "items": token_ids}]}})
    _narrow(components["TokenizeRequest"]["properties"], {"model": limits["model"], "messages": limits["messages"]})
    _narrow(components["DetokenizeRequest"]["properties"], {"model": limits["model"], "tokens": token_ids})
    components["AnthropicError"] = ANTHROPIC_ERROR
    components["Error"] = ERROR
    return refs, components


def openapi_document(api_key: bool, models: list[str], max_model_len: int, vocab_size: int) -> dict[str, Any]:
    """The document.

    Args:
        api_key: the routes need a bearer token (all but /health, /metrics, /dashboard's page and this one).
        models: the names ``model`` may take (the base model's and its adapters').
        max_model_len: the longest prompt + output (0 while the engine starts).
        vocab_size: token ids in a prompt are below it.
    """
    refs, components = _schemas(models, max_model_len, vocab_size)
    completion, chat, load, unload, responses, messages, count_tokens, embedding, tokenize, detokenize = refs
    secured = {"security": [{"bearer": []}]} if api_key else {}

    def post(operation: str, body: dict[str, Any], ok: dict[str, Any], *refusals: str,
             error: str = "Error") -> dict[str, Any]:
        return {"post": {"operationId": operation, **secured,
                         "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
                         "responses": {"200": ok, **_errors(*refusals, schema=error)}}}

    def get(operation: str, ok: dict[str, Any], *refusals: str, open_route: bool = False) -> dict[str, Any]:
        return {"get": {"operationId": operation, **({} if open_route else secured),
                        "responses": {"200": ok, **_errors(*refusals)}}}

    inference = ("400", "404", "413", "429", "503") + (("401",) if api_key else ())
    no_engine = tuple(code for code in inference if code not in ("429", "503"))  # (answered without the engine)
    lora_status = {"type": "object", "properties": {"lora_name": {"type": "string"}, "status": {"type": "string"}}}
    paths = {
        "/v1/completions": post("createCompletion", completion, GENERATED, *inference),
        "/v1/chat/completions": post("createChatCompletion", chat, GENERATED, *inference),
        "/v1/responses": post("createResponse", responses, {**GENERATED, "description": "the response (JSON), or "
                              "with stream=true its typed server-sent events"}, *inference),
        "/v1/responses/{response_id}": {
            "parameters": [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            **{method: {"operationId": f"{method}Response", **secured, "responses": {
                "200": _json({"type": "object"}, "the stored response" if method == "get" else "forgotten"),
                **_errors("404", *(("401",) if api_key else ()))}} for method in ("get", "delete")},
        },
        "/v1/messages": post("createMessage", messages, {**GENERATED, "description": "the message (JSON), or with "
                             "stream=true Anthropic's server-sent events"}, *inference, error="AnthropicError"),
        "/v1/messages/count_tokens": post(
            "countMessageTokens", count_tokens, _json({"type": "object", "required": ["input_tokens"], "properties": {
                "input_tokens": {"type": "integer"}}}, "the prompt's tokens"),
            *no_engine, error="AnthropicError"),
        "/v1/embeddings": post("createEmbedding", embedding, _json({"type": "object", "required": ["data"]},
                               "one vector per input ([model] pooling)"), *inference),
        "/tokenize": post("tokenize", tokenize, _json({"type": "object", "required": ["count", "tokens"]},
                          "the token ids"), *no_engine),
        "/detokenize": post("detokenize", detokenize, _json({"type": "object", "required": ["prompt"]},
                            "the text"), *no_engine),
        "/v1/models": get("listModels", _json({"type": "object"}, "the base model and its LoRA adapters"),
                          "503", *(("401",) if api_key else ())),
        "/v1/models/{model_id}": {
            "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            **get("retrieveModel", _json({"type": "object"}, "the model (or adapter) of that id, as listed"),
                  "404", "503", *(("401",) if api_key else ())),
        },
        "/health": get("health", _json({"type": "object"}, "the engine is up"), "503", open_route=True),
        "/metrics": get("metrics", {"description": "Prometheus text",
                                    "content": {"text/plain": {"schema": {"type": "string"}}}}, open_route=True),
        "/openapi.json": get("openapi", _json({"type": "object"}, "this document"), open_route=True),
        "/dashboard": get("dashboard", {"description": "the live dashboard's page (it holds no data)",
                                        "content": {"text/html": {"schema": {"type": "string"}}}}, open_route=True),
        "/dashboard/data": get("dashboardData", _json({"type": "object"}, "what the dashboard draws"),
                               *(("401",) if api_key else ())),
    }
    paths.update(_file_paths(secured, ("401",) if api_key else ()))
    if api_key:  # (without a key the adapter routes answer 403)
        adapters = ("400", "401", "404", "413")
        paths["/v1/load_lora_adapter"] = post("loadLoraAdapter", load, _json(lora_status, "loaded"), *adapters)
        paths["/v1/unload_lora_adapter"] = post("unloadLoraAdapter", unload, _json(lora_status, "unloaded"),
                                                *adapters)
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "Conveyor", "version": "1", "description": "An OpenAI-compatible inference server."},
        "paths": paths,
        "components": {"schemas": components},
    }
    if api_key:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return document


def _file_paths(secured: dict[str, Any], key: tuple[str, ...]) -> dict[str, Any]:
    """The Files API's routes (each answers 404 where ``[batch] dir`` is not set)."""
    file_id = [{"name": "file_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    file = _json({"type": "object", "required": ["id", "bytes", "filename", "purpose"]}, "the file")
    query = [{"name": "purpose", "in": "query", "schema": {"type": "string"}},
             {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 10_000}},
             {"name": "after", "in": "query", "schema": {"type": "string"}},
             {"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"]}}]
    form = {"type": "object", "required": ["file", "purpose"], "properties": {
        "file": {"type": "string", "format": "binary"}, "purpose": {"enum": list(UPLOAD_PURPOSES)}}}

    def operation(name: str, ok: dict[str, Any], *refusals: str, **more: Any) -> dict[str, Any]:
        return {"operationId": name, **secured, **more, "responses": {"200": ok, **_errors(*refusals, *key)}}

    return {
        "/v1/files": {
            "get": operation("listFiles", _json({"type": "object", "required": ["data", "has_more"]},
                                                "a page of files"), "400", "404", parameters=query),
            "post": operation("createFile", file, "400", "404", "411", "413", requestBody={
                "required": True, "content": {"multipart/form-data": {"schema": form}}}),
        },
        "/v1/files/{file_id}": {
            "parameters": file_id,
            "get": operation("retrieveFile", file, "404"),
            "delete": operation("deleteFile", _json({"type": "object", "required": ["deleted"]}, "deleted"), "404"),
        },
        "/v1/files/{file_id}/content": {
            "parameters": file_id,
            "get": operation("retrieveFileContent", {"description": "the file's bytes", "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}, "404"),
        },
    }
