"""SamplingParams: how one request picks its tokens (fields named as in the OpenAI API)."""

from __future__ import annotations

import msgspec

MAX_LOGPROBS = 20
# what one request may ask the detokenizer and the sampler to watch for (each costs work per token)
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_CHOICES = 256
# presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range)
MAX_PENALTY = 2.0
# logit_bias: biases lie in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's range), for at most this many tokens
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 1024
# SamplingParams.pooling: "" generates tokens
POOLING = ("", "last", "mean")


class StructuredOutput(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True, frozen=True):
    """The language the output must be in: exactly one field set (OpenAI's ``response_format`` and vLLM's
    ``guided_*`` / ``structured_outputs`` fields map here)."""

    # a JSON Schema, as JSON text
    json: str | None = None
    # any JSON object
    json_object: bool = False
    # a regular expression the whole output matches
    regex: str | None = None
    # exactly one of these strings
    choice: list[str] | None = None
    # an EBNF grammar (GBNF style; the start rule is ``root``)
    grammar: str | None = None

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        _check(len(kinds) == 1, f"structured output takes exactly one of json, json_object, regex, choice, grammar;"
                                f" got {', '.join(kinds) or 'none'}")
        _check(self.choice is None or (self.choice and all(isinstance(c, str) and c for c in self.choice)),
               "choice must be a non-empty list of non-empty strings")
        _check(self.choice is None or len(self.choice) <= MAX_CHOICES,
               f"choice has {len(self.choice or [])} strings; at most {MAX_CHOICES} are allowed")


class SamplingParams(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """Per-request sampling settings; out-of-range values raise ValueError naming the field."""

    # most tokens to generate; None: until max_model_len
    max_tokens: int | None = 16
    # 0: greedy
    temperature: float = 1.0
    # nucleus: keep the smallest set of tokens whose probability reaches top_p
    top_p: float = 1.0
    # keep the k most likely tokens; 0 or -1: all
    top_k: int = 0
    # drop tokens less likely than min_p x the most likely one
    min_p: float = 0.0
    # per-request seed: the same seed and prompt give the same tokens
    seed: int | None = None
    # >1 discourages tokens already in the prompt or output (divides positive logits)
    repetition_penalty: float = 1.0
    # subtracted from the logit of every token already generated
    presence_penalty: float = 0.0
    # subtracted once per earlier occurrence in the output
    frequency_penalty: float = 0.0
    # token id -> a bias added to its logit before sampling (OpenAI's logit_bias: -100 all but bans it, +100 all
    # but forces it); logprobs stay the model's
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)
    # generation ends before any of these strings (not included in the text)
    stop: str | list[str] = msgspec.field(default_factory=list)
    # generation ends after any of these tokens
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    # the text ends with the stop string (or stop token) that ended it, rather than before it
    include_stop_str_in_output: bool = False
    # keep going past the end-of-sequence token
    ignore_eos: bool = False
    # neither end-of-sequence nor a stop token comes before this many tokens (the sampler masks them)
    min_tokens: int = 0
    # return the chosen token's logprob and this many most likely alternatives
    logprobs: int | None = None
    # return, for every prompt token after the first, its logprob given the tokens before it and this many
    # most likely alternatives (such a request is computed in full: it does not use the prefix cache)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # constrain the output to a JSON schema, a regex, a choice or a grammar
    structured: StructuredOutput | None = None
    # an embedding instead of tokens: the prompt's final hidden states pooled, "last" (the last token's) or
    # "mean" (every token's; such a request is computed in full: it does not use the prefix cache); the
    # request ends after its prompt with the vector (float32) and no token
    pooling: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(self.max_tokens is None or self.max_tokens >= 1, f"max_tokens={self.max_tokens} must be >= 1")
        _check(self.temperature >= 0, f"temperature={self.temperature} must be >= 0")
        _check(0 < self.top_p <= 1, f"top_p={self.top_p} must be in (0, 1]")
        _check(self.top_k >= -1, f"top_k={self.top_k} must be -1 or 0 (off) or >= 1")
        _check(0 <= self.min_p <= 1, f"min_p={self.min_p} must be in [0, 1]")
        _check(self.repetition_penalty > 0, f"repetition_penalty={self.repetition_penalty} must be > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-MAX_PENALTY <= value <= MAX_PENALTY, f"{name}={value} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")
        _check(self.min_tokens >= 0, f"min_tokens={self.min_tokens} must be >= 0")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               f"min_tokens={self.min_tokens} must be at most max_tokens={self.max_tokens}")
        _check(self.seed is None or -(2**63) <= self.seed < 2**63, f"seed={self.seed} must fit in 64 bits, signed")
        _check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            f"logprobs={self.logprobs} must be in [0, {MAX_LOGPROBS}]",
        )
        _check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
            f"prompt_logprobs={self.prompt_logprobs} must be in [0, {MAX_LOGPROBS}]",
        )
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty")
        _check(len(self.stop) <= MAX_STOP_STRINGS,
               f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
        _check(all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
               f"stop strings may have at most {MAX_STOP_STRING_CHARS} characters each")
        _check(self.pooling in POOLING, f"pooling={self.pooling!r} must be one of {', '.join(map(repr, POOLING))}")
        _check(not self.pooling or self.structured is None, "pooling takes no structured output")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be >= 0")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
               f"stop_token_ids has {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
        self._check_logit_bias()

    def _check_logit_bias(self) -> None:
        """Token ids (OpenAI's JSON gives them as strings) become ints; each id and bias is checked."""
        if not self.logit_bias:
            return
        _check(len(self.logit_bias) <= MAX_LOGIT_BIAS_TOKENS,
               f"logit_bias has {len(self.logit_bias)} tokens; at most {MAX_LOGIT_BIAS_TOKENS} are allowed")
        biases = {}
        for token, bias in self.logit_bias.items():
            token_id = _token_id(token)
            _check(token_id is not None, f"logit_bias has the key {token!r}; keys must be token ids")
            _check(token_id >= 0, f"logit_bias has the token id {token_id}; token ids must be >= 0")
            # (ids travel to the engine as 64-bit msgpack ints)
            _check(token_id < 2**63, f"logit_bias has the token id {token_id}, which is outside any vocabulary")
            _check(isinstance(bias, (int, float)) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS,
                   f"logit_bias has the bias {bias!r} for token {token_id}; biases must be in "
                   f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
            biases[token_id] = float(bias)
        self.logit_bias = biases

    def check_vocabulary(self, vocab_size: int) -> None:
        """Raise ValueError naming a ``logit_bias`` token id outside ``0..vocab_size - 1`` (the frontend checks
        what SamplingParams alone cannot know)."""
        for token_id in self.logit_bias:
            _check(token_id < vocab_size,
                   f"logit_bias has the token id {token_id}, which is outside the vocabulary (0..{vocab_size - 1})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


def _token_id(key: object) -> int | None:
    """A logit_bias key as a token id: an int, or a string of one; None for anything else."""
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        return int(key)
    return key if isinstance(key, int) and not isinstance(key, bool) else None


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
