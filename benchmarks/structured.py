"""Structured output: the two grammar engines side by side, and what masks cost a batch of 32.

    python benchmarks/structured.py [--requests 32]

1. xgrammar and llguidance on the 30 schemas of tests/data/json_schemas.json
   with SmolLM2's vocabulary: how many each compiles, the time to compile
   (cold, no cache), and the time to fill one token's mask and accept the
   token, along the JSON SmolLM2 writes for each schema (greedy).
2. ``--requests`` chat requests at once through the offline LLM, each
   constrained to a schema (the 30, repeated), then the same prompts
   unconstrained, each held to the token count its constrained run made
   (ignore_eos): output tokens per second of both, and the difference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SCHEMAS = json.loads((Path(__file__).parents[1] / "tests" / "data" / "json_schemas.json").read_text())


def engines(tokenizer, vocab_size: int, outputs: list[list[int]]) -> None:
    import llguidance
    import llguidance.hf
    import llguidance.torch
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.hf)
    eos = sorted(tokenizer.eos_token_ids)
    xgr_info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=eos)
    llg_tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size)

    def xgr_run(schema: str, tokens: list[int]) -> tuple[float, float]:
        compiler = xgr.GrammarCompiler(xgr_info, cache_enabled=False)
        start = time.perf_counter()
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(schema, any_whitespace=False))
        compiled = time.perf_counter()
        mask = xgr.allocate_token_bitmask(1, vocab_size)
        for token in tokens:
            matcher.fill_next_token_bitmask(mask, 0)
            assert matcher.accept_token(token)
        return compiled - start, (time.perf_counter() - compiled) / len(tokens)

    def llg_run(schema: str, tokens: list[int]) -> tuple[float, float]:
        start = time.perf_counter()
        # (the separators xgrammar's compact JSON writes, so that both follow the same tokens)
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        matcher = llguidance.LLMatcher(llg_tokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()
        compiled = time.perf_counter()
        mask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
        for token in tokens:
            llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
            assert matcher.consume_token(token), matcher.get_error()
        return compiled - start, (time.perf_counter() - compiled) / len(tokens)

    print(f"{'engine':<12} {'compiled':>9} {'compile p50 ms':>15} {'max ms':>8} {'mask+accept per token ms':>25}")
    for name, run in (("xgrammar", xgr_run), ("llguidance", llg_run)):
        compile_times, token_times, ok = [], [], 0
        for schema, tokens in zip(SCHEMAS, outputs):
            try:
                compile_s, token_s = run(json.dumps(schema["schema"]), tokens)
            except Exception as e:  # noqa: BLE001 - a schema an engine cannot take counts against it
                print(f"  {name}: {schema['name']}: {type(e).__name__}: {e}")
                continue
            ok += 1
            compile_times.append(compile_s)
            token_times.append(token_s)
        print(f"{name:<12} {ok:>6}/{len(SCHEMAS)} {1e3 * statistics.median(compile_times):>15.2f} "
              f"{1e3 * max(compile_times):>8.2f} {1e3 * statistics.median(token_times):>25.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    args = parser.parse_args()

    from conveyor import LLM
    from conveyor.sampling import SamplingParams, StructuredOutput

    chosen = [SCHEMAS[i % len(SCHEMAS)] for i in range(args.requests)]
    prompts = [[{"role": "user", "content": f"Give an example of a {s['name']} as JSON."}] for s in chosen]
    with LLM() as llm:
        print(f"model {llm.config.model.path}, {args.requests} requests at once")
        llm.generate(prompts[:2], SamplingParams(max_tokens=4))  # (warm up)
        params = [SamplingParams(max_tokens=400, temperature=0, structured=StructuredOutput(json=json.dumps(s["schema"])))
                  for s in chosen]
        start = time.perf_counter()
        llm.generate(prompts, params)
        print(f"first constrained run (grammar engine set up, grammars compiled): {time.perf_counter() - start:.2f} s")
        start = time.perf_counter()
        constrained = llm.generate(prompts, params)
        constrained_s = time.perf_counter() - start
        counts = [len(c.token_ids) for c in constrained]
        plain_params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in counts]
        start = time.perf_counter()
        llm.generate(prompts, plain_params)
        plain_s = time.perf_counter() - start
        total = sum(counts)
        print(f"constrained: {total} tokens in {constrained_s:.2f} s = {total / constrained_s:.1f} tok/s")
        print(f"plain:       {total} tokens in {plain_s:.2f} s = {total / plain_s:.1f} tok/s")
        print(f"masks cost {100 * (constrained_s / plain_s - 1):.1f}% (compiled grammars from the cache)")
        print("\ngrammar engines on the 30 schemas, along SmolLM2's greedy output:")
        stops = llm.tokenizer.eos_token_ids  # (the JSON's tokens, without the stop token that ended it)
        engines(llm.tokenizer, llm.engine.info.vocab_size,
                [[t for t in c.token_ids if t not in stops] for c in constrained[: len(SCHEMAS)]])


if __name__ == "__main__":
    main()
