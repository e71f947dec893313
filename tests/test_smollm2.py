"""Conveyor on the real SmolLM2 weights against Hugging Face transformers (fp32)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conveyor import SamplingParams
from tests.conftest import CHAT_PROMPTS, NUM_TOKENS
from tests.helpers import assert_matches_reference

pytestmark = pytest.mark.slow


def test_greedy_matches_transformers_in_a_batch(llm_fp32, reference):
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
    completions = llm_fp32.generate([[{"role": "user", "content": p}] for p in CHAT_PROMPTS], params)
    for prompt, completion, (ids, ref_tokens, ref_logprobs) in zip(CHAT_PROMPTS, completions, reference):
        assert completion.prompt_token_ids == ids
        assert len(completion.token_ids) == NUM_TOKENS
        assert_matches_reference(completion, ref_tokens, ref_logprobs, prompt)


@pytest.mark.parametrize(
    "attention, num_prompts, num_tokens",
    # the Triton kernels run in the interpreter here (TRITON_INTERPRET=1): slow, so a short check
    [("torch", 4, NUM_TOKENS), ("triton", 1, 4)],
)
def test_every_attention_backend_matches_transformers(reference, attention, num_prompts, num_tokens):
    """The default fixture runs "auto" (the C++ kernels here); the other backends, chosen by [engine] attention."""
    from conveyor import LLM

    llm = LLM(overrides={"model.dtype": "float32", "quant.plugin": "none", "engine.attention": attention})
    assert llm.engine.info.attention == attention
    assert not llm.engine.executor.worker.model.options.fused  # the model's layers run in torch ops with these too
    params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True, logprobs=5)
    prompts = CHAT_PROMPTS[:num_prompts]
    completions = llm.generate([[{"role": "user", "content": p}] for p in prompts], params)
    for prompt, completion, (_, ref_tokens, ref_logprobs) in zip(prompts, completions, reference):
        assert_matches_reference(completion, ref_tokens[:num_tokens], ref_logprobs, f"{attention}: {prompt}")


@pytest.fixture(scope="module")
def chunked():
    """Conveyor as llm_fp32 but with a step budget of 16 tokens: prompts are computed in chunks, later ones reading
    K and V from the cache."""
    from conveyor import LLM

    with LLM(overrides={"model.dtype": "float32", "quant.plugin": "none",
                        "scheduler.max_num_batched_tokens": 16}) as llm:
        yield llm


def test_prompt_logprobs_match_transformers(chunked, hf_model, tokenizer):
    ids = tokenizer.encode_chat([{"role": "user", "content": CHAT_PROMPTS[2]}])
    [completion] = chunked.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3))
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), dim=-1)
    entries = completion.prompt_logprobs
    assert len(entries) == len(ids) - 1 > 16
    for position, entry in enumerate(entries, start=1):
        row = ref[position - 1]  # the distribution of the token at `position`
        assert abs(entry.logprob - float(row[ids[position]])) < 1e-3, position
        third = float(row.topk(3).values[-1])
        assert len(entry.top_ids) == 3
        for token, logprob in zip(entry.top_ids, entry.top_logprobs):  # the 3 most likely, up to near ties
            assert abs(logprob - float(row[token])) < 1e-3 and logprob > third - 1e-3, position


def test_a_repetition_penalty_matches_transformers_over_chunked_steps(chunked, hf_model, tokenizer):
    """A penalty needs the prompt and every output on the workers, which get the prompt once and then only each
    step's new outputs (conveyor.engine.deltas). Two prompts computed in chunks of 16 tokens, then 20 decodes: the tokens
    equal transformers' greedy ones under its RepetitionPenaltyLogitsProcessor, or differ first at a near tie."""
    from transformers import RepetitionPenaltyLogitsProcessor

    penalty, num_tokens = 1.3, 20
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS[:2]]
    params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True, logprobs=5,
                            repetition_penalty=penalty)
    plain = chunked.generate(prompts, SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True))
    for ids, completion, unpenalized in zip(prompts, chunked.generate(prompts, params), plain):
        assert len(ids) > 16
        sequence, tokens, logprobs = list(ids), [], []
        with torch.inference_mode():
            for _ in range(num_tokens):
                logits = hf_model(torch.tensor([sequence])).logits[0, -1:].double()
                step = torch.log_softmax(processor(torch.tensor([sequence]), logits)[0], dim=-1)
                tokens.append(int(step.argmax()))
                logprobs.append(step)
                sequence.append(tokens[-1])
        assert_matches_reference(completion, tokens, logprobs, "repetition penalty")
        assert tokens != unpenalized.token_ids  # (so a penalty the workers lost would fail the comparison)


