"""Each quantization config serves end to end through `conveyor serve`: the server says it stores the weights
(or the KV cache) in the smaller format, at the sizes the model's tensors give, and its greedy answer is the
float model's: transformers on the same weights, teacher-forced on the server's tokens."""

from __future__ import annotations

import re

import httpx
import pytest
import torch

from conveyor.plugins.quant.int8 import q8_0_kernel
from tests.conftest import REPO
from tests.server import Server

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]
# how far each config's answer may stray from the float model's, in nats: (the transformers logprob of a
# token the server chose below transformers' best, |the server's logprob - transformers'| of that token).
# On this answer bfloat16 alone moves a logprob by about 0.1; int8 and the fp8 cache by under 0.2; fp8 weights
# and activations (E4M3, three mantissa bits) by up to 0.75, and once pick a token 0.34 below the best.
TOLERANCES = {"int8": (0.25, 0.4), "fp8": (0.7, 1.5), "fp8-kv": (0.25, 0.4)}


@pytest.fixture(scope="module")
def tensors(smollm2_path) -> dict[str, int]:
    """The GGUF file's sizes: its tensors' bytes, and the elements of the linear layers, of the embedding
    (tied: it is the head too) and of the norms."""
    import gguf

    sizes = {"file_bytes": 0, "linear": 0, "embedding": 0, "norms": 0}
    for tensor in gguf.GGUFReader(str(smollm2_path)).tensors:
        kind = "embedding" if tensor.name == "token_embd.weight" else "norms" if tensor.name.endswith(
            "norm.weight") else "linear"
        sizes[kind] += int(tensor.n_elements)
        sizes["file_bytes"] += int(tensor.n_bytes)
    return sizes


def answer_against_transformers(content: list[dict], prompt_ids: list[int], hf_model, tokenizer
                                ) -> tuple[float, float]:
    """Feeds the server's tokens to transformers one by one (each must be in transformers' top 5 there); returns
    the largest gap between transformers' best logprob and the server's token's, and the largest difference
    between the server's logprob of a token and transformers'."""
    ids, worst_gap, worst_drift = list(prompt_ids), 0.0, 0.0
    for i, chosen in enumerate(content):
        with torch.inference_mode():
            logprobs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, -1].double(), dim=-1)
        top5 = logprobs.topk(5).indices.tolist()
        matches = [t for t in top5 if tokenizer.token_bytes(t) == bytes(chosen["bytes"])]
        assert matches, f"token {i} {chosen['token']!r} is not in transformers' top 5: " + ", ".join(
            repr(tokenizer.token_text(t)) for t in top5)
        token = matches[0]
        worst_gap = max(worst_gap, float(logprobs.max() - logprobs[token]))
        worst_drift = max(worst_drift, abs(chosen["logprob"] - float(logprobs[token])))
        ids.append(token)
    return worst_gap, worst_drift


@pytest.mark.parametrize("name", ["int8", "fp8", "fp8-kv"])
def test_quantized_config_serves(name, tmp_path, tensors, hf_model, tokenizer):
    config = REPO / "configs" / f"{name}.toml"
    server = Server(config.read_text(), tmp_path, overrides=["transport.0.port=0", "server.status_interval=0"])
    server.start()
    try:
        reply = httpx.post(f"{server.http}/v1/chat/completions", timeout=120, json={
            "messages": QUESTION, "max_tokens": 12, "temperature": 0, "logprobs": True, "top_logprobs": 5}).json()
    finally:
        assert server.stop() == 0
    content = reply["choices"][0]["logprobs"]["content"]
    assert reply["usage"]["completion_tokens"] == len(content) == 12
    assert reply["choices"][0]["message"]["content"] == "".join(c["token"] for c in content)
    gap, drift = answer_against_transformers(content, tokenizer.encode_chat(QUESTION), hf_model, tokenizer)
    print(f"{name}: {reply['choices'][0]['message']['content']!r}; below transformers' best by up to {gap:.3f}, "
          f"logprobs off by up to {drift:.3f}")
    max_gap, max_drift = TOLERANCES[name]
    assert gap <= max_gap and drift <= max_drift, (gap, drift)
    # what the format saves, as the server reports it at start-up, against the file's tensors: the fp8 cache
    # keeps the default weights (the GGUF's blocks, packed); int8 and fp8 keep a byte per linear weight (and a
    # scale per output channel), the tied embedding in bfloat16
    weights_mb = float(re.search(r"Weights: ([\d.]+) MB", server.output).group(1))
    kv = re.search(r"KV cache \(paged, (\w+)\): (\d+) blocks x (\d+) tokens.* \((\d+) B/token", server.output)
    dtype, blocks, block_size, bytes_per_token = kv.group(1), *map(int, kv.groups()[1:])
    if name == "fp8-kv":
        assert weights_mb == pytest.approx(tensors["file_bytes"] / 1e6, rel=0.01)
        # K and V of 30 layers x 3 KV heads x 64 values, a byte each (and a small scale per head)
        assert dtype == "fp8" and 2 * 30 * 3 * 64 < bytes_per_token <= 2 * 30 * 3 * (64 + 4)
    else:
        # (int8 on a CPU where the C++ kernel has its VNNI path: Q8_0 blocks, a float16 scale per 32 values)
        per_weight = 34 / 32 if name == "int8" and "on cpu" in server.output and q8_0_kernel() else 1
        expected = tensors["linear"] * per_weight + 2 * (tensors["embedding"] + tensors["norms"])
        assert weights_mb == pytest.approx(expected / 1e6, rel=0.02)  # (bf16: 2 bytes for every element)
        assert dtype == "bfloat16" and bytes_per_token == 2 * 30 * 3 * 64 * 2
    if "on cpu" in server.output:  # (a GPU's cache takes a share of the memory free at start-up instead)
        # the configured 1 GiB, to within two blocks: an fp8 cache holds about twice the tokens of a bf16 one
        assert abs(blocks * block_size * bytes_per_token - 2**30) <= 2 * block_size * bytes_per_token
