"""Embeddings ([model] pooling; /v1/embeddings) and vLLM's /tokenize and /detokenize, on a tiny random Llama made
here (fp32): every vector against transformers' final hidden states pooled the same way, through the offline
LLM (prompts in many chunks, preempted and recomputed) and through a real server with the openai client."""

from __future__ import annotations

import base64
import json
import math
from array import array

import httpx
import openai
import pytest

from conveyor.entrypoints.llm import LLM
from conveyor.sampling import SamplingParams
from tests.factories import assert_no_leak
from tests.server import Server, http_config

WORDS = ["<unk>", "<s>", "</s>", "sun", "rain", "snow", "wind", "cloud", "fog", "hail", "storm", "sky", "sea", "hill"]
SENTENCES = ["sun", "rain snow wind", " ".join(WORDS[3:] * 3), " ".join(reversed(WORDS[3:] * 4))]


MODEL = "tiny_llama"


def save_tiny_llama(path) -> None:
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>",
                                                            "add_bos_token": False}))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, eos_token_id=2, bos_token_id=1)
    transformers.LlamaForCausalLM(config).save_pretrained(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / MODEL
    path.mkdir()
    save_tiny_llama(path)
    return path


def hf_pooled(path, ids: list[int], pooling: str) -> list[float]:
    """transformers' final hidden states (after the last norm) of ``ids``, pooled."""
    import torch
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    return (states[-1] if pooling == "last" else states.mean(0)).tolist()


def unit(values: list[float]) -> list[float]:
    norm = math.sqrt(sum(v * v for v in values))
    return [v / norm for v in values]


def assert_close(got: list[float], want: list[float], tol: float = 1e-5) -> None:
    assert len(got) == len(want)
    worst = max(abs(a - b) for a, b in zip(got, want))
    assert worst <= tol, f"largest difference {worst:.2e}"


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_offline_embeddings_equal_transformers_pooled_states(tiny, pooling):
    """Prompts in chunks of 8 tokens over a cache so small that requests are preempted and recomputed (a mean
    pooled from its first chunk again), beside requests that generate."""
    overrides = {"model.path": str(tiny), "model.dtype": "float32", "model.max_model_len": 128,
                 "kvcache.block_size": 4, "kvcache.num_blocks": 24, "scheduler.max_num_batched_tokens": 8}
    with LLM(overrides=overrides) as llm:
        prompts = [llm.encode(s) for s in SENTENCES]
        embedding = SamplingParams(max_tokens=1, pooling=pooling)
        generating = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        results = llm.generate(SENTENCES[2:] + SENTENCES * 2, [generating] * 2 + [embedding] * 2 * len(SENTENCES))
        assert llm.engine.scheduler.stats().num_preemptions > 0
        unit_vectors = llm.embed(SENTENCES, pooling=pooling)
        assert_no_leak(llm.engine.kvcache)
    generated, vectors = results[:2], [r.embedding for r in results[2:]]
    assert all(len(c.token_ids) == 20 and c.embedding is None for c in generated)
    assert all(not r.token_ids for r in results[2:])
    for i, ids in enumerate(prompts * 2):
        want = hf_pooled(tiny, ids, pooling)
        assert_close(vectors[i], want)
        if i < len(prompts):
            assert_close(unit_vectors[i], unit(want))


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    config = f"""
[model]
path = "{tiny}"
dtype = "float32"
max_model_len = 64
pooling = "last"

""" + http_config(status_interval=0.0)
    server = Server(config, tmp_path_factory.mktemp("embeddings")).start()
    assert httpx.get(f"{server.http}/v1/models").json()["data"][0]["id"] == MODEL
    yield server
    assert server.stop() == 0, server.output


def test_served_embeddings_with_the_openai_client(server, tiny):
    from tokenizers import Tokenizer

    ids = [Tokenizer.from_file(str(tiny / "tokenizer.json")).encode(s).ids for s in SENTENCES]
    client = openai.OpenAI(base_url=f"{server.http}/v1", api_key="none")
    result = client.embeddings.create(model=MODEL, input=SENTENCES)
    assert [d.index for d in result.data] == list(range(len(SENTENCES)))
    assert result.usage.prompt_tokens == result.usage.total_tokens == sum(map(len, ids))
    for d, prompt in zip(result.data, ids):
        assert_close(d.embedding, unit(hf_pooled(tiny, prompt, "last")))
    # token ids give the same vectors; base64 holds the same float32s (the client decodes it)
    by_ids = client.embeddings.create(model=MODEL, input=ids[1:3])
    for d, prompt in zip(by_ids.data, ids[1:3]):
        assert_close(d.embedding, unit(hf_pooled(tiny, prompt, "last")))
    raw = httpx.post(f"{server.http}/v1/embeddings", json={"input": ids[1], "encoding_format": "base64"}).json()
    packed = array("f", base64.b64decode(raw["data"][0]["embedding"]))
    assert packed.tolist() == pytest.approx(result.data[1].embedding, abs=1e-7)
    plain = httpx.post(f"{server.http}/v1/embeddings", json={"input": SENTENCES[1], "normalize": False}).json()
    assert_close(plain["data"][0]["embedding"], hf_pooled(tiny, ids[1], "last"))


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": [""]}, "input"),
    ({"input": [[3, 4], [3, 99]]}, "input[1]"),
    ({"input": ["sun", [3, 4]]}, "input"),
    ({"input": "sun " * 80}, "input"),
    ({"input": "sun", "dimensions": 3}, "dimensions"),
    ({"input": "sun", "model": "another"}, "model"),
])
def test_embedding_refusals_name_the_field(server, body, param):
    response = httpx.post(f"{server.http}/v1/embeddings", json=body)
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    # the server goes on serving
    ok = httpx.post(f"{server.http}/v1/embeddings", json={"input": "sun"})
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 32