def test_logprobs_match_transformers(llm_fp32, reference):
    _, ref_tokens, ref_logprobs = reference[0]
    [completion] = llm_fp32.generate(
        [{"role": "user", "content": CHAT_PROMPTS[0]}],
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=5),
    )
    assert completion.token_ids == ref_tokens[:16]
    for step, entry in enumerate(completion.logprobs):
        ref = ref_logprobs[step]
        assert abs(entry.logprob - float(ref[completion.token_ids[step]])) < 1e-3
        assert entry.top_ids[0] == completion.token_ids[step]
        for token, logprob in zip(entry.top_ids, entry.top_logprobs):
            assert abs(logprob - float(ref[token])) < 1e-3


def test_generate_cli_matches_transformers(reference):
    _, ref_tokens, _ = reference[1]
    result = subprocess.run(
        [sys.executable, "-m", "conveyor", "--log-level", "WARNING", "generate", "--config", "configs/default.toml",
         "--set", "model.dtype=float32", "--set", "quant.plugin=none", "--chat", "--prompt", CHAT_PROMPTS[1],
         "--max-tokens", "24", "--ignore-eos", "--json"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    output = json.loads(result.stdout)
    assert output["token_ids"] == ref_tokens[:24]
    assert output["finish_reason"] == "length"
    assert output["text"]


def test_answers_the_question(llm_fp32):
    [completion] = llm_fp32.generate(
        [{"role": "user", "content": "What is the capital of France?"}], SamplingParams(max_tokens=32, temperature=0)
    )
    assert "Paris" in completion.text
    assert completion.finish_reason == "stop"  # ended on <|im_end|>, not the token limit


def test_top_k_1_equals_greedy(llm_fp32):
    prompt = [{"role": "user", "content": "Describe a forest."}]
    [greedy] = llm_fp32.generate(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    [top1] = llm_fp32.generate(prompt, SamplingParams(max_tokens=24, temperature=1.3, top_k=1, ignore_eos=True))
    assert top1.token_ids == greedy.token_ids


def test_seeded_sampling_is_reproducible_in_any_batch(llm_fp32):
    prompt = [{"role": "user", "content": "Tell me a story about a robot."}]
    params = SamplingParams(max_tokens=32, temperature=1.0, top_p=0.95, seed=7, ignore_eos=True)
    [alone] = llm_fp32.generate(prompt, params)
    others = [[{"role": "user", "content": f"Say something about {t}."}] for t in ("tea", "snow", "maps")]
    batched = llm_fp32.generate(
        others + [prompt], [SamplingParams(max_tokens=32, temperature=1.0)] * 3 + [params]
    )
    assert batched[-1].token_ids == alone.token_ids
    [other_seed] = llm_fp32.generate(prompt, SamplingParams(max_tokens=32, temperature=1.0, top_p=0.95, seed=8, ignore_eos=True))
    assert other_seed.token_ids != alone.token_ids
    # the worker forgets each request's row, its generator with it, once the request has ended (only the last
    # one's end has not reached it yet: ends travel with the next step)
    assert len(llm_fp32.engine.executor.worker.runner.rows) <= 1


def test_stop_string_ends_the_text_before_it(llm_fp32):
    prompt = [{"role": "user", "content": "What is the capital of France?"}]
    [full] = llm_fp32.generate(prompt, SamplingParams(max_tokens=32, temperature=0))
    assert "Paris" in full.text
    [stopped] = llm_fp32.generate(prompt, SamplingParams(max_tokens=32, temperature=0, stop=["Paris"]))
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index("Paris")]


def test_max_tokens_and_stop_token_ids(llm_fp32):
    prompt = "Once upon a time"
    [limited] = llm_fp32.generate(prompt, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert len(limited.token_ids) == 5 and limited.finish_reason == "length"
    [stopped] = llm_fp32.generate(
        prompt, SamplingParams(max_tokens=5, temperature=0, stop_token_ids=[limited.token_ids[2]])
    )
    assert stopped.token_ids == limited.token_ids[:3] and stopped.finish_reason == "stop"


def test_chunked_prefill_gives_the_same_tokens(llm_fp32, chunked):
    prompt = " ".join(f"Item {i} is a {c}." for i, c in enumerate(["cat", "dog", "bird", "fish"] * 12))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0)
    [whole] = llm_fp32.generate(prompt, params)
    [pieces] = chunked.generate(prompt, params)
    assert len(whole.prompt_token_ids) > 3 * 16
    assert pieces.token_ids == whole.token_ids
    for a, b in zip(pieces.logprobs, whole.logprobs):
        assert abs(a.logprob - b.logprob) < 1e-3


def test_tokenizer_matches_transformers(tokenizer, hf_tokenizer):
    texts = [
        "Hello world",
        "In 2024, we had 3.14 apples; costs $1,000.",
        "naïve café — “quotes” 日本語 🤖",
        "  leading\tand\ttabs\r\n\n",
        "it's we'll I'd",
        "x = [1, 2, 3]\nprint(x)",
    ]
    for text in texts:
        ids = tokenizer.encode(text)
        assert ids == hf_tokenizer(text)["input_ids"], text
        assert tokenizer.decode(ids) == text
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    expected = hf_tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert tokenizer.apply_chat_template(conversation) == expected


def test_one_sampling_params_per_prompt(llm_fp32):
    prompts = ["The sky is", "Water boils at"]
    outputs = llm_fp32.generate(
        prompts, [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)]
    )
    assert [len(o.token_ids) for o in outputs] == [3, 6]
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
        llm_fp32.generate(prompts, [SamplingParams()])


def test_a_failed_step_fails_its_requests_and_the_engine_keeps_serving(llm_fp32, monkeypatch):
    engine = llm_fp32.engine
    free_before = engine.kvcache.num_free_blocks

    def broken(step):
        raise RuntimeError("simulated device fault")

    with monkeypatch.context() as patch:
        patch.setattr(engine.executor, "execute", broken)
        from conveyor.messages import EngineRequest

        assert engine.add_request(EngineRequest("doomed", [1, 2, 3, 4], SamplingParams(max_tokens=4))) is None
        outputs, _ = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("doomed", "error")]
    assert "simulated device fault" in outputs[0].error
    assert engine.kvcache.num_free_blocks == free_before and not engine.has_unfinished()
    [after] = llm_fp32.generate("The sky is", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(after.token_ids) == 4
    with monkeypatch.context() as patch:  # through the offline API, the failure is an exception
        patch.setattr(engine.executor, "execute", broken)
        with pytest.raises(RuntimeError, match="simulated device fault"):
            llm_fp32.generate("The sky is", SamplingParams(max_tokens=4))
    assert engine.kvcache.num_free_blocks == free_before and not engine.has_unfinished()


def test_a_rejected_prompt_leaves_nothing_queued(llm_fp32):
    max_model_len = llm_fp32.engine.max_model_len
    too_long = "word " * (max_model_len + 1)
    with pytest.raises(ValueError, match=f"max_model_len={max_model_len} leaves no room"):
        llm_fp32.generate(["A fine prompt", too_long], SamplingParams(max_tokens=2))
    assert not llm_fp32.engine.has_unfinished()


def test_generate_works_inside_a_running_event_loop_and_refuses_once_closed():
    """As in a notebook (an asyncio loop runs in the calling thread), generate gives what it gives outside one;
    a closed LLM says so instead of failing in its engine."""
    import asyncio

    from conveyor import LLM

    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm = LLM()
    outside = llm.generate(["The capital of France is"], params)

    async def notebook_cell():
        return llm.generate(["The capital of France is"], params)

    inside = asyncio.run(notebook_cell())
    assert inside[0].token_ids == outside[0].token_ids
    llm.close()
    llm.close()
    with pytest.raises(RuntimeError, match="this LLM is closed"):
        llm.generate(["Hi"], params)
