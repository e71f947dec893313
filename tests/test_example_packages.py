"""The example plugin packages for the kinds beside the scheduler (examples/conveyor-int4, a quantization method;
examples/conveyor-stack-kv, a KV cache layout; examples/conveyor-jsonl, a transport): pip-installed, found through
their entry points, and serving the real SmolLM2 together, under fp8 KV storage and preemption, the transport's
replies against the OpenAI API of the same server; the int4 matmul against its own float weights."""

from __future__ import annotations

import importlib
import json
import socket
import subprocess
import sys

import httpx
import openai
import pytest

from conveyor.registry import PluginRegistry
from tests.conftest import REPO
from tests.server import Server

PACKAGES = ("conveyor-int4", "conveyor-stack-kv", "conveyor-jsonl")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """Both packages pip-installed into a private directory (not into the venv)."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), *(str(REPO / "examples" / p) for p in PACKAGES)],
        check=True, capture_output=True, timeout=300,
    )
    return target


def test_entry_points_register_both(installed, monkeypatch):
    monkeypatch.syspath_prepend(str(installed))
    importlib.invalidate_caches()
    registry = PluginRegistry()
    assert registry.get("quant", "int4_groups").__module__ == "conveyor_int4"
    assert registry.get("kvcache", "stack").__module__ == "conveyor_stack_kv"
    assert registry.get("transport", "jsonl").__module__ == "conveyor_jsonl"
    assert registry.origins["quant", "int4_groups"] == "conveyor-int4 0.1.0"


def test_int4_weights_round_to_their_group_scale(installed, monkeypatch):
    """Every weight within half a step of its group's scale; the matmul is the dequantized weight's, bias
    kept; a row-parallel share equals the whole weight's columns."""
    import torch

    monkeypatch.syspath_prepend(str(installed))
    importlib.invalidate_caches()
    cls = PluginRegistry().get("quant", "int4_groups")
    method = cls(cls.Options(group_size=16), torch.float32, torch.device("cpu"))
    torch.manual_seed(0)
    weight, bias = torch.randn(24, 64), torch.randn(24)
    params = method.prepare(weight, bias)
    assert params["packed"].dtype == torch.uint8 and params["packed"].shape == (24, 32)
    step = weight.reshape(24, 4, 16).abs().amax(dim=2, keepdim=True) / 7
    error = (method.dequantize(params).reshape(24, 4, 16) - weight.reshape(24, 4, 16)).abs()
    assert bool((error <= step / 2 + 1e-6).all())
    x = torch.randn(5, 64)
    torch.testing.assert_close(method.linear(x, params), x @ method.dequantize(params).T + bias)
    share = method.prepare_input_shard(weight, slice(32, 64))
    torch.testing.assert_close(method.dequantize(share), method.dequantize(params)[:, 32:])
    with pytest.raises(ValueError, match="group_size = 16 does not divide"):
        method.prepare(torch.randn(4, 40))


@pytest.mark.slow
def test_both_serve_smollm2_with_fp8_kv_and_preemption(installed, tmp_path):
    config = """
[quant]
plugin = "int4_groups"

[kvcache]
plugin = "stack"
block_size = 16
num_blocks = 16
dtype = "fp8"

[server]
status_interval = 0.0

[[transport]]
plugin = "http"
port = 0

[[transport]]
plugin = "jsonl"
port = 0
"""
    server = Server(config, tmp_path, env={"PYTHONPATH": str(installed)}).start()
    try:
        client = openai.OpenAI(base_url=f"{server.http}/v1", api_key="none")

        def ask(topic: str):
            return client.chat.completions.create(
                model="smollm2-135m-instruct", messages=[{"role": "user", "content": f"Describe {topic}."}],
                max_tokens=24, temperature=0, extra_body={"ignore_eos": True})

        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(ask, ["rain", "the sea", "a forest", "bread", "the moon", "winter", "a city",
                                          "a river"]))
        assert all(r.usage.completion_tokens == 24 and r.choices[0].message.content for r in replies)
        assert server.metric("conveyor_preemptions_total") > 0
        assert server.metric("conveyor_kv_cache_usage_ratio") == 0
        # SmolLM2's linear weights (30 layers of q, k, v, o, gate, up, down) as int4 with a bf16 scale per 32
        linears = 30 * (576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536)
        assert server.metric("conveyor_weight_bytes", format="int4_groups") == linears // 2 + linears // 32 * 2
        assert "KV cache (stack): 16 blocks x 16 tokens" in server.output
        assert "(quant int4_groups: int4_groups 59.7 MB" in server.output
        # the transport: the same greedy text as the OpenAI API, then a refusal as a line, on one connection
        completion = client.completions.create(model="smollm2-135m-instruct", prompt="The capital of France is",
                                               max_tokens=12, temperature=0)
        host, port = server.url("jsonl").removeprefix("jsonl://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=120) as connection:
            lines = connection.makefile("rw")
            lines.write(json.dumps({"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}) + "\n")
            lines.write(json.dumps({"prompt": "hi", "max_tokens": 10**6}) + "\n")
            lines.flush()
            replies = []
            while not replies or "finish_reason" not in replies[-1]:
                replies.append(json.loads(lines.readline()))
            refusal = json.loads(lines.readline())
        assert "".join(r["text"] for r in replies) == completion.choices[0].text
        assert replies[-1]["usage"]["completion_tokens"] == completion.usage.completion_tokens
        assert refusal["status"] == 400 and "max_model_len" in refusal["error"]
        health = httpx.get(f"{server.http}/health")
        assert health.status_code == 200
    finally:
        assert server.stop() == 0, server.output
