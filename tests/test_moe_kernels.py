"""The Triton grouped GEMM of the mixture-of-experts MLP against the torch grouped path (TRITON_INTERPRET=1
on a CPU): the same routed output for random tokens, experts and weights."""

from __future__ import annotations

import pytest
import torch

from conveyor.model.moe import activate, route
from conveyor.model.moe_kernels import BLOCK_M, align_to_blocks, fused_moe

pytestmark = pytest.mark.usefixtures("random_seed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference_moe(x, gate_up, down, experts, weights, activation):
    """Token by token, expert by expert, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for e, w in zip(experts[t].tolist(), weights[t].tolist()):
            hidden = activate(x[t].double() @ gate_up[e].double().T, activation)
            out[t] += w * (hidden @ down[e].double().T)
    return out


def test_pairs_are_grouped_by_expert_in_whole_blocks():
    experts = torch.tensor([[3, 0], [0, 3], [3, 1], [2, 0]])
    sorted_pairs, block_experts = align_to_blocks(experts, 5, block=4)
    pad = experts.numel()
    # expert 0: pairs 1, 2, 7; expert 1: 5; expert 2: 6; expert 3: 0, 3, 4; expert 4: none
    assert sorted_pairs.tolist() == [1, 2, 7, pad, 5, pad, pad, pad, 6, pad, pad, pad, 0, 3, 4, pad]
    assert block_experts.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "tokens, num_experts, top_k, hidden, width, dtype, activation",
    [
        (5, 4, 2, 32, 16, torch.float32, "silu"),
        (BLOCK_M + 3, 6, 3, 48, 40, torch.float32, "gelu_tanh"),  # a run longer than one block; widths not tiles
        (9, 8, 2, 64, 32, torch.float16, "silu"),
    ],
)
def test_fused_moe_matches_the_reference(tokens, num_experts, top_k, hidden, width, dtype, activation):
    x = torch.randn(tokens, hidden, dtype=dtype)
    gate_up = (torch.randn(num_experts, 2 * width, hidden) / hidden**0.5).to(dtype)
    down = (torch.randn(num_experts, hidden, width) / width**0.5).to(dtype)
    experts, weights = route(torch.randn(tokens, num_experts), top_k, renormalize=True)
    out = fused_moe(x.to(DEVICE), gate_up.to(DEVICE), down.to(DEVICE), experts.to(DEVICE), weights.to(DEVICE),
                    activation)
    expected = reference_moe(x, gate_up, down, experts, weights, activation)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    error = float((out.double().cpu() - expected).abs().max() / expected.abs().max())
    assert error < tolerance, error


@pytest.mark.parametrize("family", ["qwen2-moe", "mixtral"])
def test_a_layer_with_stacked_experts_computes_what_the_grouped_path_does(tmp_path, family):
    """The MoE block as a CUDA worker builds it (experts stacked for the kernel) against the CPU one (the
    unquantized method's layer per expert), on a tiny checkpoint's first layer: shared expert included."""
    from conveyor.model.checkpoint import open_checkpoint
    from conveyor.model.layers import LayerOptions
    from conveyor.model.moe import MoE
    from conveyor.plugins.quant.none import NoQuant
    from tests.test_families import tiny_model

    tiny_model(family).save_pretrained(tmp_path)
    ckpt = open_checkpoint(tmp_path)
    cpu = torch.device("cpu")
    options = LayerOptions(NoQuant(None, torch.float32, cpu), torch.float32, cpu)

    def block(stacked: bool) -> MoE:
        moe = MoE(ckpt.spec, "model.layers.0.mlp.", options, stacked)
        moe.load(ckpt, options)
        return moe

    x = torch.randn(11, ckpt.spec.hidden_size)
    torch.testing.assert_close(block(True).apply(x), block(False).apply(x), rtol=1e-5, atol=1e-5)
