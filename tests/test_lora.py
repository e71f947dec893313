"""LoRA adapters made here with PEFT on a tiny random Llama, against PEFT's own merged models (transformers):
logits for two adapters and the base in one batch, greedy tokens through the engine with more adapters than
slots, the batched Triton kernel against its reference, and adapters over HTTP and ZMQ: chosen by name, listed
with their parent, loaded and unloaded at runtime, waited for, and refused as a pickle."""

from __future__ import annotations

import copy
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from conveyor import native
from conveyor.entrypoints.llm import LLM
from conveyor.model.decoder_model import DecoderModel
from conveyor.model.lora import Adapters
from conveyor.model.lora_config import read_adapter_config
from conveyor.model.lora_kernels import lora_add, lora_reference
from conveyor.sampling import SamplingParams
from tests.conftest import hf_greedy
from tests.helpers import cpu_model, dense_attention
from tests.server import Server
from tests.test_families import SEQUENCES, TINY

# name -> PEFT LoraConfig: different modules, ranks and scalings (rsLoRA)
ADAPTERS = {
    "a1": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]},
    "a2": {"r": 8, "lora_alpha": 4, "use_rslora": True, "target_modules": "all-linear"},
    "a3": {"r": 2, "lora_alpha": 16, "target_modules": ["k_proj", "gate_proj", "up_proj"]},
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
    """The base model's directory, its transformers model, and per adapter: its directory and PEFT's merge."""
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    # (SmolLM2's whole vocabulary and room for its chat template's system prompt: text and chat prompts fit)
    config = transformers.LlamaConfig(**{**TINY, "vocab_size": tokenizer.vocab_size, "max_position_embeddings": 512}, initializer_range=0.1)
    base = transformers.LlamaForCausalLM(config).eval()
    root = tmp_path_factory.mktemp("lora")
    base.save_pretrained(root / "base")
    tokenizer.hf.save(str(root / "base" / "tokenizer.json"))
    (root / "base" / "chat_template.jinja").write_text(tokenizer.chat_template)
    adapters = {}
    for seed, (name, config) in enumerate(ADAPTERS.items(), start=1):
        torch.manual_seed(seed)
        model = get_peft_model(copy.deepcopy(base), LoraConfig(**config))
        with torch.no_grad():  # PEFT starts B at zero (no change); give every adapter a clear effect
            for param_name, param in model.named_parameters():
                if "lora_" in param_name:
                    param.normal_(0, 0.3)
        model.save_pretrained(root / name)
        adapters[name] = (root / name, model.merge_and_unload().eval())
    return root / "base", base, adapters


def test_peft_wrote_what_conveyor_reads(tiny):
    _, _, adapters = tiny
    config = read_adapter_config(adapters["a2"][0], max_rank=8)
    assert config.rank == 8 and config.scale == pytest.approx(4 / 8**0.5)  # rsLoRA: alpha / sqrt(r)
    assert read_adapter_config(adapters["a1"][0], max_rank=8).scale == pytest.approx(8 / 4)


