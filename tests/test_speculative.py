"""Speculative decoding with n-gram drafts and with a draft model: the proposer, the check (greedy: the model's
own tokens; sampled: the model's distribution, tested with chi-square on a small vocabulary), and SmolLM2 end
to end."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from conveyor import LLM
from conveyor.engine.speculative import propose_ngram
from conveyor.messages import ScheduledRequest
from conveyor.sampling import SamplingParams
from conveyor.worker.sampler import Sampler, SamplingBuffers, filtered_probs
from tests.conftest import CHAT_PROMPTS, hf_greedy
from tests.helpers import assert_matches_reference, assert_same_or_near_tie

TEXT = ("The quick brown fox jumps over the lazy dog. The dog sleeps under the old oak tree while the fox runs into "
        "the forest. Birds sing in the branches and the river flows quietly past the farm.")
REPEAT = [{"role": "user", "content": f"Repeat this text exactly:\n\n{TEXT}"}]


def test_the_latest_occurrence_of_the_longest_ngram_is_proposed():
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # "2 3" last occurred at 6..7, followed by 7, 8, 5
    assert propose_ngram(tokens, 4, 2, 3) == [7, 8, 5]
    assert propose_ngram(tokens, 4, 2, 10) == [7, 8, 5, 2, 3]  # (up to the end)
    assert propose_ngram([1, 2, 3, 1, 2, 4, 5, 1, 2, 3], 3, 1, 2) == [1, 2]  # "1 2 3" beats the later "1 2"
    assert propose_ngram([5, 6, 7, 8], 3, 1, 4) == []
    assert propose_ngram([4], 3, 1, 4) == []


def draws(sampler: Sampler, logits: torch.Tensor, drafts: list[int], params: SamplingParams, n: int) -> list[list[int]]:
    request = ScheduledRequest("r", 0, [0], [0], params, sample=True, draft_token_ids=drafts)
    return [sampler.verify(logits, request)[0] for _ in range(n)]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5)],
                         ids=["plain", "temperature-top-k"])
def test_sampled_tokens_keep_the_models_distribution(params):
    """8 tokens, two drafts: the first token is drawn from row 0's distribution whether or not the draft is
    accepted, and after an accepted draft the second from row 1's (chi-square, 20,000 draws, p > 0.001)."""
    torch.manual_seed(0)
    logits = torch.randn(3, 8) * 1.5
    drafts = [int(logits[0].argsort()[-2]), 3]  # a likely but not the likeliest first token
    probs = filtered_probs(logits, SamplingBuffers(logits.device).tensors([params] * 3)).double()
    probs = probs / probs.sum(-1, keepdim=True)
    results = draws(Sampler(seed=1), logits, drafts, params, 20_000)
    first = np.bincount([r[0] for r in results], minlength=8)
    seen = probs[0] > 0
    assert first[~seen.numpy()].sum() == 0  # a filtered-out token is never drawn
    assert chisquare(first[seen.numpy()], probs[0][seen].numpy() * len(results)).pvalue > 1e-3
    after = [r[1] for r in results if r[0] == drafts[0]]
    second = np.bincount(after, minlength=8)
    seen = probs[1] > 0
    assert chisquare(second[seen.numpy()], probs[1][seen].numpy() * len(after)).pvalue > 1e-3


def test_greedy_checking_keeps_the_argmax_and_stops_at_the_first_miss():
    logits = torch.full((4, 10), -5.0)
    for row, token in enumerate([4, 7, 2, 9]):
        logits[row, token] = 5.0
    sampler = Sampler()
    greedy = SamplingParams(temperature=0, logprobs=1)
    [(tokens, entries)] = [sampler.verify(logits, ScheduledRequest("r", 0, [0], [0], greedy, sample=True,
                                                                      draft_token_ids=[4, 7, 1]))]
    assert tokens == [4, 7, 2] and [e.top_ids[0] for e in entries] == [4, 7, 2]


@pytest.fixture(scope="module")
def llm_spec():
    with LLM(overrides={"model.dtype": "float32", "quant.plugin": "none", "engine.seed": 1234,
                        "engine.speculative": "ngram"}) as llm:
        yield llm


