"""logit_bias and min_tokens: a bias moves greedy and sampled picks but not the logprobs returned; end-of-sequence
and stop tokens are not sampled while the output is short of min_tokens, and end it from there on. Against numpy
references for the sampler, and the model's own unbiased, unconstrained output end to end."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conveyor.engine.deltas import SentRequests
from conveyor.messages import ScheduledRequest
from conveyor.request import FinishReason, Request
from conveyor.sampling import SamplingParams, StructuredOutput
from conveyor.worker.sampler import Sampler

VOCAB = 1000
FRANCE = "The capital of France is"
PARIS = 7042  # " Paris", what SmolLM2 says next, greedily
EOS = 2  # <|im_end|>


def entry(params: SamplingParams, name: str = "r", drafts: list[int] = (), banned: list[int] = (),
          left: int = 0) -> ScheduledRequest:
    return ScheduledRequest(name, 0, [0, *drafts], [0], params, sample=True, draft_token_ids=list(drafts),
                            banned_token_ids=list(banned), min_tokens_left=left)


def reference_log_softmax(logits: torch.Tensor) -> np.ndarray:
    z = logits.double().numpy()
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def test_a_bias_moves_greedy_and_sampled_picks_but_not_the_logprobs(random_seed):
    """Row 0: -100 on its argmax; row 1: +100 on a random token; row 2: no bias; row 3: sampled with +100 on a token,
    and a bias on an id past the logits (skipped). Picks as numpy's argmax of logits + bias; logprobs as the
    unbiased float64 log-softmax."""
    logits = torch.randn(4, VOCAB)
    top = int(logits[0].argmax())
    favoured = (top + int(torch.randint(1, VOCAB, ()))) % VOCAB  # (not row 0's argmax, biased too)
    drawn = int(torch.randint(0, VOCAB, ()))
    params = [SamplingParams(temperature=0, logprobs=3, logit_bias={top: -100}),
              SamplingParams(temperature=0, logprobs=3, logit_bias={favoured: 100, top: -3.5}),
              SamplingParams(temperature=0, logprobs=3),
              SamplingParams(temperature=1.0, logprobs=3, logit_bias={drawn: 100, VOCAB + 5: 100})]
    requests = [entry(p, f"r{i}") for i, p in enumerate(params)]
    expected_logprobs = reference_log_softmax(logits)
    biased = logits.double().numpy().copy()
    for row, p in enumerate(params[:3]):
        for token, bias in p.logit_bias.items():
            biased[row, token] += bias
    tokens, entries = Sampler(seed=random_seed).sample(logits.clone(), requests)
    assert tokens[:3] == [int(t) for t in biased[:3].argmax(axis=-1)]
    assert tokens[0] != top and tokens[1] == favoured and tokens[3] == drawn
    for row, (token, e) in enumerate(zip(tokens, entries)):
        np.testing.assert_allclose(e.logprob, expected_logprobs[row, token], atol=1e-5)
        np.testing.assert_allclose(e.top_logprobs, np.sort(expected_logprobs[row])[::-1][:3], atol=1e-5)


def test_drafts_are_checked_under_the_bias_and_the_min_tokens_ban():
    """Greedy verification of two drafts (each its row's argmax): a -100 bias on the first rejects it; banning
    the second draft's token for the first two tokens of the step rejects it, for the first one alone keeps it."""
    logits = torch.randn(3, VOCAB)
    d0, d1 = 10, 20
    logits[0, d0], logits[1, d1], logits[2, 30] = 50.0, 50.0, 50.0
    second = [int(row.topk(2).indices[1]) for row in logits]
    sampler = Sampler()
    greedy = SamplingParams(temperature=0, logprobs=0)
    tokens, entries = sampler.verify(logits, entry(SamplingParams(temperature=0, logit_bias={d0: -100}), "a",
                                                   [d0, d1]))
    assert tokens == [second[0]]
    tokens, entries = sampler.verify(logits, entry(greedy, "b", [d0, d1], banned=[d1, 999], left=2))
    assert tokens == [d0, second[1]]
    np.testing.assert_allclose([e.logprob for e in entries], reference_log_softmax(logits)[[0, 1], tokens],
                               atol=1e-5)
    tokens, _ = sampler.verify(logits, entry(greedy, "c", [d0, d1], banned=[d1], left=1))
    assert tokens == [d0, d1, 30]


def test_sampled_rows_short_of_min_tokens_never_draw_a_banned_token():
    """A row whose most likely tokens are banned (all but certain otherwise) draws another; the next row, with
    nothing banned, draws them."""
    logits = torch.zeros(2, VOCAB)
    logits[:, [5, 6]] = 30.0
    requests = [entry(SamplingParams(temperature=1.0), "a", banned=[5, 6, 2], left=3),
                entry(SamplingParams(temperature=1.0), "b")]
    for _ in range(20):
        tokens, _ = Sampler().sample(logits.clone(), requests)
        assert tokens[0] not in (5, 6, 2) and tokens[1] in (5, 6)


@pytest.mark.parametrize("logit_bias, message", [
    ({1: 100.5}, r"logit_bias has the bias 100.5 for token 1; biases must be in \[-100, 100\]"),
    ({"3": float("nan")}, r"logit_bias has the bias nan for token 3"),
    ({-4: 1.0}, r"logit_bias has the token id -4; token ids must be >= 0"),
    ({"x": 1.0}, r"logit_bias has the key 'x'; keys must be token ids"),
    ({i: 1.0 for i in range(1025)}, r"logit_bias has 1025 tokens; at most 1024 are allowed"),
])
def test_out_of_range_biases_are_refused(logit_bias, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=logit_bias)


def test_token_ids_come_as_ints_and_past_the_vocabulary_are_named():
    params = SamplingParams(logit_bias={"7042": -100, 5: 2})
    assert params.logit_bias == {7042: -100.0, 5: 2.0}
    params.check_vocabulary(49152)
    with pytest.raises(ValueError, match=r"logit_bias has the token id 49152, which is outside the vocabulary "
                                         r"\(0\.\.49151\)"):
        SamplingParams(logit_bias={49152: 1}).check_vocabulary(49152)


def test_stop_and_end_of_sequence_end_a_request_only_from_min_tokens_on():
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=10, min_tokens=3, stop_token_ids=[7]), 100,
                      eos_token_ids=[EOS])
    assert [request.append_token(t) for t in (7, EOS, 5)] == [None, None, None]
    assert request.append_token(7) == FinishReason.STOP