def triton_device() -> str | None:
    """Where the Triton kernels can run here: on CPU tensors under the interpreter (TRITON_INTERPRET=1, which
    tests/conftest.py sets only without CUDA), else on CUDA tensors; None: neither."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    return "cuda" if torch.cuda.is_available() else None


def run_batch(model: DecoderModel, adapters: Adapters, sequences: list[list[int]], slots: list[int]) -> list[torch.Tensor]:
    adapters.prepare([(slot, len(s)) for slot, s in zip(slots, sequences)])
    ids = torch.tensor([t for s in sequences for t in s])
    positions = torch.tensor([p for s in sequences for p in range(len(s))])
    with torch.inference_mode():
        logits = model.compute_logits(model.forward(ids, positions, dense_attention([len(s) for s in sequences])))
    return list(logits.split([len(s) for s in sequences]))


@pytest.mark.parametrize(
    "path",
    ["torch-ops", pytest.param("cpu-kernels", marks=pytest.mark.skipif(not native.load(), reason="no C++ compiler")),
     "triton"],
)
def test_two_adapters_and_the_base_in_one_batch_match_the_merged_models(tiny, path):
    """fp32 logits of every position: adapter a1, the base and adapter a2 in one batch (and other mixes) equal
    transformers' forward pass of the base model and of PEFT's merged models."""
    if path == "triton" and triton_device() != "cpu":
        pytest.skip("the model runs on CPU tensors here, which Triton takes only under TRITON_INTERPRET=1 "
                    "(tests/conftest.py sets it only without CUDA)")
    base_path, base, adapters = tiny
    model = cpu_model(base_path, fused=path == "cpu-kernels")
    lora = Adapters(model, num_slots=3, max_rank=8)
    lora.kernels = path == "triton"  # (the CUDA path, here under TRITON_INTERPRET=1)
    lora.load(0, str(adapters["a1"][0]))
    lora.load(2, str(adapters["a2"][0]))
    references = {None: base, 0: adapters["a1"][1], 2: adapters["a2"][1]}
    batches = [
        [0, -1, 2],  # two adapters and the base
        [2, 2, 2],  # one adapter for the whole batch
        [-1, 0, 0],
    ]
    for slots in batches:
        ours = run_batch(model, lora, SEQUENCES, slots)
        for slot, sequence, logits in zip(slots, SEQUENCES, ours):
            with torch.inference_mode():
                expected = references[None if slot < 0 else slot](torch.tensor([sequence])).logits[0]
            torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4, msg=lambda m, slots=slots: f"slots {slots}: {m}")
    # the adapters change the logits clearly (the comparison above would notice a missing term)
    with torch.inference_mode():
        plain = base(torch.tensor([SEQUENCES[0]])).logits[0]
        for name in ("a1", "a2"):
            assert (adapters[name][1](torch.tensor([SEQUENCES[0]])).logits[0] - plain).abs().max() > 0.05


def test_adapters_that_do_not_fit_are_refused_and_leave_the_slot_empty(tiny, tmp_path):
    import transformers
    from peft import LoraConfig, get_peft_model

    base_path, base, adapters = tiny
    model = cpu_model(base_path)
    lora = Adapters(model, num_slots=1, max_rank=4)
    with pytest.raises(ValueError, match="rank 8 exceeds .* max_lora_rank = 4"):
        lora.load(0, str(adapters["a2"][0]))
    head = get_peft_model(copy.deepcopy(base), LoraConfig(r=2, target_modules=["lm_head"]))
    head.save_pretrained(tmp_path / "head", save_embedding_layers=False)
    with pytest.raises(ValueError, match="lm_head.*supported"):
        lora.load(0, str(tmp_path / "head"))
    wider = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, "hidden_size": 32}))
    get_peft_model(wider, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path / "wider")
    with pytest.raises(ValueError, match="do not fit"):
        lora.load(0, str(tmp_path / "wider"))
    (tmp_path / "dora").mkdir()
    (tmp_path / "dora" / "adapter_model.safetensors").write_bytes(b"")
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps({"r": 2, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        lora.load(0, str(tmp_path / "dora"))
    with pytest.raises(ValueError, match="no adapter_config.json"):
        lora.load(0, str(tmp_path))
    assert all(not t.a.any() and not t.b.any() for t in lora.linears)  # nothing half-written


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_triton_kernel_matches_its_reference(dtype):
    """Every token reads its own slot; -1 adds nothing; ranks, widths and inputs that are not whole tiles (on
    CUDA tensors where there is CUDA, else on CPU tensors under the interpreter)."""
    device = triton_device()
    if device is None:
        pytest.skip("no CUDA, and TRITON_INTERPRET=1 is not set")
    torch.manual_seed(0)
    tokens, k, r, n, slots = 11, 72, 24, 100, 3
    x = torch.randn(tokens, k).to(device, dtype)
    y = torch.randn(tokens, n).to(device, dtype)
    a = (torch.randn(slots, r, k) / k**0.5).to(device, dtype)
    b = (torch.randn(slots, n, r) / r**0.5).to(device, dtype)
    token_slots = torch.tensor([0, 2, -1, 1, 1, 0, -1, 2, 2, 0, 1], dtype=torch.int32, device=device)
    expected = lora_reference(x, y, a, b, token_slots)
    before = y.clone()
    lora_add(x, y, a, b, token_slots)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(y.double(), expected, rtol=tolerance, atol=tolerance)
    assert torch.equal(y[token_slots < 0], before[token_slots < 0])


def greedy(num_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)


@pytest.mark.parametrize("tp", [1, 2], ids=["one-worker", "tp2"])
def test_the_engine_serves_more_adapters_than_slots_with_prefix_caching(tiny, tp):
    """Three adapters and the base, every prompt under each, all at once on two slots (requests wait for a
    slot; adapters are evicted and loaded again), in small steps; then again, when the prefix cache holds
    every prompt's blocks under other adapters: each sequence is transformers' greedy continuation under
    its merged model. Under tensor parallelism each worker holds its share of every adapter."""
    base_path, base, adapters = tiny
    prompts = [SEQUENCES[0] + SEQUENCES[2], SEQUENCES[1], [7] * 25]
    names = [None, "a1", "a2", "a3"]
    expected = {}
    for name in names:
        model = base if name is None else adapters[name][1]
        expected[name] = [hf_greedy(model, p, 10)[0] for p in prompts]
    overrides = {"model.path": str(base_path), "model.dtype": "float32", "model.max_model_len": 128,
                 "lora.max_loras": 2, "lora.max_lora_rank": 8,
                 "lora.adapters": {"a1": str(adapters["a1"][0]), "a2": str(adapters["a2"][0])},
                 "kvcache.block_size": 4, "scheduler.max_num_batched_tokens": 24, "scheduler.max_num_seqs": 6,
                 "parallel.tensor_parallel_size": tp}
    with LLM(overrides=overrides) as llm:
        llm.add_lora("a3", adapters["a3"][0])
        for attempt in ("first", "cached"):
            jobs = [(name, i) for name in names for i in range(len(prompts))]
            results = llm.generate([prompts[i] for _, i in jobs], greedy(10), lora=[name for name, _ in jobs])
            for (name, i), result in zip(jobs, results):
                assert result.token_ids == expected[name][i], f"{attempt}: adapter {name}, prompt {i}"
        assert llm.engine.kvcache.stats().num_prefix_hit_tokens > 0  # (prompts found under their own adapter)
        with pytest.raises(ValueError, match="does not exist"):
            llm.generate([prompts[0]], greedy(2), lora="a4")
        stats = llm.engine.kvcache.stats()
        assert stats.num_free_blocks == stats.num_blocks  # no block leaked


KEY = "lora-test-key"


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    base_path, _, adapters = tiny
    config = f"""
