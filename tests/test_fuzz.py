"""Every HTTP route of the server's own OpenAPI document fuzzed (schemathesis, a fixed seed, a bounded number of
examples, valid and invalid bodies; the document leaves out /v1/admin/scheduler and the dashboard's static files):
no server error, every refusal its API's JSON error (OpenAI's, or Anthropic's on /v1/messages), the server healthy
after. The model is a tiny random one with SmolLM2's vocabulary, so that thousands of requests take seconds."""

from __future__ import annotations

from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.helpers import save_tiny_model_with_smollm2_vocab
from tests.server import Server

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES = 30  # per route and mode


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("fuzz_model")
    save_tiny_model_with_smollm2_vocab(path, tokenizer, max_position_embeddings=128)
    config = f"""
[model]
path = "{path}"
dtype = "float32"
max_model_len = 128

[lora]
max_loras = 1

[scheduler]
max_waiting = 64

[server]
status_interval = 0.0

[[transport]]
plugin = "http"
port = 0
api_key_env = "CONVEYOR_TEST_KEY"
"""
    server = Server(config, tmp_path_factory.mktemp("fuzz"), env={"CONVEYOR_TEST_KEY": KEY}).start()
    yield server
    assert server.stop() == 0, server.output


def fuzz_operation(server, strategy, label: str, statuses: dict[str, Counter]) -> None:
    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def fuzz(case):
        response = case.call(base_url=server.http, headers=AUTH, timeout=60)
        statuses.setdefault(label, Counter())[response.status_code] += 1
        where = f"{label}: {case.body!r:.300} -> {response.status_code} {response.text[:300]}"
        assert response.status_code < 500, where
        if response.status_code >= 400:
            body = response.json()
            if case.path.startswith("/v1/messages"):  # Anthropic's shape
                assert body["type"] == "error" and body["error"]["message"] and body["error"]["type"], where
            else:
                assert body["error"]["message"] and body["error"]["code"] == response.status_code, where

    fuzz()


def test_no_route_fails_on_any_input(server):
    """And valid bodies get through: on each generation route at least a sixth of the schema-valid ones are
    answered (200), not refused (the others: combinations the schema cannot express, such as best_of with n)."""
    document = httpx.get(f"{server.http}/openapi.json").json()
    schema = schemathesis.openapi.from_dict(document)
    statuses: dict[str, Counter] = {}  # label -> responses by status
    for result in schema.get_all_operations():
        operation = result.ok()
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if operation.method == "post" else [])
        for mode in modes:  # (a GET without parameters has no invalid form)
            fuzz_operation(server, operation.as_strategy(generation_mode=mode), f"{operation.label} ({mode.value})",
                           statuses)
    print(f"{sum(sum(c.values()) for c in statuses.values())} cases; responses by status:")
    for label, counts in statuses.items():
        print(f"  {label}: {dict(sorted(counts.items()))}")
    operations = [method for methods in document["paths"].values() for method in methods if method != "parameters"]
    assert len(statuses) == len(operations) + operations.count("post")
    for route in ("/v1/completions", "/v1/chat/completions"):
        valid = statuses[f"POST {route} (positive)"]
        assert valid[200] >= valid.total() / 6, (route, valid)
    assert httpx.get(f"{server.http}/health").status_code == 200
    assert httpx.post(f"{server.http}/v1/completions", headers=AUTH,
                      json={"prompt": "Hi", "max_tokens": 4}).status_code == 200


@pytest.mark.parametrize("route, body", [
    ("completions", {"prompt": "Hi", "prompt_logprobs": 21}),
    ("completions", {"prompt": "Hi", "prompt_logprobs": 1, "stream": True}),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 2, "stream": True}),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                          "response_format": {"type": "json_schema"}}),
])
def test_the_document_refuses_what_the_server_refuses(server, route, body):
    """Bodies the server refuses for what its fields need of each other are invalid by /openapi.json too, so that
    a client (or this file's fuzzing) generating from the document does not send them; the same bodies made valid
    are valid by both."""
    import jsonschema

    document = httpx.get(f"{server.http}/openapi.json").json()
    name = "ChatCompletionRequest" if route.startswith("chat") else "CompletionRequest"
    validator = jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", **document})
    assert not validator.is_valid(body)
    assert httpx.post(f"{server.http}/v1/{route}", headers=AUTH, json=body).status_code == 400
    fixed = {**body, "prompt_logprobs": 1, "stream": False} if "prompt_logprobs" in body else {
        **body, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}}
    assert validator.is_valid(fixed), list(validator.iter_errors(fixed))
    assert httpx.post(f"{server.http}/v1/{route}", headers=AUTH, json={**fixed, "max_tokens": 2}).status_code == 200