def test_steps_carry_the_banned_tokens_while_they_apply():
    """Sampled entries of a request under min_tokens carry its end-of-sequence and stop ids and how many tokens
    must come first; an entry that follows a step in flight counts that step's token; none once min_tokens is
    reached, under ignore_eos only the stop ids, under a grammar nothing."""
    params = SamplingParams(max_tokens=20, min_tokens=3, stop_token_ids=[9, 7])
    request = Request("r", [1, 2, 3], params, 100, eos_token_ids=[EOS])
    request.append_token(5)

    def filled(request: Request, follows: bool = False, sample: bool = True) -> tuple[list[int], int]:
        scheduled = ScheduledRequest(request.request_id, 4, [-1] if follows else [5], sample=sample, follows=follows)
        SentRequests().fill(scheduled, request, [0], False)
        return scheduled.banned_token_ids, scheduled.min_tokens_left

    assert filled(request) == ([EOS, 7, 9], 2)
    assert filled(request, follows=True) == ([EOS, 7, 9], 1)
    assert filled(request, sample=False) == ([], 0)
    request.append_token(6)
    assert filled(request, follows=True) == ([], 0)
    assert filled(Request("i", [1], SamplingParams(min_tokens=3, stop_token_ids=[7], ignore_eos=True), 100,
                          eos_token_ids=[EOS])) == ([7], 3)
    grammar = SamplingParams(min_tokens=3, structured=StructuredOutput(regex="[ab]+"))
    assert filled(Request("g", [1], grammar, 100, eos_token_ids=[EOS])) == ([], 0)


def greedy(llm, prompt, **fields):
    return llm.generate(prompt, SamplingParams(temperature=0, **fields))[0]


def test_a_bias_changes_what_the_model_says_and_not_its_logprobs(llm_fp32, tokenizer):
    """-100 on " Paris" after "The capital of France is": the model's second choice instead; +100 on " A": " A"
    every time; the first token's logprobs those of the unbiased run (the model's distribution)."""
    prompt = tokenizer.encode(FRANCE)
    plain = greedy(llm_fp32, prompt, max_tokens=4, logprobs=3)
    assert plain.token_ids[0] == PARIS
    first = plain.logprobs[0]
    banned = greedy(llm_fp32, prompt, max_tokens=4, logprobs=3, logit_bias={PARIS: -100})
    assert banned.token_ids[0] == first.top_ids[1] and PARIS not in banned.token_ids
    forced = greedy(llm_fp32, prompt, max_tokens=4, logprobs=3, logit_bias={330: 100})
    assert forced.token_ids == [330] * 4
    for run in (banned, forced):
        assert run.logprobs[0].top_ids == first.top_ids
        np.testing.assert_allclose(run.logprobs[0].top_logprobs, first.top_logprobs, atol=1e-5)
    np.testing.assert_allclose(banned.logprobs[0].logprob, first.top_logprobs[1], atol=1e-5)
    assert forced.logprobs[0].logprob < -4  # (the model's own, not the biased one's ~0)


