"""The sampler against independent references: numpy distributions, transformers' penalties."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from conveyor.messages import ScheduledRequest
from conveyor.sampling import SamplingParams
from conveyor.worker.sampler import Sampler, apply_top_p, inverse_cdf


def make_requests(params: SamplingParams, n: int, prompt=(1, 2, 3), output=(), prefix="s") -> list[ScheduledRequest]:
    """Rows as the runner hands them to the sampler: the last step of each request, with its history."""
    return [
        ScheduledRequest(f"{prefix}{i}", len(prompt) + len(output) - 1, [0], [0], params, sample=True,
                         prompt_token_ids=list(prompt), output_token_ids=list(output))
        for i in range(n)
    ]


def reference_distribution(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The filtered softmax, written independently in float64 numpy (HF's order: T, top-k, top-p, min-p)."""
    z = logits.astype(np.float64) / p.temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = np.ones_like(probs, dtype=bool)
    if p.top_k > 0:
        keep[order[p.top_k :]] = False
    probs = np.where(keep, probs, 0)
    probs /= probs.sum()
    if p.top_p < 1:
        sorted_probs = probs[order]
        mass_before = np.cumsum(sorted_probs) - sorted_probs
        drop = order[mass_before >= p.top_p]
        probs[drop] = 0
        probs /= probs.sum()
    if p.min_p > 0:
        probs = np.where(probs < p.min_p * probs.max(), 0, probs)
        probs /= probs.sum()
    return probs


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=1.0, min_p=0.05),
        SamplingParams(temperature=0.9, top_k=12, top_p=0.9),
    ],
    ids=["temperature", "top_p", "top_k", "min_p", "top_k+top_p"],
)
def test_sampling_follows_the_filtered_softmax(params):
    vocab, draws = 24, 30_000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 2
    expected = reference_distribution(logits.numpy(), params)
    tokens, _ = Sampler(seed=11).sample(logits.expand(draws, vocab).clone(), make_requests(params, draws))
    counts = np.bincount(tokens, minlength=vocab)
    assert counts[expected == 0].sum() == 0, "a filtered-out token was drawn"
    support = expected > 0
    _, p_value = stats.chisquare(counts[support], expected[support] * draws)
    assert p_value > 1e-3, f"chi-square p={p_value:.2e}"


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.99])
@pytest.mark.usefixtures("random_seed")
def test_top_p_nucleus_equals_numpy_even_past_the_candidate_window(top_p):
    # A flat-ish vocabulary of 5000 makes the nucleus span thousands of tokens
    # (past the partial top-k window); a peaked one keeps it small.
    flat = torch.softmax(torch.randn(5000) * 0.3, dim=0)
    peaked = torch.softmax(torch.randn(5000) * 6.0, dim=0)
    probs = torch.stack([flat, peaked])
    kept = apply_top_p(probs, torch.tensor([[top_p], [top_p]], dtype=torch.float64)) > 0
    for row in range(2):
        expected = reference_distribution(np.log(probs[row].double().numpy()), SamplingParams(top_p=top_p)) > 0
        assert np.array_equal(kept[row].numpy(), expected)


@pytest.mark.usefixtures("random_seed")
def test_greedy_rows_take_the_argmax_beside_random_rows():
    logits = torch.randn(6, 100)
    params = [SamplingParams(temperature=0)] * 3 + [SamplingParams(temperature=1.0)] * 3
    requests = [make_requests(p, 1)[0] for p in params]
    tokens, _ = Sampler().sample(logits.clone(), requests)
    assert tokens[:3] == logits[:3].argmax(-1).tolist()


def test_greedy_token_leads_its_top_logprobs_when_logits_tie():
    # bf16 logits tie often; greedy takes the first of tied maxima, and the top list puts it first too
    logits = torch.zeros(4, 64)
    tied = [(3, 40), (7, 9, 63), (0, 1), (12, 50)]
    for row, ids in enumerate(tied):
        logits[row, list(ids)] = 5.0
        logits[row, 20] = 4.0
    params = SamplingParams(temperature=0, logprobs=3)
    tokens, entries = Sampler().sample(logits.clone(), make_requests(params, 4))
    for ids, token, entry in zip(tied, tokens, entries):
        assert token == min(ids)
        expected = [*ids, 20][:3]
        assert entry.top_ids == expected
        assert entry.top_logprobs == sorted(entry.top_logprobs, reverse=True)


@pytest.mark.usefixtures("random_seed")
def test_logprobs_are_the_raw_log_softmax_with_top_n():
    logits = torch.randn(3, 50, dtype=torch.float32)
    params = SamplingParams(temperature=0.5, top_k=3, logprobs=4, repetition_penalty=1.5)
    tokens, entries = Sampler().sample(logits.clone(), make_requests(params, 3))
    reference = torch.log_softmax(logits.double(), dim=-1)
    for row, (token, entry) in enumerate(zip(tokens, entries)):
        assert entry.logprob == pytest.approx(float(reference[row, token]), abs=1e-5)
        top = reference[row].topk(4)
        assert entry.top_ids == top.indices.tolist()
        assert entry.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-5)