[model]
path = "{base_path}"
name = "tiny"
dtype = "float32"
max_model_len = 512

[lora]
max_loras = 2
max_lora_rank = 8
adapters = {{ a1 = "{adapters['a1'][0]}" }}

[scheduler]
max_waiting = 2

[server]
status_interval = 1.0

[[transport]]
plugin = "http"
port = 0
api_key_env = "CONVEYOR_TEST_KEY"

[[transport]]
plugin = "zmq"
address = "tcp://127.0.0.1:*"
"""
    server = Server(config, tmp_path_factory.mktemp("lora_server"), env={"CONVEYOR_TEST_KEY": KEY}).start()
    yield server
    assert server.stop() == 0, server.output


def test_adapters_over_http(tiny, server, tokenizer):
    """By name and as BASE:NAME through the openai client, listed in /v1/models, loaded and unloaded at runtime
    with the API key; text equals transformers' greedy continuation under the merged model."""
    _, base, adapters = tiny
    prompt = SEQUENCES[0]
    client = openai.OpenAI(base_url=f"{server.http}/v1", api_key=KEY, max_retries=0, timeout=60)
    extra = {"ignore_eos": True, "skip_special_tokens": False}

    def complete(model: str) -> openai.types.Completion:
        return client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, extra_body=extra)

    def text(model) -> str:
        return tokenizer.hf.decode(hf_greedy(model, prompt, 8)[0], skip_special_tokens=False)

    first = complete("a1")
    assert first.model == "a1"
    assert first.choices[0].text == text(adapters["a1"][1])
    assert complete("tiny:a1").choices[0].text == first.choices[0].text
    assert complete("tiny").choices[0].text == text(base)
    assert [m.id for m in client.models.list().data] == ["tiny", "a1"]

    http = httpx.Client(base_url=server.http, timeout=60)
    load = {"lora_name": "a2", "lora_path": str(adapters["a2"][0])}
    assert http.post("/v1/load_lora_adapter", json=load).status_code == 401  # no key
    auth = {"Authorization": f"Bearer {KEY}"}
    bad = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(server.config_path)},
                    headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    assert http.post("/v1/load_lora_adapter", json=load, headers=auth).status_code == 200
    assert complete("a2").choices[0].text == text(adapters["a2"][1])
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"}, headers=auth).status_code == 200
    with pytest.raises(openai.NotFoundError, match="'a2' does not exist"):
        complete("a2")
    assert [m.id for m in client.models.list().data] == ["tiny", "a1"]