@pytest.fixture(scope="module")
def short_answer(llm_fp32):
    """A chat prompt the model answers in a few tokens, ending in end-of-sequence, and that answer."""
    prompt = [{"role": "user", "content": "What is 17 times 3?"}]
    plain = greedy(llm_fp32, prompt, max_tokens=40)
    assert plain.token_ids[-1] == EOS and plain.finish_reason == "stop" and len(plain.token_ids) < 16
    return prompt, plain.token_ids


def test_end_of_sequence_is_not_sampled_before_min_tokens(llm_fp32, short_answer):
    """The answer's end-of-sequence lands at index n: min_tokens=n gives the same answer; n + 1 the same first n
    tokens, then another one in place of the end, and more after it; min_tokens=16: at least 16 tokens, no
    end-of-sequence among them, one after them only as the last."""
    prompt, plain = short_answer
    n = len(plain) - 1
    assert greedy(llm_fp32, prompt, max_tokens=40, min_tokens=n).token_ids == plain
    held = greedy(llm_fp32, prompt, max_tokens=40, min_tokens=n + 1).token_ids
    assert held[:n] == plain[:n] and held[n] != EOS and len(held) > n + 1
    long = greedy(llm_fp32, prompt, max_tokens=24, min_tokens=16)
    assert len(long.token_ids) >= 16 and EOS not in long.token_ids[:16] and EOS not in long.token_ids[:-1]


def test_stop_token_ids_are_not_sampled_before_min_tokens(llm_fp32, short_answer):
    """The answer's last token before its end (".") as a stop token at index m: min_tokens=m ends the answer there,
    with it; m + 1 holds it back one token; min_tokens=16 with the answer's first token a stop token too: at least
    16 tokens, none of them a stop or end token, one after them only as the last."""
    prompt, plain = short_answer
    m = len(plain) - 2
    stop = plain[m]
    assert stop not in plain[:m]
    ended = greedy(llm_fp32, prompt, max_tokens=40, min_tokens=m, stop_token_ids=[stop])
    assert ended.token_ids == plain[: m + 1] and ended.finish_reason == "stop"
    held = greedy(llm_fp32, prompt, max_tokens=40, min_tokens=m + 1, stop_token_ids=[stop]).token_ids
    assert held[:m] == plain[:m] and held[m] not in (stop, EOS)
    long = greedy(llm_fp32, prompt, max_tokens=24, min_tokens=16, stop_token_ids=[stop, plain[0]])
    assert len(long.token_ids) >= 16 and long.token_ids[0] != plain[0]
    assert not {stop, plain[0], EOS} & {*long.token_ids[:16], *long.token_ids[:-1]}
    assert long.finish_reason == ("stop" if long.token_ids[-1] in (stop, plain[0], EOS) else "length")


def complete(client, **fields) -> str:
    return client.completions.create(model="smollm2-135m-instruct", prompt=FRANCE, max_tokens=1, temperature=0,
                                     **fields).choices[0].text


def test_logit_bias_over_http(openai_client):
    """The openai client's logit_bias: " Paris" banned; a bias out of range a 400 naming the field."""
    import openai

    assert complete(openai_client) == " Paris"
    assert complete(openai_client, logit_bias={str(PARIS): -100}) not in ("", " Paris")
    with pytest.raises(openai.BadRequestError) as bad:
        complete(openai_client, logit_bias={str(PARIS): 150})
    assert "biases must be in [-100, 100]" in bad.value.body["message"] and bad.value.body["param"] == "logit_bias"


def test_a_token_id_past_the_vocabulary_is_a_400_over_http(openai_client):
    import openai

    with pytest.raises(openai.BadRequestError) as bad:
        complete(openai_client, logit_bias={"49152": 1})
    assert "token id 49152, which is outside the vocabulary (0..49151)" in bad.value.body["message"]
    assert bad.value.body["param"] == "logit_bias"


def test_min_tokens_holds_with_steps_overlapped(short_answer):
    """Async scheduling: an entry that follows a step in flight counts that step's token, so the answer's stop
    token still comes exactly at min_tokens (not one later) and end-of-sequence not before it; the entries did
    follow steps in flight."""
    from conveyor import LLM

    prompt, plain = short_answer
    m = len(plain) - 2
    with LLM(overrides={"model.dtype": "float32", "quant.plugin": "none", "engine.async_scheduling": "on"}) as llm:
        follows = []
        submit = llm.engine.executor.submit
        llm.engine.executor.submit = lambda step: (follows.extend(e.follows for e in step.requests), submit(step))[1]
        ended = greedy(llm, prompt, max_tokens=40, min_tokens=m, stop_token_ids=[plain[m]])
        held = greedy(llm, prompt, max_tokens=40, min_tokens=m + 2)
    assert any(follows)
    assert ended.token_ids == plain[: m + 1] and ended.finish_reason == "stop"
    assert held.token_ids[: m + 1] == plain[: m + 1] and EOS not in held.token_ids[: m + 2]