def test_greedy_tokens_are_the_same_with_and_without_drafts(llm_spec, llm_fp32):
    """SmolLM2 at float32: the chat prompts and a text to repeat, each alone and all at once (decodes with
    drafts beside plain ones and prompt chunks): the tokens without drafts, or a near tie at the first
    difference; many drafts accepted; every KV block free after."""
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=5)
    prompts = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS[:4]] + [REPEAT]
    reference = llm_fp32.generate(prompts, params)
    counters = llm_spec.engine.scheduler.counters
    alone = [llm_spec.generate([p], params)[0] for p in prompts]
    drafted, accepted = counters.num_draft_tokens, counters.num_accepted_tokens
    together = llm_spec.generate(prompts, params)
    for i, (ref, one, batched) in enumerate(zip(reference, alone, together)):
        assert_same_or_near_tie(one, ref, f"prompt {i} alone")
        assert_same_or_near_tie(batched, ref, f"prompt {i} in the batch")
    assert accepted > 20, (drafted, accepted)  # (the check ran on many accepted drafts)
    kv = llm_spec.engine.kvcache
    assert kv.num_free_blocks == kv.num_blocks


def test_step_stats_count_a_decode_checking_drafts_as_a_decode(llm_spec, tokenizer):
    """A decode that checks drafts computes its new token and the drafts: the steps count those as decode
    tokens of one decoding request, and their prompt tokens are the prompt's alone (which starts with a token no
    other prompt starts with: no prefix cache hit)."""
    from conveyor.messages import EngineRequest
    from tests.test_engine import run_engine

    counters = llm_spec.engine.scheduler.counters
    drafted, accepted = counters.num_draft_tokens, counters.num_accepted_tokens
    prompt = [tokenizer.encode("zebra")[0], *tokenizer.encode_chat(REPEAT)]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    tokens, steps = run_engine(llm_spec.engine, [EngineRequest("drafts", prompt, params)])
    checked, accepted = counters.num_draft_tokens - drafted, counters.num_accepted_tokens - accepted
    assert len(tokens["drafts"]) == 32 and accepted > 10
    assert sum(s.num_prefill_tokens for s in steps) == len(prompt)
    # after the prompt's token, each decode step makes one token and those of the drafts it accepts
    decode_steps = 31 - accepted
    assert sum(s.num_decode_seqs for s in steps) == decode_steps
    assert sum(s.num_decode_tokens for s in steps) == decode_steps + checked


class DraftCounts:
    """The speculative engine's draft counters, read around one request."""

    def __init__(self, llm: LLM):
        self.llm = llm

    def generate(self, prompt: list[dict], params: SamplingParams):
        """The completion, and the proposals drafted and accepted while it ran."""
        counters = self.llm.engine.scheduler.counters
        drafted, accepted = counters.num_draft_tokens, counters.num_accepted_tokens
        [completion] = self.llm.generate([prompt], params)
        return completion, counters.num_draft_tokens - drafted, counters.num_accepted_tokens - accepted


def test_stop_conditions_hold_inside_accepted_drafts(llm_spec, hf_model, tokenizer):
    """max_tokens and a stop string land inside a run of accepted drafts: the output ends exactly there. The
    run they cut is transformers' greedy continuation (or a near tie at the first difference), and each run
    had drafts proposed and accepted."""
    runs = DraftCounts(llm_spec)
    long, drafted, accepted = runs.generate(REPEAT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                                   logprobs=5))
    assert accepted > 0 and drafted >= accepted, (drafted, accepted)
    ref_tokens, ref_logprobs = hf_greedy(hf_model, tokenizer.encode_chat(REPEAT), 40)
    assert_matches_reference(long, ref_tokens, ref_logprobs, "the text to repeat")
    for n in (5, 13, 21):
        cut, drafted, accepted = runs.generate(REPEAT, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        assert cut.token_ids == long.token_ids[:n] and cut.finish_reason == "length"
        assert accepted > 0, (n, drafted, accepted)
    stopped, drafted, accepted = runs.generate(REPEAT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                                      stop="lazy"))
    assert stopped.text == long.text[: long.text.index("lazy")] and stopped.finish_reason == "stop"
    assert accepted > 0, (drafted, accepted)


