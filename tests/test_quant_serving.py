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
def default_sizes() -> dict[str, tuple[float, int]]:
    """Weight MB and KV blocks of the default config (the GGUF's blocks kept packed) and of the bf16 one."""
    sizes = {}
    for name in ("default", "bf16"):
        engine = LLM(REPO / "configs" / f"{name}.toml").engine
        sizes[name] = engine.info.weight_bytes / 1e6, engine.kvcache.num_blocks
    return sizes


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
    # what the format saves, as the server reports it at start-up: the fp8 cache against the default config (the
    # one change it makes), int8 and fp8 weights against the weights expanded to bf16
    weights_mb = float(re.search(r"Weights: ([\d.]+) MB", server.output).group(1))
    blocks = int(re.search(r"KV cache \(paged\): (\d+) blocks", server.output).group(1))
    if name == "fp8-kv":
        default_weights_mb, default_blocks = default_sizes["default"]
        assert blocks >= 1.9 * default_blocks and weights_mb == pytest.approx(default_weights_mb, abs=0.1)
    else:
        bf16_weights_mb, bf16_blocks = default_sizes["bf16"]
        assert weights_mb < 0.7 * bf16_weights_mb and blocks == bf16_blocks
