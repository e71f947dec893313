"""vLLM's prompt_logprobs over HTTP, on the shared real server: the values the offline engine gives for the same
prompt, in vLLM's shape (completions: each choice's; chat: the response's), and the field's limits."""

from __future__ import annotations

import openai
import pytest

from conveyor.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is Paris, and the capital of Italy is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def offline():
    """The offline engine in the shared server's configuration (the default one)."""
    from conveyor import LLM

    with LLM() as llm:
        yield llm


@pytest.fixture(scope="module")
def model(openai_client):
    return openai_client.models.list().data[0].id


def check(served, offline, prompt_ids, tokenizer, num_top):
    """``served`` (vLLM's prompt_logprobs) holds the offline engine's entries: None for the first token, then for
    each token its logprob and those of its ``num_top`` most likely alternatives, with their ranks and texts; the
    prompt token's rank is its place in the whole vocabulary (counted here from the 20 most likely: 1 + those
    more likely, or past 20)."""
    [completion, wide] = offline.generate([prompt_ids] * 2, [
        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=n) for n in (num_top, 20)])
    expected = completion.prompt_logprobs
    ranks = [1 + sum(v > entry.logprob for v in entry.top_logprobs) if token in entry.top_ids else None
             for token, entry in zip(prompt_ids[1:], wide.prompt_logprobs)]
    assert any(rank is None or rank > num_top for rank in ranks)  # (some rank came from past the top num_top)
    assert served[0] is None and len(served) == len(prompt_ids) == len(expected) + 1
    for token, entry, position, rank in zip(prompt_ids[1:], expected, served[1:], ranks):
        assert len(entry.top_ids) == num_top
        assert set(position) == {str(token), *map(str, entry.top_ids)}
        assert position[str(token)]["logprob"] == entry.logprob
        if rank is None:
            assert position[str(token)]["rank"] > 20
        else:
            assert position[str(token)]["rank"] == rank
        for rank, (top_id, logprob) in enumerate(zip(entry.top_ids, entry.top_logprobs), start=1):
            assert position[str(top_id)] == {"logprob": logprob, "rank": rank,
                                             "decoded_token": tokenizer.decode([top_id], skip_special_tokens=False)}


def test_completions_give_each_choice_its_prompts_logprobs(openai_client, model, offline, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    reply = openai_client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0,
                                             extra_body={"prompt_logprobs": 3})
    check(reply.choices[0].model_extra["prompt_logprobs"], offline, prompt_ids, tokenizer, 3)
    assert reply.usage.prompt_tokens == len(prompt_ids)


def test_chat_gives_the_prompts_logprobs_beside_its_choices(openai_client, model, offline, tokenizer):
    prompt_ids = tokenizer.encode_chat(MESSAGES)
    reply = openai_client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1, temperature=0,
                                                  extra_body={"prompt_logprobs": 2})
    check(reply.model_extra["prompt_logprobs"], offline, prompt_ids, tokenizer, 2)
    assert "prompt_logprobs" not in reply.choices[0].model_extra


def test_a_batch_gives_each_choice_its_own_prompts_positions(openai_client, model, tokenizer):
    prompts = [PROMPT, "One, two, three, four"]
    reply = openai_client.completions.create(model=model, prompt=prompts, n=2, max_tokens=1, temperature=0,
                                             extra_body={"prompt_logprobs": 0})
    for choice in reply.choices:
        prompt_ids = tokenizer.encode(prompts[choice.index // 2])
        served = choice.model_extra["prompt_logprobs"]
        assert served[0] is None and [list(position) for position in served[1:]] == [[str(t)] for t in prompt_ids[1:]]


@pytest.mark.parametrize(("value", "stream", "message"), [
    (21, False, "prompt_logprobs=21 must be in [0, 20]"),
    (-1, False, "prompt_logprobs=-1 must be in [0, 20]"),
    (1, True, "`prompt_logprobs` are not available when `stream=True`."),
])
def test_prompt_logprobs_out_of_bounds_or_streamed_is_a_400_naming_it(openai_client, model, value, stream, message):
    for create, fields in ((openai_client.completions.create, {"prompt": PROMPT}),
                           (openai_client.chat.completions.create, {"messages": MESSAGES})):
        with pytest.raises(openai.BadRequestError) as bad:
            create(model=model, max_tokens=1, stream=stream, extra_body={"prompt_logprobs": value}, **fields)
        assert bad.value.body["param"] == "prompt_logprobs" and message in bad.value.body["message"]
