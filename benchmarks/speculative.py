"""Speculative decoding: one stream at a time, without drafts, with n-gram drafts and with draft models.

    python benchmarks/speculative.py [--draft-layers 10] [--set KEY=VALUE ...]

Three repetitive tasks (repeat a given text, rewrite it with one change,
summarize it) and one open question, each greedy, one request at a time,
through the offline LLM with the default config: output tokens per second
without drafts, with ``engine.speculative = "ngram"``, and with
``speculative = "draft"`` for two draft models: the model itself (every
proposal its own choice: the most a draft can accept, at the cost of a
second full model) and its first ``--draft-layers`` layers under its own
final norm and head (written to a temporary directory). Per mode: the
acceptance rate (accepted over proposed tokens), the tokens each step made,
and whether the tokens are the ones without drafts.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from conveyor import LLM
from conveyor.config import load_config, parse_override
from conveyor.model.loader import open_model
from conveyor.sampling import SamplingParams

TEXT = ("Conveyor is an open-source inference server. It keeps the hardware busy and the latency low by batching "
        "requests continuously, caching shared prompt prefixes, and scheduling prompt chunks beside decodes. "
        "Plugins choose the scheduler, the KV cache layout, the quantization and the transports.")
TASKS = {
    "repeat": f"Repeat this text exactly:\n\n{TEXT}",
    "rewrite": f"Rewrite this text, replacing 'Conveyor' with 'Belt':\n\n{TEXT}",
    "summarize": f"Summarize this text in two sentences:\n\n{TEXT}",
    "open question": "Why is the sky blue?",
}


def first_layers(overrides: dict, layers: int, path: Path) -> str:
    """A Llama checkpoint of the model's first ``layers`` layers, its final norm and its (tied) head."""
    config = load_config(None, overrides)
    ckpt = open_model(config.model, config.source)
    spec = ckpt.spec
    names = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{name}.weight" for i in range(layers)
        for name in ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                     "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    path.mkdir(parents=True, exist_ok=True)
    save_file({name: ckpt.get(name).to(torch.bfloat16).contiguous() for name in names},
              path / "model.safetensors")
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": layers,
        "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size, "rms_norm_eps": spec.rms_norm_eps, "rope_theta": spec.rope_theta,
        "max_position_embeddings": spec.max_position_embeddings, "tie_word_embeddings": True}))
    return str(path)


def run(overrides: dict, label: str, speculative: dict) -> dict[str, tuple]:
    results = {}
    with LLM(overrides={**overrides, **speculative}) as llm:
        llm.generate("Hi", SamplingParams(max_tokens=4))  # (warm up)
        counters = llm.engine.scheduler.counters
        for name, prompt in TASKS.items():
            drafted, accepted, steps = counters.num_draft_tokens, counters.num_accepted_tokens, llm.engine.num_steps
            start = time.perf_counter()
            [out] = llm.generate([[{"role": "user", "content": prompt}]], SamplingParams(max_tokens=160, temperature=0))
            seconds = time.perf_counter() - start
            steps = llm.engine.num_steps - steps
            results[name] = (out.token_ids, len(out.token_ids) / seconds, counters.num_draft_tokens - drafted,
                             counters.num_accepted_tokens - accepted, len(out.token_ids) / max(1, steps))
            print(f"  {label:<22} {name:<14} {results[name][1]:6.1f} tok/s", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft-layers", type=int, default=10)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    overrides = dict(parse_override(o) for o in args.set)
    model = load_config(None, overrides).model.path
    with tempfile.TemporaryDirectory() as tmp:
        layers = first_layers(overrides, args.draft_layers, Path(tmp) / "draft")
        modes = {
            "off": {"engine.speculative": "off"},
            "ngram": {"engine.speculative": "ngram"},
            "draft: the model": {"engine.speculative": "draft", "engine.draft_model": model},
            f"draft: {args.draft_layers} layers": {"engine.speculative": "draft", "engine.draft_model": layers},
        }
        results = {label: run(overrides, label, speculative) for label, speculative in modes.items()}
    plain = results["off"]
    print("\n| task | tokens | mode | tok/s | speed-up | accepted | tokens/step | same tokens |\n|---|---|---|---|---|---|---|---|")
    for name in TASKS:
        tokens, off_rate, *_ = plain[name]
        for label, result in results.items():
            spec_tokens, rate, drafted, accepted, per_step = result[name]
            share = f"{accepted}/{drafted}" if drafted else "-"
            print(f"| {name} | {len(tokens)} | {label} | {rate:.1f} | {rate / off_rate:.2f}x | {share} | "
                  f"{per_step:.2f} | {'yes' if tokens == spec_tokens else 'no'} |")


if __name__ == "__main__":
    main()
