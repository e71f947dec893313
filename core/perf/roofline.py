"""What a step asks of the hardware: its FLOPs and the bytes it moves, from the model's shape and the step's
batch; and what share of the device's peaks it reached.

Counted per step (all workers together):

- FLOPs: 2 per weight a token multiplies in the layers (for a mixture of
  experts, only the experts it takes), 2 x hidden x vocabulary for each row
  whose logits are computed, and 4 x heads x head_dim per (query, key) pair
  attended (Q.K and P.V; a sliding window caps a query's keys).
- Bytes: every weight once (for a mixture of experts, the experts some token
  of the step took, at most all), each sequence's cached K and V once, the
  new tokens' K and V written, and each linear layer's input and output rows.

Model FLOPs utilization (MFU) is FLOPs / (seconds x peak FLOP/s);
memory-bandwidth utilization (MBU) bytes / (seconds x peak bytes/s). The
seconds are the step's forward pass as the workers timed it; the peak
FLOP/s is that of the arithmetic the weights are multiplied in
(``DevicePeaks.flops_for_weights``). Neither exceeds 1: a rate above a peak
means the peak is wrong (a CPU measured while busy), so it counts as the peak
and the doctor says so (``conveyor.perf.readings``).
"""

from __future__ import annotations

import msgspec

from conveyor.model.spec import ModelSpec


class ModelCosts(msgspec.Struct, frozen=True):
    """The model's costs as served: per token, per row of logits, per attended pair, per step."""

    # bytes of every weight as stored (quantized layers at their packed size), the output head's included
    weight_bytes: int
    # FLOPs of the layers' matmuls for one token (its experts only), the output head's not
    layer_flops_per_token: int
    # FLOPs of one row of logits
    head_flops_per_row: int
    # FLOPs of one query attending one key, all heads and layers
    attention_flops_per_pair: int
    # bytes of one token's K and V in every layer, as the cache stores them
    kv_bytes_per_token: int
    # bytes of the linear layers' input and output rows for one token
    activation_bytes_per_token: int
    # of weight_bytes, the routed experts' (a step reads those its tokens chose); their number per layer,
    # and how many each token takes
    expert_bytes: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    # keys a query sees at most (the sliding window every layer shares; 0: all before it)
    window: int = 0

    @classmethod
    def of(cls, spec: ModelSpec, weight_bytes: int, kv_bytes_per_head: int, activation_bytes: int) -> ModelCosts:
        """
        Args:
            weight_bytes: the weights as stored, all workers together.
            kv_bytes_per_head: one token's K (or V) in one KV head as cached (scales included).
            activation_bytes: bytes of one activation value (the model dtype's).
        """
        hidden, heads, head_dim = spec.hidden_size, spec.num_heads, spec.head_dim
        q, kv = heads * head_dim, spec.num_kv_heads * head_dim
        attention = hidden * (q + 2 * kv) + q * hidden
        attention_io = (hidden + q + 2 * kv) + (q + hidden)
        layer_weights = io = 0
        for index in range(spec.num_layers):
            moe = spec.num_experts and (not spec.moe_layers or spec.moe_layers[index])
            width = spec.moe_intermediate_size if moe else spec.intermediate_size
            per_token_mlps = spec.num_experts_per_tok if moe else 1
            layer_weights += attention + per_token_mlps * 3 * hidden * width
            io += attention_io + per_token_mlps * (hidden + 2 * width + width + hidden)
            if moe and spec.shared_expert_intermediate_size:
                shared = spec.shared_expert_intermediate_size
                layer_weights += 3 * hidden * shared
                io += hidden + 3 * shared + hidden
        windows = set(spec.layer_windows) or {0}
        dense, experts, embeddings = weight_counts(spec)
        # (the routed experts' share of the stored bytes, by their share of the weights)
        expert_bytes = int(weight_bytes * experts / (dense + experts + embeddings))
        return cls(
            weight_bytes=weight_bytes,
            layer_flops_per_token=2 * layer_weights,
            head_flops_per_row=2 * hidden * spec.vocab_size,
            attention_flops_per_pair=4 * heads * head_dim * spec.num_layers,
            kv_bytes_per_token=2 * spec.num_layers * spec.num_kv_heads * kv_bytes_per_head,
            activation_bytes_per_token=io * activation_bytes,
            expert_bytes=expert_bytes,
            num_experts=spec.num_experts,
            experts_per_token=spec.num_experts_per_tok,
            window=windows.pop() if len(windows) == 1 else 0,
        )


