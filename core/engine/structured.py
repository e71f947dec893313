"""Structured output: the tokens a request may take next, from a grammar (xgrammar).

A request's ``SamplingParams.structured`` names a language: a JSON schema,
any JSON object, a regex, a choice of strings or an EBNF grammar. The
engine core compiles it against the model's vocabulary off the step loop (a
thread; compiled grammars are cached): that compile is the one parse a
request gets, and one that fails ends the request with a 400 naming what
does not compile. The frontend never parses a language: xgrammar imports
torch, which the serving process never loads. The engine keeps one matcher
per request, and before each step that samples for such a request fills
that request's row of a token bitmask; the worker's sampler masks the
logits with it (``conveyor.worker.sampler.apply_bitmask``). Each sampled token advances the matcher.

NOTE: xgrammar over llguidance (both from PyPI; benchmarks/structured.py
measures them on tests/data/json_schemas.json with SmolLM2's vocabulary):
both compile all 30 schemas; xgrammar fills a mask and accepts a token in
about 0.015 ms against llguidance's 0.08-0.12 ms, which matters at 32
requests a step; llguidance compiles lazily (0.4 ms against 6 ms, which the
cache and the thread hide here).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

import torch

from conveyor.sampling import StructuredOutput

if TYPE_CHECKING:
    import xgrammar

    from conveyor.model.tokenizer import Tokenizer


# the characters a shortest completion tries, closers first: what ends a string, an object or an array, then
# the shortest values and separators, then the rest (a pattern that needs them)
CLOSING_ORDER = ('"}]0,: ' + "abcdefghijklmnopqrstuvwxyz" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ" + "123456789"
                 + "-.+_@/\\\n\t{[()<>=!?#$%&*;'`^|~")
# the first characters of CLOSING_ORDER, each tried for whether it completes the grammar at once
CLOSERS = 8
# the longest completion looked for, in characters
MAX_CLOSING_CHARS = 512


def _choice_regex(choices: list[str]) -> str:
    return "|".join(f"({re.escape(c)})" for c in choices)


def _schema_text(schema: str) -> str:
    try:
        value = json.loads(schema)
    except json.JSONDecodeError as e:
        raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("the JSON schema must be an object")  # noqa: TRY004 - a 400, not a bug
    return schema


class Grammars:
    """The engine core's side: compiled grammars, one matcher per request, bitmasks per step."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        """
        Args:
            vocab_size: the model's logits width (the tokenizer's vocabulary padded; padding is never allowed).
        """
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        # (xgrammar reads the vocabulary's encoding, byte-level or byte-fallback, from the tokenizer's JSON)
        info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tokenizer.hf),
                                                  vocab_size=vocab_size,
                                                  stop_token_ids=sorted(tokenizer.eos_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer

    def compile(self, spec: StructuredOutput) -> xgrammar.CompiledGrammar:
        """The language against the vocabulary (cached: the same spec compiles once).

        Raises:
            ValueError: the schema, regex or grammar does not compile; the message names which, and where.
        """
        if spec.json is not None:
            _schema_text(spec.json)  # (says what is wrong in words of its own)
        try:
            return self._compile(spec)
        except (RuntimeError, ValueError) as e:
            kind = "JSON schema" if spec.json is not None else "regex" if spec.regex is not None else "grammar"
            raise ValueError(f"the {kind} cannot be compiled: {str(e).strip()}") from None

    def _compile(self, spec: StructuredOutput) -> xgrammar.CompiledGrammar:
        compiler = self.compiler
        if spec.json is not None:
            return compiler.compile_json_schema(spec.json, any_whitespace=False)
        if spec.json_object:
            return compiler.compile_builtin_json_grammar()
        if spec.regex is not None:
            return compiler.compile_regex(spec.regex)
        if spec.choice is not None:
            return compiler.compile_regex(_choice_regex(spec.choice))
        return compiler.compile_grammar(spec.grammar)

    @staticmethod
    def matcher(compiled: xgrammar.CompiledGrammar) -> xgrammar.GrammarMatcher:
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    def closing(self, matcher: xgrammar.GrammarMatcher) -> list[int] | None:
        """The tokens of a short text that completes the grammar from the matcher's state (the matcher is left
        as it is), or None when none is found. Built a character at a time: the grammar's forced text where
        there is one, else a character that completes it, else the first that ``CLOSING_ORDER`` allows
        (closers and the shortest values first: for JSON this closes what is open with the least it may)."""
        state = matcher.fork()
        text: list[str] = []
        size = 0
        while not state.is_completed():
            if size > MAX_CLOSING_CHARS:
                return None
            forced = state.find_jump_forward_string()
            if forced:
                state.accept_string(forced)
                text.append(forced)
                size += len(forced)
                continue
            allowed = None
            for index, char in enumerate(CLOSING_ORDER):
                if allowed is not None and index >= CLOSERS:
                    break  # (past the closers: the first character allowed will do)
                trial = state.fork()
                if not trial.accept_string(char):
                    continue
                if trial.is_completed():
                    allowed = trial, char
                    break
                allowed = allowed or (trial, char)
            if allowed is None:
                return None
            state = allowed[0]
            text.append(allowed[1])
            size += 1
        return self.tokenizer.encode("".join(text), add_special_tokens=False) if text else []

    def bitmask(self, matchers: list[xgrammar.GrammarMatcher]) -> torch.Tensor:
        """``[len(matchers), ceil(vocab / 32)]`` int32: bit t of a row is set where token t may come next."""
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        for row, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(mask, row)
        return mask