@pytest.mark.usefixtures("random_seed")
def test_repetition_penalty_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(1, 40) * 3
    prompt, output = [1, 5, 9], [5, 12, 30, 12]
    [request] = make_requests(SamplingParams(temperature=0, repetition_penalty=1.7), 1, prompt, output)
    ours = logits.clone()
    from conveyor.worker.sampler import apply_penalties

    apply_penalties(ours, [0], [request])
    reference = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), logits.clone())
    torch.testing.assert_close(ours, reference)


@pytest.mark.usefixtures("random_seed")
def test_presence_and_frequency_penalties_follow_the_openai_formula():
    from conveyor.worker.sampler import apply_penalties

    logits = torch.randn(1, 20)
    output = [3, 3, 3, 7]
    [request] = make_requests(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), 1, (3, 4), output)
    ours = logits.clone()
    apply_penalties(ours, [0], [request])
    expected = logits.clone()[0]
    for token in set(output):  # mu[j] -= c[j] * alpha_frequency + float(c[j] > 0) * alpha_presence
        expected[token] -= output.count(token) * 0.25 + 0.5
    torch.testing.assert_close(ours[0], expected)


@pytest.mark.usefixtures("random_seed")
def test_seeded_rows_do_not_depend_on_their_neighbours():
    vocab = 1000
    logits = torch.randn(1, vocab)
    seeded = SamplingParams(temperature=1.0, seed=42)

    def draw(extra_rows: int, position: int) -> list[int]:
        request = make_requests(seeded, 1)[0]
        others = make_requests(SamplingParams(temperature=1.0), extra_rows, prefix="other")
        batch = others[:position] + [request] + others[position:]
        sampler = Sampler(seed=extra_rows)  # the engine-wide seed differs too
        result = []
        for _ in range(5):  # five steps of the same request: its own generator goes on
            tokens, _ = sampler.sample(logits.expand(len(batch), vocab).clone(), batch)
            result.append(tokens[position])
        return result

    first = draw(0, 0)
    assert first == draw(7, 3) == draw(2, 2)
    assert len(set(first)) > 1  # five draws, not one draw five times

    sampler = Sampler()
    [request] = make_requests(seeded, 1)
    before = sampler.sample(logits.clone(), [request])[0]
    sampler.rows.remove([request.request_id])  # the request ended: a new one with its id and seed starts afresh
    assert sampler.sample(logits.clone(), [request])[0] == before


@settings(max_examples=200, deadline=None)
@given(
    weights=st.lists(st.sampled_from([0.0, 0.0, 1e-6, 0.3, 1.0, 5.0]), min_size=1, max_size=12).filter(any),
    u=st.floats(min_value=0.0, max_value=1.0, exclude_max=True),
)
def test_inverse_cdf_never_draws_a_zero_probability_token(weights, u):
    probs = torch.tensor([weights], dtype=torch.float32)
    index = int(inverse_cdf(probs, torch.tensor([[u]], dtype=torch.float64))[0])
    assert weights[index] > 0


@pytest.mark.usefixtures("random_seed")
def test_the_two_level_inverse_cdf_draws_what_one_cumsum_over_the_row_draws():
    # 2,500 tokens: two full blocks of the two-level search and a padded third; some rows have blocks of zeros
    probs = torch.softmax(torch.randn(300, 2500) * 3, dim=-1)
    probs[::3, :1024] = 0.0
    probs[1::3, 1024:2048] = 0.0
    uniform = torch.rand(300, 1, dtype=torch.float64)
    cdf = np.cumsum(probs.double().numpy(), axis=1)
    expected = [np.searchsorted(row, u * row[-1], side="right") for row, u in zip(cdf, uniform[:, 0].numpy())]
    assert inverse_cdf(probs, uniform).tolist() == expected


@settings(max_examples=200, deadline=None)
@given(
    nonzero=st.dictionaries(st.integers(0, 2999), st.sampled_from([1e-6, 0.3, 1.0, 5.0]), min_size=1, max_size=6),
    u=st.floats(min_value=0.0, max_value=1.0, exclude_max=True),
)
def test_inverse_cdf_across_blocks_never_draws_a_zero_probability_token(nonzero, u):
    probs = torch.zeros(1, 3000)
    for token, weight in nonzero.items():
        probs[0, token] = weight
    assert int(inverse_cdf(probs, torch.tensor([[u]], dtype=torch.float64))[0]) in nonzero


def test_inverse_cdf_at_the_top_of_a_block_whose_sum_rounds_above_its_running_sum():
    # a block's sum can round above its float64 running sum: a uniform just under 1 then aims past the
    # block's last cdf, where only trailing zeros lie
    generator = torch.Generator().manual_seed(0)
    probs = torch.zeros(2000, 1000)
    scales = torch.tensor([1e-6, 0.3, 1.0, 5.0])
    for row in probs:
        weights = torch.rand(40, generator=generator) * scales[torch.randint(0, 4, (40,), generator=generator)]
        row[torch.randint(0, 990, (40,), generator=generator)] = weights
    tops = probs.sum(dim=-1).double() > probs.cumsum(dim=-1, dtype=torch.float64)[:, -1]
    if not tops.any():
        pytest.skip("this CPU's sums of these rows round as their running sums do")
    drawn = inverse_cdf(probs, torch.full((2000, 1), 1 - 2**-53, dtype=torch.float64))
    assert (probs.gather(1, drawn.unsqueeze(1)) > 0).all()
