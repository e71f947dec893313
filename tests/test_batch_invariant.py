"""Batch-invariant mode (``[engine] batch_invariant``): a request's tokens, logprobs and prompt logprobs are
bit-identical when it runs alone and when it runs among 64 mixed requests (prompts in chunks, requests preempted),
greedy and sampled with a seed, on every attention backend; the mode still computes the model (transformers' tokens);
and what it cannot run with is a config error."""

from __future__ import annotations

import random

import pytest
import torch

from conveyor import LLM
from conveyor.sampling import SamplingParams
from tests.conftest import CHAT_PROMPTS
from tests.helpers import assert_matches_reference

# what users ask a small chat model; none is one of the fidelity prompts
PROMPTS = [
    "How do I boil an egg so the yolk stays soft?",
    "Suggest a name for a grey kitten.",
    "What is the difference between weather and climate?",
    "Write two lines of a poem about autumn leaves.",
    "Why do we have leap years?",
    "Give me three ideas for a rainy afternoon.",
    "What does a lighthouse do?",
    "Explain what a verb is to a child.",
    "How many legs does a spider have?",
    "Summarize the story of Cinderella in one sentence.",
    "What is the boiling point of water in Fahrenheit?",
    "Recommend a healthy breakfast.",
    "What is a prime number?",
    "Describe the colour blue without using the word blue.",
    "Why is exercise good for the heart?",
    "Name a famous painting and its painter.",
    "What should I pack for a day at the beach?",
    "How does a bicycle stay upright?",
    "Tell me a fun fact about octopuses.",
    "What is the opposite of generous?",
]


def workload(prompts: list, num_tokens: int, total: int, filler: list, seed: int = 0):
    """Each prompt greedy and sampled with a seed of its own (logprobs; the sampled ones prompt logprobs too),
    then fillers up to ``total`` requests: sampled without a seed, of varied lengths, some with a stop string."""
    rng = random.Random(seed)
    requests = []
    for i, prompt in enumerate(prompts):
        requests.append((prompt, SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True, logprobs=3)))
        requests.append((prompt, SamplingParams(max_tokens=num_tokens, temperature=0.8, top_p=0.95, seed=100 + i,
                                                ignore_eos=True, logprobs=3, prompt_logprobs=2)))
    while len(requests) < total:
        extra = rng.choice(filler)
        requests.append((extra, SamplingParams(max_tokens=rng.randint(2, 3 * num_tokens), temperature=0.7,
                                               stop=rng.choice([[], ["."]]), ignore_eos=rng.random() < 0.5)))
    return requests


def alone_and_mixed(overrides: dict, requests: list, num_watched: int):
    """The first ``num_watched`` requests one at a time, then all of them at once, in one engine; also returns the
    scheduler's counters after, whether every KV block was free again, and the longest prompt."""
    with LLM(overrides={"engine.batch_invariant": True, **overrides}) as llm:
        alone = [llm.generate([prompt], params)[0] for prompt, params in requests[:num_watched]]
        mixed = llm.generate([prompt for prompt, _ in requests], [params for _, params in requests])
        kv = llm.engine.kvcache
        longest = max(len(c.prompt_token_ids) for c in mixed)
        return alone, mixed[:num_watched], llm.engine.scheduler.counters, kv.num_free_blocks == kv.num_blocks, longest


def assert_identical(alone: list, mixed: list) -> None:
    for i, (a, m) in enumerate(zip(alone, mixed)):
        label = f"request {i}"
        assert a.token_ids == m.token_ids, label
        assert len(a.logprobs) == len(a.token_ids), label
        for x, y in zip(a.logprobs, m.logprobs):  # (bit for bit: the floats compare equal)
            assert (x.logprob, x.top_ids, x.top_logprobs) == (y.logprob, y.top_ids, y.top_logprobs), label
        assert (a.prompt_logprobs is None) == (m.prompt_logprobs is None), label
        for x, y in zip(a.prompt_logprobs or [], m.prompt_logprobs or []):
            assert (x.logprob, x.top_ids, x.top_logprobs) == (y.logprob, y.top_ids, y.top_logprobs), label


