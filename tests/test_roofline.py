"""A step's FLOPs, bytes, MFU and MBU against a hand calculation, and the engine's step stats and peaks."""

from __future__ import annotations

import pytest
import torch

from conveyor.model.spec import ModelSpec
from conveyor.perf.peaks import gpu_peaks
from conveyor.perf.roofline import ModelCosts, StepWork, attended_pairs, share_of_peak, step_work, utilization

# SmolLM2-135M's shape (its config.json)
SMOLLM2 = ModelSpec("LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                    num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
                    max_position_embeddings=8192, tie_word_embeddings=True)


def test_a_known_step_matches_a_hand_calculation():
    """bfloat16 weights and cache. The step: decodes at positions 10 and 20, a fresh prompt of 6 tokens (sampled)
    and a chunk of 4 tokens from position 8 (not sampled yet), on a 2 TFLOP/s, 25 GB/s device, in 40 ms."""
    weight_bytes = 269_030_016  # (bytes as stored: any number; the weights are read once)
    costs = ModelCosts.of(SMOLLM2, weight_bytes, kv_bytes_per_head=64 * 2, activation_bytes=2)
    work = step_work(costs, [(10, 1), (20, 1), (0, 6), (8, 4)], logit_rows=3)

    # per layer and token: q, k, v (576 x 576, 576 x 192 twice), o (576 x 576), gate, up, down (576 x 1536 each)
    weights_per_layer = 576 * 576 + 2 * 576 * 192 + 576 * 576 + 3 * 576 * 1536
    tokens = 1 + 1 + 6 + 4
    # keys each query sees: 11; 21; 1 + 2 + ... + 6; 9 + 10 + 11 + 12
    pairs = 11 + 21 + 21 + 42
    flops = (2 * weights_per_layer * 30 * tokens  # the layers' matmuls
             + 3 * 2 * 576 * 49152  # three rows of logits
             + pairs * 4 * 9 * 64 * 30)  # Q.K and P.V per pair, every head and layer
    # K and V of 3 KV heads x 64 values x 2 bytes x 30 layers per token: cached ones read, new ones written
    kv_per_token = 2 * 3 * 64 * 2 * 30
    # each linear layer's rows in and out: qkv 576 -> 960, o 576 -> 576, gate_up 576 -> 3072, down 1536 -> 576
    activations_per_token = (576 + 960 + 576 + 576 + 576 + 3072 + 1536 + 576) * 30 * 2
    moved = weight_bytes + (10 + 20 + 0 + 8 + tokens) * kv_per_token + tokens * activations_per_token
    assert work == StepWork(flops, moved)

    mfu, mbu = utilization(work, 0.04, 2e12, 25e9)
    assert mfu == pytest.approx(flops / (0.04 * 2e12), rel=1e-12)
    assert mbu == pytest.approx(moved / (0.04 * 25e9), rel=1e-12)
    assert utilization(work, 0.04, 0.0, 0.0) == (0.0, 0.0)  # (unknown peaks)


def test_a_step_faster_than_the_peak_counts_as_the_peak():
    """A rate past the peak means the peak was measured low (a busy CPU): the share is 1, never more; below the
    peak it is the plain ratio, and 0 where the peak or the time is unknown."""
    work = StepWork(flops=3e9, bytes=2e9)
    assert utilization(work, 0.01, 2e11, 1e11) == (1.0, 1.0)  # (300 GFLOP/s against 200, 200 GB/s against 100)
    assert utilization(work, 0.01, 6e11, 1e11) == pytest.approx((0.5, 1.0))
    assert utilization(work, 0.01, 6e11, 4e11) == pytest.approx((0.5, 0.5))
    assert share_of_peak(3e9, 0.01, 2e11) == 1.0 and share_of_peak(3e9, 0.01, 0.0) == 0.0
    assert share_of_peak(3e9, 0.0, 2e11) == 0.0


@pytest.mark.parametrize("window", [0, 1, 5, 16])
def test_attended_pairs_count_each_querys_keys(window):
    for start in range(24):
        for tokens in range(1, 12):
            expected = sum(min(p + 1, window) if window else p + 1 for p in range(start, start + tokens))
            assert attended_pairs(start, tokens, window) == expected, (start, tokens, window)


