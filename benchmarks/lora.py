"""LoRA adapters: what serving under adapters costs, alone and with several in one batch.

    python benchmarks/lora.py [--rank 16] [--requests 32] [--tokens 64] [--set KEY=VALUE ...]

Writes random PEFT-format adapters for the default model (every projection
of every layer, rank ``--rank``) to a temporary directory, then runs the
same greedy chats through the offline LLM: with LoRA off, with 4 slots but
every request on the base model, every request under one adapter, and the
requests spread over 4 adapters (each step holds all four). Prints output
tokens per second for one request at a time and for all at once, and the
memory the slots take.
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

QUESTIONS = ["Why is the sky blue?", "What is a list in Python?", "Name three rivers in Europe.",
             "How do plants make food?", "What is the capital of Japan?", "Explain gravity simply.",
             "What does a compiler do?", "Why do cats purr?"]
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: Path, spec, rank: int, seed: int) -> None:
    """A random adapter on every projection (small enough that the model still speaks)."""
    generator = torch.Generator().manual_seed(seed)
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    shapes = {"q_proj": (spec.hidden_size, q), "k_proj": (spec.hidden_size, kv), "v_proj": (spec.hidden_size, kv),
              "o_proj": (q, spec.hidden_size), "gate_proj": (spec.hidden_size, spec.intermediate_size),
              "up_proj": (spec.hidden_size, spec.intermediate_size), "down_proj": (spec.intermediate_size,
                                                                                  spec.hidden_size)}
    tensors = {}
    for layer in range(spec.num_layers):
        for module, (inputs, outputs) in shapes.items():
            kind = "mlp" if module.endswith(("gate_proj", "up_proj", "down_proj")) else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{kind}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inputs, generator=generator) / inputs**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(outputs, rank, generator=generator) * 0.01
    path.mkdir(parents=True)
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(MODULES), "bias": "none"}))


def run(label: str, overrides: dict, adapters: list[str | None], requests: int, tokens: int) -> tuple[float, float]:
    prompts = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(requests)]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    lora = [adapters[i % len(adapters)] for i in range(requests)]
    with LLM(overrides=overrides) as llm:
        llm.generate(prompts[: len(adapters)], params, lora=lora[: len(adapters)])  # (warm up; adapters loaded)
        start = time.perf_counter()
        for i in range(min(4, requests)):
            llm.generate([prompts[i]], params, lora=lora[i])
        alone = min(4, requests) * tokens / (time.perf_counter() - start)
        start = time.perf_counter()
        llm.generate(prompts, params, lora=lora)
        together = requests * tokens / (time.perf_counter() - start)
    print(f"  {label:<28} one at a time {alone:7.1f} tok/s   {requests} at once {together:7.1f} tok/s", flush=True)
    return alone, together


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    overrides = dict(parse_override(o) for o in args.set)
    config = load_config(None, overrides)
    spec = open_model(config.model, config.source).spec
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"a{i}" for i in range(4)]
        for i, name in enumerate(names):
            write_adapter(Path(tmp) / name, spec, args.rank, seed=i)
        lora = {"lora.max_loras": 4, "lora.max_lora_rank": args.rank,
                "lora.adapters": {name: str(Path(tmp) / name) for name in names}}
        cases = [("LoRA off", overrides, [None]),
                 ("4 slots, base model only", {**overrides, **lora}, [None]),
                 ("one adapter", {**overrides, **lora}, ["a0"]),
                 ("four adapters in each step", {**overrides, **lora}, names)]
        results = {label: run(label, config, adapters, args.requests, args.tokens) for label, config, adapters in cases}
    off_alone, off_together = results["LoRA off"]
    print(f"\n| case | one at a time (tok/s) | {args.requests} at once (tok/s) |\n|---|---|---|")
    for label, (alone, together) in results.items():
        print(f"| {label} | {alone:.1f} ({alone / off_alone:.2f}x) | {together:.1f} ({together / off_together:.2f}x) |")


if __name__ == "__main__":
    main()