def weight_counts(spec: ModelSpec) -> tuple[int, int, int]:
    """The model's weights: (the layers' linear weights outside the routed experts, the routed experts',
    the embedding's and the head's)."""
    hidden, head_dim = spec.hidden_size, spec.head_dim
    attention = hidden * (spec.num_heads + 2 * spec.num_kv_heads) * head_dim + spec.num_heads * head_dim * hidden
    dense = experts = 0
    for index in range(spec.num_layers):
        moe = spec.num_experts and (not spec.moe_layers or spec.moe_layers[index])
        if moe:
            dense += attention + 3 * hidden * spec.shared_expert_intermediate_size
            experts += spec.num_experts * 3 * hidden * spec.moe_intermediate_size
        else:
            dense += attention + 3 * hidden * spec.intermediate_size
    return dense, experts, spec.vocab_size * hidden * (1 if spec.tie_word_embeddings else 2)


class StepWork(msgspec.Struct, array_like=True, frozen=True):
    """What one step computed and moved."""

    flops: float
    bytes: float


def attended_pairs(start: int, tokens: int, window: int = 0) -> int:
    """(query, key) pairs of ``tokens`` queries at positions ``start ..``, each over the keys up to its own
    (the last ``window`` of them where there is a window)."""
    pairs = tokens * start + tokens * (tokens + 1) // 2
    if window:
        # query at position p sees min(p + 1, window) keys
        first_full = max(start, window - 1)  # from here on, a query sees exactly `window` keys
        growing = max(0, min(start + tokens, first_full) - start)
        pairs = growing * start + growing * (growing + 1) // 2 + (tokens - growing) * window
    return pairs


def step_work(costs: ModelCosts, chunks: list[tuple[int, int]], logit_rows: int) -> StepWork:
    """A step's FLOPs and bytes.

    Args:
        chunks: each request's (first position computed this step, tokens computed).
        logit_rows: rows whose logits the step computes (one per sampled request, one per draft token).
    """
    tokens = sum(n for _, n in chunks)
    pairs = sum(attended_pairs(start, n, costs.window) for start, n in chunks)
    flops = tokens * costs.layer_flops_per_token + logit_rows * costs.head_flops_per_row
    flops += pairs * costs.attention_flops_per_pair
    weights = costs.weight_bytes
    if costs.num_experts:  # the experts none of the step's tokens took stay unread
        chosen = min(1.0, tokens * costs.experts_per_token / costs.num_experts)
        weights -= costs.expert_bytes * (1.0 - chosen)
    cached = sum(min(start, costs.window) if costs.window else start for start, _ in chunks)
    moved = weights + (cached + tokens) * costs.kv_bytes_per_token + tokens * costs.activation_bytes_per_token
    return StepWork(float(flops), float(moved))


def share_of_peak(amount: float, seconds: float, peak_per_second: float) -> float:
    """``amount`` over what ``seconds`` at ``peak_per_second`` allow, at most 1 (a rate past the peak is the peak's,
    which was measured low); 0 where the peak or the time is unknown."""
    if seconds <= 0 or peak_per_second <= 0:
        return 0.0
    return min(1.0, amount / (seconds * peak_per_second))


def utilization(work: StepWork, seconds: float, peak_flops: float, peak_bytes_per_second: float) -> tuple[float, float]:
    """(MFU, MBU) of a step that took ``seconds``, each at most 1; 0 where a peak is unknown."""
    return share_of_peak(work.flops, seconds, peak_flops), share_of_peak(work.bytes, seconds, peak_bytes_per_second)