def test_an_input_may_fill_the_context(server, tiny):
    """An embedding generates nothing, so its input may be max_model_len tokens long (as vLLM takes it; inputs
    are often cut to exactly the context), where a completion's prompt must leave room for a token."""
    ids = (list(range(3, len(WORDS))) * 8)[:64]
    full = httpx.post(f"{server.http}/v1/embeddings", json={"input": ids, "normalize": False})
    assert full.status_code == 200, full.text
    assert full.json()["usage"]["prompt_tokens"] == 64
    assert_close(full.json()["data"][0]["embedding"], hf_pooled(tiny, ids, "last"))
    over = httpx.post(f"{server.http}/v1/embeddings", json={"input": [ids[:10], ids + [3]]})
    assert over.status_code == 400 and over.json()["error"]["param"] == "input[1]", over.text
    assert "65 tokens" in over.json()["error"]["message"]
    completion = httpx.post(f"{server.http}/v1/completions", json={"prompt": ids, "max_tokens": 1})
    assert completion.status_code == 400 and "no room for output" in completion.json()["error"]["message"]


def test_embeddings_and_generation_together_leave_the_cache_empty(server):
    client = openai.AsyncOpenAI(base_url=f"{server.http}/v1", api_key="none")

    async def both():
        import anyio
        results = {}

        async def embed():
            results["embed"] = await client.embeddings.create(model=MODEL, input=SENTENCES * 4)

        async def complete():
            results["text"] = await client.completions.create(model=MODEL, prompt=SENTENCES[2],
                                                              max_tokens=12, temperature=0,
                                                              extra_body={"ignore_eos": True})

        async with anyio.create_task_group() as group:
            group.start_soon(embed)
            group.start_soon(complete)
        return results

    import anyio
    results = anyio.run(both)
    assert len(results["embed"].data) == 4 * len(SENTENCES)
    assert results["text"].usage.completion_tokens == 12
    metrics = httpx.get(f"{server.http}/metrics").text
    usage = [line for line in metrics.splitlines() if line.startswith("conveyor_kv_cache_usage_ratio")]
    assert usage and all(float(line.split()[-1]) == 0 for line in usage), usage


def test_tokenize_and_detokenize(server, tiny):
    from tokenizers import Tokenizer

    oracle = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    text = SENTENCES[2]
    answer = httpx.post(f"{server.http}/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert answer["tokens"] == oracle.encode(text).ids
    assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == 64
    assert answer["token_strs"] == [oracle.id_to_token(t) for t in answer["tokens"]]
    back = httpx.post(f"{server.http}/detokenize", json={"tokens": answer["tokens"]}).json()
    assert back["prompt"] == oracle.decode(answer["tokens"], skip_special_tokens=False)
    bad = httpx.post(f"{server.http}/detokenize", json={"tokens": [3, 999]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(f"{server.http}/tokenize", json={"prompt": "sun", "messages": [{"role": "user", "content": "x"}]})
    assert both.status_code == 400 and "exactly one" in both.json()["error"]["message"]
