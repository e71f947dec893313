"""Each quantization config serves end to end through `conveyor serve`, and its greedy answer is the one
the same config gives offline."""

from __future__ import annotations

import httpx
import pytest

from conveyor import LLM, SamplingParams
from tests.conftest import REPO
from tests.server import Server

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.mark.parametrize("name", ["int8", "fp8", "fp8-kv"])
def test_quantized_config_serves(name, tmp_path):
    config = REPO / "configs" / f"{name}.toml"
    offline = LLM(config).generate(QUESTION, SamplingParams(max_tokens=12, temperature=0))[0]
    server = Server(config.read_text(), tmp_path, overrides=["transport.0.port=0", "server.status_interval=0"])
    server.start()
    try:
        reply = httpx.post(f"{server.http}/v1/chat/completions", timeout=120,
                           json={"messages": QUESTION, "max_tokens": 12, "temperature": 0}).json()
    finally:
        assert server.stop() == 0
    assert reply["choices"][0]["message"]["content"] == offline.text
    assert reply["usage"]["completion_tokens"] == len(offline.token_ids)