def test_no_drafts_under_a_penalty_or_a_grammar(llm_spec):
    """A request under a repetition, presence or frequency penalty, or constrained by a grammar, gets no
    proposals (its next token depends on the ones before in ways the check does not follow), and still all its
    tokens; the same request without them gets proposals."""
    from conveyor.sampling import StructuredOutput

    runs = DraftCounts(llm_spec)
    plain = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
    _, drafted, _ = runs.generate(REPEAT, SamplingParams(**plain))
    assert drafted > 0
    for name, extra in {"repetition penalty": {"repetition_penalty": 1.1},
                        "presence penalty": {"presence_penalty": 0.5},
                        "frequency penalty": {"frequency_penalty": 0.5},
                        "grammar": {"structured": StructuredOutput(regex="[A-Za-z .,]+")}}.items():
        completion, drafted, accepted = runs.generate(REPEAT, SamplingParams(**plain, **extra))
        assert (drafted, accepted) == (0, 0), name
        assert len(completion.token_ids) == 16, name


@pytest.mark.parametrize("draft", ["random", "itself"])
def test_a_draft_model_proposes_and_the_tokens_stay_the_models(draft, llm_fp32, tmp_path):
    """SmolLM2 at float32 with a draft model: a tiny random one with its vocabulary (few proposals accepted) and
    SmolLM2 itself (nearly all accepted, so the draft's own cache followed every step). Five prompts at once
    in chunks of at most 24 tokens, in a KV cache too small for all (preemption): the tokens without drafts,
    or a near tie at the first difference; every KV block free after."""
    import transformers

    path = "smollm2-135m-instruct"
    if draft == "random":
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
        path = str(tmp_path)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=5)
    prompts = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS[:4]] + [REPEAT]
    reference = llm_fp32.generate(prompts, params)
    overrides = {"model.dtype": "float32", "quant.plugin": "none", "engine.speculative": "draft",
                 "engine.draft_model": path,
                 # 14 blocks of 16 tokens: every request fits alone, the five together do not
                 "scheduler.max_num_batched_tokens": 24, "kvcache.num_blocks": 14}
    with LLM(overrides=overrides) as llm:
        outputs = llm.generate(prompts, params)
        counters = llm.engine.scheduler.counters
        kv = llm.engine.kvcache
        assert kv.num_free_blocks == kv.num_blocks
    for i, (ref, ours) in enumerate(zip(reference, outputs)):
        assert_same_or_near_tie(ours, ref, f"prompt {i}")
    assert counters.num_preemptions > 0
    assert counters.num_draft_tokens > 100
    if draft == "itself":
        assert counters.num_accepted_tokens > 0.9 * counters.num_draft_tokens, counters


def test_a_draft_model_that_cannot_draft_is_a_config_error(tmp_path):
    import transformers

    from conveyor.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="speculative = 'draft' and draft_model go together"):
        load_config(None, {"engine.speculative": "draft"})
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"draft_model = .*: its vocabulary has 96 tokens, the model's 49152"):
        LLM(overrides={"engine.speculative": "draft", "engine.draft_model": str(tmp_path)})


@pytest.mark.slow
def test_drafts_and_grammars_cross_process_boundaries(tmp_path, tokenizer):
    """Two worker processes (TP=2): drafts go out in the step, accepted tokens come back; a grammar's bitmask
    travels with the step. Tokens and top-5 logprobs are one worker's without drafts."""
    from conveyor.sampling import StructuredOutput
    from tests.test_model import tiny_hf_model
    from tests.test_parallel import PROMPTS, SPLITTABLE, assert_same_logits

    tiny_hf_model("llama", **SPLITTABLE).save_pretrained(tmp_path)
    tokenizer.hf.save(str(tmp_path / "tokenizer.json"))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    regex = SamplingParams(max_tokens=24, temperature=0, structured=StructuredOutput(regex="(ab|cd)+e"))

    def run(tp: int, speculative: str) -> tuple[list, list, int]:
        overrides = {"model.path": str(tmp_path), "model.dtype": "float32", "model.max_model_len": 128,
                     "parallel.tensor_parallel_size": tp, "engine.speculative": speculative,
                     "kvcache.memory_gb": 0.05, "scheduler.max_num_batched_tokens": 32}
        with LLM(overrides=overrides) as llm:
            outputs = llm.generate(PROMPTS, params)
            constrained = llm.generate(PROMPTS[:2], regex)
            return outputs, constrained, llm.engine.scheduler.counters.num_accepted_tokens

    split, split_constrained, accepted = run(2, "ngram")
    single, single_constrained, _ = run(1, "off")
    assert accepted > 0
    assert_same_logits(split, single, "TP=2 with drafts")
    assert [c.text for c in split_constrained] == [c.text for c in single_constrained]
    assert all(re.fullmatch("(ab|cd)+e", c.text) for c in split_constrained)
