"""Incremental detokenization and stop strings, with SmolLM2's real tokenizer."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.model.detokenizer import TextStream
from conveyor.sampling import SamplingParams

TEXTS = [
    "Plain ASCII text, with punctuation!",
    "naïve café — “quotes” 日本語の文章 🤖🎉 emoji",
    "mixed 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and Ω≈ç√∫ symbols\n\tindented",
]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_are_whole_characters_and_add_up_to_the_text(tokenizer, text):
    ids = tokenizer.encode(text)
    stream = TextStream(tokenizer, SamplingParams())
    deltas = [stream.add([token]) for token in ids]
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    if not text.isascii():  # some token ended inside a multi-byte character and showed nothing yet
        assert "" in deltas


def test_stop_string_split_across_tokens_is_held_back_then_cut(tokenizer):
    text = "The answer is 42. END of story"
    ids = tokenizer.encode(text)
    stream = TextStream(tokenizer, SamplingParams(stop=["END of"]))
    shown = ""
    for token in ids:
        shown += stream.add([token])
        assert "END" not in shown, "text that may start a stop string was shown too early"
        if stream.stopped:
            break
    assert stream.stopped
    assert shown == stream.text == "The answer is 42. "


def test_held_back_text_is_released_when_it_is_not_a_stop(tokenizer):
    stream = TextStream(tokenizer, SamplingParams(stop=["STOP here"]))
    ids = tokenizer.encode("We STOP")
    shown = "".join(stream.add([t]) for t in ids)
    assert shown == "We "  # " STOP" could still become "STOP here"
    shown += stream.add(tokenizer.encode(" now"))
    assert shown == "We STOP now" and not stream.stopped


def test_final_flushes_what_was_held_back(tokenizer):
    stream = TextStream(tokenizer, SamplingParams(stop=["xyz"]))
    shown = stream.add(tokenizer.encode("abc x"))
    shown += stream.add([], final=True)
    assert shown == "abc x"


@settings(max_examples=60, deadline=None)
@given(text=st.text(min_size=1, max_size=40), stop=st.text(min_size=1, max_size=4))
def test_stop_strings_against_a_simple_reference(tokenizer, text, stop):
    """Streaming with stop strings shows exactly the text before the first stop (or all of it)."""
    ids = tokenizer.encode(text)
    full = tokenizer.decode(ids)
    stream = TextStream(tokenizer, SamplingParams(stop=[stop]))
    shown = "".join(stream.add([t]) for t in ids) + stream.add([], final=True)
    expected = full[: full.index(stop)] if stop in full else full
    assert shown == expected
    assert stream.stopped == (stop in full)


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet="ab c", min_size=1, max_size=30),
       stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=3), min_size=1, max_size=3, unique=True))
def test_the_stop_string_that_ended_the_text_is_named(tokenizer, text, stops):
    """Of several stop strings, the one that ended the text is named (Anthropic's stop_sequence): the text stops
    where it begins, and holds no stop string."""
    ids = tokenizer.encode(text)
    full = tokenizer.decode(ids)
    stream = TextStream(tokenizer, SamplingParams(stop=stops))
    shown = "".join(stream.add([t]) for t in ids) + stream.add([], final=True)
    if not any(s in full for s in stops):
        assert stream.matched is None and shown == full
        return
    assert stream.matched in stops and full.startswith(shown + stream.matched)
    assert not any(s in shown for s in stops)


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet="ab c.", min_size=1, max_size=30), stop=st.text(alphabet="ab c.", min_size=1, max_size=3),
       min_tokens=st.integers(0, 6))
def test_stop_strings_count_from_the_min_tokens_th_token_on(tokenizer, text, stop, min_tokens):
    """As vLLM: before min_tokens tokens no stop string ends the text, and one that begins in the text of the
    tokens before the min_tokens-th does not either."""
    ids = tokenizer.encode(text)
    full = tokenizer.decode(ids)
    before = len(tokenizer.decode(ids[: max(0, min_tokens - 1)]))
    stream = TextStream(tokenizer, SamplingParams(stop=[stop], min_tokens=min_tokens))
    shown = "".join(stream.add([t]) for t in ids) + stream.add([], final=True)
    at = full.find(stop, before)
    assert shown == (full[:at] if at >= 0 else full)
    assert stream.stopped == (at >= 0)


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet="ab c.", min_size=1, max_size=30), stop=st.text(alphabet="ab c.", min_size=1, max_size=3))
def test_include_stop_str_in_output_ends_the_text_after_the_stop(tokenizer, text, stop):
    ids = tokenizer.encode(text)
    full = tokenizer.decode(ids)
    stream = TextStream(tokenizer, SamplingParams(stop=[stop], include_stop_str_in_output=True))
    shown = "".join(stream.add([t]) for t in ids) + stream.add([], final=True)
    assert shown == (full[: full.index(stop) + len(stop)] if stop in full else full)


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_that_ends_the_request_is_not_text(tokenizer, include):
    """As vLLM: the text of the stop_token_ids token the engine ended the request on is left out (kept with
    include_stop_str_in_output); the same token earlier, where it ended nothing, is text."""
    ids = tokenizer.encode("One. Two. Three.")
    dot = tokenizer.encode(".")[0]
    assert ids.count(dot) == 3 and ids[-1] == dot
    stream = TextStream(tokenizer, SamplingParams(stop_token_ids=[dot], include_stop_str_in_output=include))
    shown = "".join(stream.add([t]) for t in ids[:-1]) + stream.add(ids[-1:], final=True)
    assert shown == ("One. Two. Three." if include else "One. Two. Three")
