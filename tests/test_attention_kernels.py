"""Triton attention kernels against float64 dense attention (TRITON_INTERPRET=1 on CPU).

Fresh random inputs each run; the output buffer is poisoned first; relative
error bounds per dtype are stated in TOLERANCE.
"""

from __future__ import annotations

import random

import pytest
import torch

from conveyor.attention.kernels import paged_decode_attention, paged_prefill_attention
from tests.helpers import paged_store, reference_attention, relative_error

pytestmark = pytest.mark.usefixtures("random_seed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# max |kernel - reference| / max |reference|
TOLERANCE = {torch.float32: 2e-3 if DEVICE == "cuda" else 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


@pytest.mark.parametrize(
    "block_size, heads, kv_heads, head_dim, dtype",
    [
        (16, 4, 4, 32, torch.float32),  # no GQA
        (4, 6, 2, 16, torch.float32),  # GQA 3:1, tiny blocks
        (32, 8, 2, 64, torch.float16),  # GQA 4:1
        (12, 9, 3, 24, torch.bfloat16),  # SmolLM2's ratio; block and head sizes not powers of two
    ],
)
def test_paged_decode_matches_reference_attention(block_size, heads, kv_heads, head_dim, dtype):
    lengths = [random.randint(1, 70) for _ in range(3)] + [1]
    k_cache, v_cache, tables, keys, values = paged_store(lengths, kv_heads, head_dim, block_size, dtype, DEVICE)
    q = torch.randn(len(lengths), heads, head_dim, dtype=dtype)
    out = paged_decode_attention(
        q.to(DEVICE), k_cache, v_cache, tables, torch.tensor(lengths, dtype=torch.int32, device=DEVICE), block_size
    )
    for i, n in enumerate(lengths):
        expected = reference_attention(q[i : i + 1], keys[i], values[i], n - 1)[0]
        assert relative_error(out[i], expected) < TOLERANCE[dtype], f"sequence {i} (length {n})"


@pytest.mark.parametrize(
    "block_size, heads, kv_heads, head_dim, dtype",
    [
        (16, 4, 4, 32, torch.float32),
        (4, 6, 2, 16, torch.float32),
        (8, 9, 3, 24, torch.bfloat16),
    ],
)
def test_paged_prefill_chunks_match_reference_attention(block_size, heads, kv_heads, head_dim, dtype):
    # (tokens already cached, chunk length): a fresh prompt, continued chunks, a one-token chunk
    plan = [(0, random.randint(17, 40)), (random.randint(1, 30), random.randint(2, 20)), (21, 1), (0, 5)]
    lengths = [start + n for start, n in plan]
    k_cache, v_cache, tables, keys, values = paged_store(lengths, kv_heads, head_dim, block_size, dtype, DEVICE)
    chunks = [torch.randn(n, heads, head_dim, dtype=dtype) for _, n in plan]
    q = torch.cat(chunks).to(DEVICE)
    q_rows = torch.tensor([0] + [sum(n for _, n in plan[:i]) for i in range(1, len(plan))], dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(
        q, k_cache, v_cache, tables, q_rows.to(DEVICE),
        torch.tensor([n for _, n in plan], dtype=torch.int32, device=DEVICE),
        torch.tensor([s for s, _ in plan], dtype=torch.int32, device=DEVICE),
        block_size, max(n for _, n in plan), out=out,
    )
    for i, ((start, n), row) in enumerate(zip(plan, q_rows.tolist())):
        expected = reference_attention(chunks[i], keys[i], values[i], start)
        assert relative_error(out[row : row + n], expected) < TOLERANCE[dtype], f"sequence {i} {plan[i]}"