def test_a_mixture_of_experts_step_reads_only_the_experts_its_tokens_take():
    """8 experts, 2 per token, every layer a mixture: one token reads a quarter of the experts' bytes (at most
    2 of 8 chosen), four tokens or more all of them; FLOPs count the two experts each token takes."""
    spec = ModelSpec("MixtralForCausalLM", vocab_size=100, hidden_size=16, intermediate_size=0, num_layers=2,
                     num_heads=2, num_kv_heads=1, head_dim=8, rope_theta=1e4, rms_norm_eps=1e-5,
                     max_position_embeddings=64, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=32)
    dense = 2 * (16 * 16 + 2 * 16 * 8 + 16 * 16) + 2 * 100 * 16  # attention in both layers, embedding and head
    experts = 2 * 8 * 3 * 16 * 32
    costs = ModelCosts.of(spec, weight_bytes=2 * (dense + experts), kv_bytes_per_head=16, activation_bytes=2)
    assert costs.expert_bytes == 2 * experts
    assert costs.layer_flops_per_token == 2 * 2 * (16 * 16 + 2 * 16 * 8 + 16 * 16 + 2 * 3 * 16 * 32)

    def weight_bytes_read(tokens: int) -> float:
        work = step_work(costs, [(0, tokens)], logit_rows=0)
        kv_and_rows = tokens * (costs.kv_bytes_per_token + costs.activation_bytes_per_token)
        return work.bytes - kv_and_rows

    assert weight_bytes_read(1) == pytest.approx(2 * dense + 2 * experts / 4)
    assert weight_bytes_read(4) == weight_bytes_read(9) == pytest.approx(2 * (dense + experts))


def test_gpus_are_found_by_the_names_torch_gives_them():
    assert gpu_peaks("NVIDIA H100 80GB HBM3").bytes_per_second == pytest.approx(3.35e12)
    assert gpu_peaks("NVIDIA H100 PCIe").name == "H100 PCIe"
    assert gpu_peaks("NVIDIA H200").flops_for("bfloat16") == pytest.approx(989.4e12)
    assert gpu_peaks("NVIDIA A100-SXM4-40GB").bytes_per_second == pytest.approx(1.555e12)
    assert gpu_peaks("NVIDIA A100-SXM4-80GB").bytes_per_second == pytest.approx(2.039e12)
    assert gpu_peaks("NVIDIA L40S").name == "L40S" and gpu_peaks("NVIDIA L4").name == "L4"
    assert gpu_peaks("NVIDIA L4").flops_for("float16") == gpu_peaks("NVIDIA L4").flops_for("bfloat16")
    assert gpu_peaks("NVIDIA A100-SXM4-80GB").flops_for("fp8") == 0.0  # (no fp8 units)
    assert gpu_peaks("NVIDIA GeForce GTX 1080") is None


def test_every_step_of_the_engine_counts_its_work():
    """Through the in-process engine, prompts in chunks: each step's stats carry the FLOPs and bytes of the batch
    it ran, and an MFU and MBU against this CPU's measured profile (cached once per machine)."""
    from conveyor import LLM
    from conveyor.config import paths
    from conveyor.perf.peaks import cpu_profile_path
    from conveyor.sampling import SamplingParams

    with LLM(overrides={"scheduler.max_num_batched_tokens": 16}) as llm:
        core = llm.engine
        if not torch.cuda.is_available():  # (a GPU's peaks come from its name, not a measured profile)
            assert cpu_profile_path(paths.cache_root()).exists()
        assert core.peak_flops > 0 and core.peak_bytes_per_second > 0
        submitted, seen = [], []
        submit, step = core.executor.submit, core.step

        def submit_and_keep(step_input):
            submitted.append(step_input)
            return submit(step_input)

        def step_and_keep():
            outputs, stats = step()
            if stats is not None and stats.num_prefill_tokens + stats.num_decode_tokens:
                seen.append(stats)
            return outputs, stats

        core.executor.submit, core.step = submit_and_keep, step_and_keep
        llm.generate([[{"role": "user", "content": "Name three colours."}]], SamplingParams(max_tokens=4))
    assert len(seen) == len(submitted) >= 5  # (a prompt of 30-odd tokens in chunks of 16, then decodes)
    costs = core.costs
    for stats, step_input in zip(seen, submitted):
        # counted here from the batch the workers got: each token's keys one by one, each sequence's cache
        tokens = sum(len(r.token_ids) for r in step_input.requests)
        pairs = sum(p + 1 for r in step_input.requests for p in range(r.start, r.start + len(r.token_ids)))
        rows = sum(1 for r in step_input.requests if r.sample)
        cached = sum(r.start for r in step_input.requests)
        assert stats.flops == (tokens * costs.layer_flops_per_token + rows * costs.head_flops_per_row
                               + pairs * costs.attention_flops_per_pair)
        assert stats.bytes_moved == (costs.weight_bytes + (cached + tokens) * costs.kv_bytes_per_token
                                     + tokens * costs.activation_bytes_per_token)
        assert 0 < stats.mfu <= 1 and 0 < stats.mbu <= 1