def test_a_server_without_an_api_key_loads_no_adapter_at_runtime(tiny):
    """The endpoints name directories on the server's machine: without a key they answer 403 and touch nothing."""
    from starlette.testclient import TestClient

    from conveyor.plugins.transport.http import HTTPOptions, HTTPTransport

    class Untouched:
        def add_adapter(self, name, path):
            raise AssertionError("a server without an API key loaded an adapter")

        remove_adapter = add_adapter

    with TestClient(HTTPTransport(HTTPOptions()).app(Untouched())) as http:
        for route, body in [("load", {"lora_name": "a1", "lora_path": str(tiny[2]["a1"][0])}),
                            ("unload", {"lora_name": "a1"})]:
            response = http.post(f"/v1/{route}_lora_adapter", json=body)
            assert response.status_code == 403 and "API key" in response.json()["error"]["message"]


AUTH = {"Authorization": f"Bearer {KEY}"}


def greedy_text(tokenizer, model, prompt: list[int], num_tokens: int) -> str:
    """transformers' greedy continuation as text, special tokens kept (as the requests here ask)."""
    return tokenizer.hf.decode(hf_greedy(model, prompt, num_tokens)[0], skip_special_tokens=False)


def test_a_pickled_adapter_is_refused_and_never_unpickled(tiny, server, tmp_path):
    """A directory with adapter_model.bin (a pickle: loading one runs what it names) and no safetensors file is
    refused with an error naming the pickle, by the workers' loader and by /v1/load_lora_adapter; nothing in
    the file runs (loading it would create a file, as the end shows)."""
    base_path, _, adapters = tiny
    marker = tmp_path / "unpickled"

    class RunsWhenUnpickled:
        def __reduce__(self):
            return open, (str(marker), "w")

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text((adapters["a1"][0] / "adapter_config.json").read_text())
    torch.save({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64),
                "payload": RunsWhenUnpickled()}, pickled / "adapter_model.bin")
    refusal = r"no adapter_model\.safetensors \(adapter_model\.bin is a pickle, which is not loaded\)"
    with pytest.raises(ValueError, match=refusal):
        read_adapter_config(pickled, max_rank=8)
    model = cpu_model(base_path)
    lora = Adapters(model, num_slots=1, max_rank=8)
    with pytest.raises(ValueError, match=refusal):
        lora.load(0, str(pickled))
    assert all(not t.a.any() and not t.b.any() for t in lora.linears)
    with httpx.Client(base_url=server.http, headers=AUTH, timeout=60) as http:
        response = http.post("/v1/load_lora_adapter", json={"lora_name": "pickled", "lora_path": str(pickled)})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "lora_path" and "adapter_model.bin is a pickle" in error["message"], error
        assert "pickled" not in [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert not marker.exists()
    torch.load(pickled / "adapter_model.bin", weights_only=False)
    assert marker.exists()


def test_models_lists_each_adapter_with_its_base_as_parent(server):
    """/v1/models: the base model first, with no parent; then each adapter, its ``parent`` the base's name; each
    also by its id."""
    with httpx.Client(base_url=server.http, headers=AUTH, timeout=60) as http:
        models = http.get("/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in models] == [("tiny", None), ("a1", "tiny")]
    # each one by its id (GET /v1/models/{id}), in the same shape
    with openai.OpenAI(base_url=f"{server.http}/v1", api_key=KEY, max_retries=0, timeout=60) as client:
        assert [client.models.retrieve(m["id"]).model_dump(exclude_none=True) for m in models] == models
        # and by BASE:NAME, as requests may name an adapter
        assert client.models.retrieve("tiny:a1").model_dump(exclude_none=True) == models[1]


def test_the_zmq_model_key_selects_an_adapter(tiny, server, tokenizer):
    """``model`` in a ZMQ generate message: NAME or BASE:NAME runs under the adapter, nil or the base's name
    runs the base model (transformers' greedy text under each); an unknown name is an error with status 404."""
    import msgspec
    import zmq

    _, base, adapters = tiny
    prompt = SEQUENCES[0]
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(server.url("tcp"))

    def generate(model: str | None) -> tuple[bytes, dict]:
        request = {"request_id": f"r-{model}", "prompt": prompt, "stream": False, "model": model,
                   "params": {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "skip_special_tokens": False}}
        socket.send_multipart([b"generate", msgspec.msgpack.encode(request)])
        assert socket.poll(60_000), f"no reply for {model}"
        kind, body = socket.recv_multipart()
        return kind, msgspec.msgpack.decode(body)

    try:
        replies = {model: generate(model) for model in ("a1", "tiny:a1", None, "tiny", "a9")}
    finally:
        socket.close()
    under_a1, plain = greedy_text(tokenizer, adapters["a1"][1], prompt, 8), greedy_text(tokenizer, base, prompt, 8)
    assert under_a1 != plain
    for model, expected in [("a1", under_a1), ("tiny:a1", under_a1), (None, plain), ("tiny", plain)]:
        kind, reply = replies[model]
        assert kind == b"chunk" and reply["text"] == expected, (model, reply)
    kind, error = replies["a9"]
    assert kind == b"error" and error["status"] == 404 and "'a9' does not exist" in error["message"], error


def test_a_request_waits_for_a_slot_and_unloading_lets_running_requests_finish(tiny, server, tokenizer):
    """Both slots in use by running streams (a1, and a2 loaded at runtime): of three requests for a third
    adapter, two wait for a slot and the one past [scheduler] max_waiting = 2 (held requests count in that queue)
    is refused with 429. a2 unloaded
    while its stream runs is gone for new requests (404); both streams still finish with transformers' text
    under their adapters (no slot in use is given away), and then the waiting requests run under their own.
    The engine is stopped while requests are sent, so they meet the running streams however fast it is."""
    _, _, adapters = tiny
    prompt, num_tokens = SEQUENCES[1], 40
    extra = {"ignore_eos": True, "skip_special_tokens": False}
    body = {"prompt": prompt, "max_tokens": num_tokens, "temperature": 0, **extra}
    client = openai.OpenAI(base_url=f"{server.http}/v1", api_key=KEY, max_retries=0, timeout=60)
    http = httpx.Client(base_url=server.http, headers=AUTH, timeout=60)
    waiting: list[httpx.Response] = []

    def post() -> None:
        waiting.append(http.post("/v1/completions", json={**body, "model": "a3"}))

    loaded, streams = [], []
    try:
        for name in ("a2", "a3"):
            load = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapters[name][0])})
            assert load.status_code == 200, load.text
            loaded.append(name)
        # a1 in a slot now, so that only a2 has to wait for one
        assert http.post("/v1/completions", json={**body, "model": "a1", "max_tokens": 1}).status_code == 200
        # (a stream opens once the engine took its request: both sent while it is stopped, then both taken)
        with ThreadPoolExecutor(2) as pool:
            with server.paused_engine():
                opening = [pool.submit(client.completions.create, model=name, prompt=prompt, max_tokens=num_tokens,
                                       temperature=0, stream=True, extra_body=extra) for name in ("a1", "a2")]
                server.wait_for(lambda: server.metric("conveyor_num_requests_in_flight") == 2, timeout=30,
                                what="both streams sent")
            streams = [future.result() for future in opening]
        texts = [next(iter(stream)).choices[0].text for stream in streams]  # both running
        threads = [threading.Thread(target=post) for _ in range(3)]
        with server.paused_engine():
            for thread in threads:
                thread.start()
            server.wait_for(lambda: server.metric("conveyor_num_requests_in_flight") == 5, timeout=30,
                            what="five requests in flight")
            unload = http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
            assert unload.status_code == 200, unload.text
            loaded.remove("a2")
            gone = http.post("/v1/completions", json={**body, "model": "a2"})
            assert gone.status_code == 404 and "'a2' does not exist" in gone.json()["error"]["message"], gone.text
        for i, stream in enumerate(streams):
            chunks = list(stream)
            texts[i] += "".join(c.choices[0].text for c in chunks)
            assert chunks[-1].choices[0].finish_reason == "length"
        for thread in threads:
            thread.join(60)
    finally:
        for stream in streams:
            stream.close()
        for name in loaded:
            http.post("/v1/unload_lora_adapter", json={"lora_name": name})
        http.close()
    assert texts == [greedy_text(tokenizer, adapters[name][1], prompt, num_tokens) for name in ("a1", "a2")]
    refused, *ran = sorted(waiting, key=lambda r: -r.status_code)
    assert refused.status_code == 429, refused.text
    assert "the waiting queue is full (max_waiting=2)" in refused.json()["error"]["message"]
    under_a3 = greedy_text(tokenizer, adapters["a3"][1], prompt, num_tokens)
    for response in ran:
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == under_a3


