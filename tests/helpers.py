"""Comparisons shared by the tests: the near-tie rule against transformers, float64 attention, paged KV fixtures;
a float32 CPU model loaded from a checkpoint; and a checkpoint with almost no compute."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from conveyor.entrypoints.llm import Completion


def assert_matches_reference(ours: Completion, ref_tokens: list[int], ref_logprobs: list[torch.Tensor], label: str) -> None:
    """Equal to transformers token for token, or the first difference is a near tie.

    Near tie: each run's token is in the other's top 5, and the reference
    gives the two tokens logprobs within 0.01 of each other.
    """
    for i, (mine, theirs) in enumerate(zip(ours.token_ids, ref_tokens)):
        if mine == theirs:
            continue
        ref_top5 = ref_logprobs[i].topk(5).indices.tolist()
        gap = abs(float(ref_logprobs[i][mine] - ref_logprobs[i][theirs]))
        assert mine in ref_top5 and theirs in ours.logprobs[i].top_ids and gap < 0.01, (
            f"{label}: token {i} differs ({mine} vs transformers {theirs}) and is no near tie (gap {gap:.4f})"
        )
        return
    assert len(ours.token_ids) == len(ref_tokens), label


def assert_same_or_near_tie(a: Completion, b: Completion, label: str) -> None:
    """Two Conveyor runs (both with logprobs >= 5) agree up to a near tie at their first difference."""
    for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
        if x == y:
            continue
        a_top = dict(zip(a.logprobs[i].top_ids, a.logprobs[i].top_logprobs))
        b_top = dict(zip(b.logprobs[i].top_ids, b.logprobs[i].top_logprobs))
        assert y in a_top and x in b_top, f"{label}: token {i} differs ({x} vs {y}) outside each other's top 5"
        gap = max(abs(a_top[x] - a_top[y]), abs(b_top[x] - b_top[y]))
        assert gap < 0.01, f"{label}: token {i} differs ({x} vs {y}) with a logprob gap of {gap:.4f}"
        return
    assert a.token_ids == b.token_ids, f"{label}: one run is a prefix of the other"
    assert a.finish_reason == b.finish_reason, label


def cpu_model(ckpt, quant=None, fused: bool = False, max_len: int = 128):
    """The model of a checkpoint (or its path) in float32 on the CPU, built and loaded as a worker does
    (``quant``: the method's instance; default: unquantized)."""
    from conveyor.model.checkpoint import open_checkpoint
    from conveyor.model.layers import LayerOptions
    from conveyor.model.loader import load_model
    from conveyor.plugins.quant.none import NoQuant

    cpu = torch.device("cpu")
    ckpt = open_checkpoint(ckpt) if isinstance(ckpt, (str, Path)) else ckpt
    quant = quant or NoQuant(None, torch.float32, cpu)
    return load_model(ckpt, LayerOptions(quant, torch.float32, cpu, fused), max_len)


def dense_attention(seq_lens: list[int], layers: list | None = None):
    """The model's attention function for whole sequences with no KV cache (each attends causally to itself);
    ``layers``: each layer's ``LayerAttention`` (scale, sliding window, soft cap), default plain."""
    from conveyor.attention.ops import causal_attention

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        params = layers[layer] if layers else None
        attend = (params.scale, params.window, params.softcap) if params else ()
        outs, start = [], 0
        for n in seq_lens:
            keys, values = k[start : start + n].transpose(0, 1), v[start : start + n].transpose(0, 1)
            outs.append(causal_attention(q[start : start + n], keys, values, 0, *attend))
            start += n
        return torch.cat(outs)

    return attention


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float | None = None,
                        window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of one sequence in float64, K/V heads repeated for GQA.

    q: [n, Hq, D] at positions q_start..; k, v: [L, Hkv, D] at positions 0..L-1. Scores are multiplied by
    ``scale`` (default 1/sqrt(D)), soft-capped at ``softcap`` (``c * tanh(s / c)``) and limited to the last
    ``window`` keys up to each query's own.
    """
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * (scale or 1 / math.sqrt(q.shape[-1]))
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(q_start, q_start + q.shape[0]).unsqueeze(1)
    key_pos = torch.arange(k.shape[0]).unsqueeze(0)
    hidden = (key_pos > q_pos) | ((key_pos <= q_pos - window) if window else False)
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


def paged_store(lengths, kv_heads, head_dim, block_size, dtype, device="cpu"):
    """Random K/V for each sequence, scattered into shuffled blocks; returns the pool and the tables."""
    num_blocks = sum(-(-n // block_size) for n in lengths) + 3
    order = torch.randperm(num_blocks).tolist()
    k_cache = torch.full((num_blocks * block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    keys, values, tables = [], [], []
    for n in lengths:
        table = [order.pop() for _ in range(-(-n // block_size))]
        k, v = torch.randn(n, kv_heads, head_dim, dtype=dtype), torch.randn(n, kv_heads, head_dim, dtype=dtype)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
        k_cache[slots], v_cache[slots] = k, v
        keys.append(k)
        values.append(v)
        tables.append(table)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    # the storage layout: head-major
    k_cache, v_cache = k_cache.transpose(0, 1).contiguous(), v_cache.transpose(0, 1).contiguous()
    return k_cache.to(device), v_cache.to(device), block_tables.to(device), keys, values


def relative_error(out, expected):
    return float((out.double().cpu() - expected).abs().max() / expected.abs().max())


def save_tiny_model_with_smollm2_vocab(path, tokenizer, max_position_embeddings: int) -> None:
    """A random Llama of one layer 32 wide with SmolLM2's tokenizer and 49,152-token vocabulary, and a chat
    template of SmolLM2's form (roles and contents): a server whose forward pass costs next to nothing."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=max_position_embeddings)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.hf.save(str(path / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