def test_smollm2_requests_are_bit_identical_alone_and_among_64():
    """The default model with the default config on the default backend (the C++ kernels here): 12 prompts, greedy
    and sampled with a seed, alone and among 64 requests, in steps of at most 64 tokens (prompts in chunks) and a
    KV cache too small for all (preemption). (The packed GGUF kernels compute each row alike whatever shares its
    step, with or without the mode: the mode's fixed matmul blocks are what the float32 tests below need.)"""
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    long_chats = [[{"role": "user", "content": " ".join(CHAT_PROMPTS[: 3 + i])}] for i in range(5)]
    watched = chats[:12]  # (the other prompts are among the fillers)
    requests = workload(watched, 8, 64, chats + long_chats)
    overrides = {"scheduler.max_num_batched_tokens": 64, "kvcache.num_blocks": 32}
    alone, mixed, counters, all_free, longest = alone_and_mixed(overrides, requests, 2 * len(watched))
    assert counters.num_preemptions > 0 and all_free
    assert longest > 64  # (prompts share each step's budget, and this one cannot fit one step)
    assert_identical(alone, mixed)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, tokenizer):
    """A tiny random Llama (two query heads to one KV head), which the Triton interpreter runs in seconds."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    path = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.hf.save(str(path / "tokenizer.json"))  # (token ids go in and come out)
    return path


def backend_run(tiny_llama, attention: str, invariant: bool) -> tuple[list, list]:
    """4 prompts greedy and sampled, alone and among 14 requests, prompts in chunks of at most 16 tokens,
    preemption, in float32."""
    rng = random.Random(1)
    prompts = [[rng.randrange(128) for _ in range(rng.randint(3, 30))] for _ in range(8)]
    requests = workload(prompts[:4], 6, 14, prompts)
    overrides = {"model.path": str(tiny_llama), "model.dtype": "float32", "model.max_model_len": 128,
                 "engine.attention": attention, "engine.batch_invariant": invariant,
                 "scheduler.max_num_batched_tokens": 16, "kvcache.num_blocks": 8}
    alone, mixed, counters, all_free, longest = alone_and_mixed(overrides, requests, 8)
    assert counters.num_preemptions > 0 and all_free and longest > 16
    return alone, mixed


@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_every_attention_backend_is_batch_invariant(attention, tiny_llama):
    """The other backends on a tiny random Llama (Triton in the interpreter here). In float32, where MKL's GEMM
    gives a row different last bits in matmuls of different heights: without the mode, the same comparison
    finds differences (the next test, on the torch backend)."""
    assert_identical(*backend_run(tiny_llama, attention, invariant=True))


def matmul_rows_depend_on_the_height(device: str) -> bool:
    """Whether a plain float32 linear layer on ``device`` gives a row other bits alone than among more rows (its
    BLAS picks the kernel by the matmul's shape): what the mode is there to remove."""
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(16, 64, generator=generator), torch.randn(128, 64, generator=generator)
    x, weight = x.to(device), weight.to(device)
    alone = torch.nn.functional.linear(x[:1], weight)
    return any(not torch.equal(torch.nn.functional.linear(x[:n], weight)[:1], alone) for n in range(2, 17))


def test_without_the_mode_the_same_comparison_finds_differences(tiny_llama):
    """The control of the test above, on the torch backend: with the mode off, some request's logprobs differ
    in their last bits between alone and among the 14. Deterministic where the device's matmuls depend on the
    height (MKL's float32 GEMM here: one row goes through another kernel than two or more)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not matmul_rows_depend_on_the_height(device):
        pytest.skip(f"a float32 matmul row on {device} has the same bits at every height: nothing to control")
    alone, mixed = backend_run(tiny_llama, "torch", invariant=False)

    def bits(completion) -> list:
        entries = [*completion.logprobs, *(completion.prompt_logprobs or [])]
        return [completion.token_ids, *((e.logprob, e.top_ids, e.top_logprobs) for e in entries)]

    differing = [i for i, (a, m) in enumerate(zip(alone, mixed)) if bits(a) != bits(m)]
    assert differing, "without the mode, every request came out bit for bit the same alone and mixed"


def test_batch_invariant_mode_still_computes_the_model(reference):
    """At float32, in steps of at most 24 tokens: transformers' greedy tokens and logprobs on four fidelity
    prompts (24 tokens each)."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=5)
    overrides = {"model.dtype": "float32", "quant.plugin": "none", "engine.batch_invariant": True,
                 "scheduler.max_num_batched_tokens": 24}
    with LLM(overrides=overrides) as llm:
        completions = llm.generate([[{"role": "user", "content": p}] for p in CHAT_PROMPTS[:4]], params)
    for prompt, completion, (_, ref_tokens, ref_logprobs) in zip(CHAT_PROMPTS, completions, reference):
        assert_matches_reference(completion, ref_tokens[:24], ref_logprobs, prompt)


@pytest.mark.parametrize("key, value", [
    ("engine.speculative", "ngram"), ("engine.compile", "on"), ("lora.max_loras", 2),
    ("parallel.tensor_parallel_size", 2), ("parallel.pipeline_parallel_size", 2),
])
def test_what_batch_invariant_mode_cannot_run_with_is_a_config_error(key, value):
    from conveyor.config import ConfigError, load_config

    table, name = key.split(".")
    with pytest.raises(ConfigError, match=rf"--set {key}: \[{table}\] {name} = .* cannot run with \[engine\] "
                                          r"batch_invariant = true; allowed with it: "):
        load_config(None, {"engine.batch_invariant": True, key: value})
    load_config(None, {key: value})  # (fine without it)


def test_a_mixture_of_experts_model_is_refused(tmp_path, tokenizer):
    """Its routing runs in matmuls of as many rows as come: the mode says so instead of promising what it cannot."""
    from conveyor.config import ConfigError
    from tests.test_families import tiny_model

    tiny_model("mixtral").save_pretrained(tmp_path)
    tokenizer.hf.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ConfigError, match=r"batch_invariant = true: .* has mixture-of-experts layers"):
        LLM(overrides={"model.path": str(tmp_path), "model.dtype": "float32", "model.max_model_len": 128,
                       "engine.batch_invariant": True})