def test_the_serving_process_never_maps_libtorch(tiny, server):
    """``conveyor serve``'s own process (the transports and the frontend; the engine runs in a child) serves
    structured output (a schema that compiles, a regex that does not, streamed), a call forced by tool_choice, an
    adapter loaded at runtime and used, /metrics and the dashboard, and never maps libtorch: /proc/PID/maps names
    no libtorch file, where the engine's does."""
    _, _, adapters = tiny
    client = openai.OpenAI(base_url=f"{server.http}/v1", api_key=KEY, max_retries=0, timeout=120)
    http = httpx.Client(base_url=server.http, headers=AUTH, timeout=120)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                           response_format={"type": "json_schema",
                                                            "json_schema": {"name": "n", "schema": schema}})
    assert reply.choices[0].message.content.startswith("{"), reply
    with pytest.raises(openai.BadRequestError, match="the regex cannot be compiled"):
        list(client.completions.create(model="tiny", prompt="Hi", max_tokens=4, stream=True,
                                       extra_body={"guided_regex": "([a-z]"}))
    tool = {"type": "function", "function": {"name": "add", "parameters": schema}}
    call = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Add"}], tools=[tool],
                                          tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=8)
    assert call.choices[0].finish_reason in ("tool_calls", "length"), call
    load = http.post("/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": str(adapters["a3"][0])})
    assert load.status_code == 200, load.text
    try:
        assert client.completions.create(model="a3", prompt="Hi", max_tokens=2).model == "a3"
    finally:
        http.post("/v1/unload_lora_adapter", json={"lora_name": "a3"})
    for path in ("/metrics", "/dashboard", "/dashboard/data", "/v1/models", "/health"):
        assert http.get(path).status_code == 200, path

    def libtorch(pid: int) -> list[str]:
        with open(f"/proc/{pid}/maps") as maps:
            return sorted({line.split()[-1] for line in maps if "libtorch" in line})

    assert libtorch(server.engine_pid), "the engine maps libtorch: this check would see it"
    assert libtorch(server.process.pid) == []
