"""Each quantization config serves end to end through `conveyor serve`: the server says it stores the weights
(or the KV cache) in the smaller format, and its greedy answer is the one the same config gives offline."""

from __future__ import annotations

import re

import httpx
import pytest

from conveyor import LLM, SamplingParams
from tests.conftest import REPO
from tests.server import Server

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def default_sizes() -> tuple[float, int]:
    """Weight MB and KV blocks of the default (bf16) config."""
    engine = LLM(REPO / "configs" / "default.toml").engine
    return engine.info.weight_bytes / 1e6, engine.kvcache.num_blocks


@pytest.mark.parametrize("name", ["int8", "fp8", "fp8-kv"])
def test_quantized_config_serves(name, tmp_path, default_sizes):
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
    # what the format saves, as the server reports it at start-up, against the default bf16 config
    weights_mb = float(re.search(r"Weights: ([\d.]+) MB", server.output).group(1))
    blocks = int(re.search(r"KV cache \(paged\): (\d+) blocks", server.output).group(1))
    bf16_weights_mb, bf16_blocks = default_sizes
    if name == "fp8-kv":
        assert blocks >= 1.9 * bf16_blocks and weights_mb == pytest.approx(bf16_weights_mb, abs=0.1)
    else:
        assert weights_mb < 0.7 * bf16_weights_mb and blocks == bf16_blocks
