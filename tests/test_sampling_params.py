"""SamplingParams validation: out-of-range values name the field and the allowed range."""

from __future__ import annotations

import msgspec
import pytest

from conveyor.sampling import SamplingParams


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("temperature", -0.1, "temperature=-0.1 must be >= 0"),
        ("top_p", 0.0, "top_p=0.0 must be in (0, 1]"),
        ("top_p", 1.5, "top_p=1.5 must be in (0, 1]"),
        ("top_k", -2, "top_k=-2 must be -1 or 0 (off) or >= 1"),
        ("min_p", 1.1, "min_p=1.1 must be in [0, 1]"),
        ("max_tokens", 0, "max_tokens=0 must be >= 1"),
        ("repetition_penalty", 0.0, "repetition_penalty=0.0 must be > 0"),
        ("presence_penalty", 3.0, "presence_penalty=3.0 must be in [-2, 2]"),
        ("frequency_penalty", -2.5, "frequency_penalty=-2.5 must be in [-2, 2]"),
        ("logprobs", 21, "logprobs=21 must be in [0, 20]"),
        ("stop", [""], "stop strings must be non-empty"),
        ("stop", [f"s{i}" for i in range(17)], "stop has 17 strings; at most 16 are allowed"),
        ("stop", ["x" * 257], "stop strings may have at most 256 characters each"),
        ("stop_token_ids", list(range(65)), "stop_token_ids has 65 ids; at most 64 are allowed"),
        ("min_tokens", -1, "min_tokens=-1 must be >= 0"),
        ("seed", 2**64, f"seed={2**64} must fit in 64 bits, signed"),
        ("min_tokens", 17, "min_tokens=17 must be at most max_tokens=16"),
        ("seed", -(2**63) - 1, f"seed={-(2**63) - 1} must fit in 64 bits, signed"),
    ],
)
def test_out_of_range_values_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        SamplingParams(**{field: value})


def test_a_choice_list_is_bounded():
    from conveyor.sampling import StructuredOutput

    with pytest.raises(ValueError, match="choice has 257 strings; at most 256 are allowed"):
        StructuredOutput(choice=[str(i) for i in range(257)])


def test_decoding_from_json_validates_too():
    with pytest.raises(msgspec.ValidationError, match="temperature=-1"):
        msgspec.json.decode(b'{"temperature": -1}', type=SamplingParams)
    with pytest.raises(msgspec.ValidationError, match="unknown field `temprature`"):
        msgspec.json.decode(b'{"temprature": 1}', type=SamplingParams)


def test_a_single_stop_string_becomes_a_list_and_survives_msgpack():
    params = SamplingParams(stop="END", seed=3, logprobs=2)
    assert params.stop == ["END"]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams) == params


def test_the_widest_seeds_are_taken():
    """The 64-bit bounds themselves are seeds (the sampler's generator takes them)."""
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1 and SamplingParams(seed=-(2**63)).seed == -(2**63)
