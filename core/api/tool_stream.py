"""Tool calls read from a reply as it is generated: its text, each call's name once known, its arguments as
they come.

A reply under active tools is text with Hermes blocks in it
(``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``), or, when
``tool_choice`` forces a call, one call object and nothing else. The reader
turns each piece of generated text into parts: ``Text`` outside the calls
(text that may begin a ``<tool_call>`` tag is held back until it is known
not to; whitespace next to a call is dropped), ``CallStart`` once a call's
name is known and its arguments begin, and ``Arguments``, the arguments'
JSON text as it is generated — the concatenation of a call's deltas is its
final ``arguments``. A whole reply read at once gives the same parts, so a
streamed reply and a returned one always agree. A block that turns out not
to be a call (no JSON object, no name) is given back as text.
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from conveyor.api.reasoning import ThinkSplitter

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class Text(NamedTuple):
    text: str


class CallStart(NamedTuple):
    index: int
    id: str
    name: str


class Arguments(NamedTuple):
    index: int
    delta: str


class Reasoning(NamedTuple):
    """A piece of the reply's thinking (where the server has a reasoning parser: ``reasoning``)."""

    text: str


Part = Text | CallStart | Arguments | Reasoning


class _Call:
    """One call object being scanned: a JSON object whose top-level keys ``name`` and ``arguments`` (or
    ``parameters``) are found as its text arrives."""

    def __init__(self) -> None:
        self.raw = ""  # the object's text so far
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.string_start = -1
        self.expect_key = False
        self.key: str | None = None
        self.value_start = -1  # where the current top-level value begins
        self.name: str | None = None
        self.args_start = -1
        self.args_end = -1
        self.closed = False  # the object ended
        self.invalid = False  # it is no call object

    def scan(self, text: str) -> int:
        """Take ``text`` up to the object's closing brace (or to a character no call object has); returns how
        many characters it took."""
        for taken, c in enumerate(text):
            if self.closed or self.invalid:
                return taken
            i = len(self.raw)
            if self.depth == 0 and c != "{" and not c.isspace():
                self.invalid = True
                return taken
            self.raw += c
            self._step(c, i)
        return len(text)

    def _step(self, c: str, i: int) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
                if self.depth == 1:
                    self._string_ended(i)
            return
        if self.depth == 1 and self.value_start < 0 and not self.expect_key and not c.isspace() and c not in ",:}":
            self.value_start = i
            if self.key in ("arguments", "parameters") and self.args_start < 0:
                self.args_start = i
        if c == '"':
            self.in_string, self.string_start = True, i
        elif c in "{[":
            self.depth += 1
            self.expect_key = self.depth == 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 1 and self.value_start == self.args_start >= 0:
                self.args_end = i + 1
            elif self.depth == 0:
                self._value_ended(i)
                self.closed = True
        elif c == "," and self.depth == 1:
            self._value_ended(i)
            self.expect_key = True

    def _string_ended(self, i: int) -> None:
        literal = self.raw[self.string_start:i + 1]
        if self.expect_key:
            self.key, self.expect_key, self.value_start = json.loads(literal), False, -1
        elif self.value_start == self.string_start:
            if self.key == "name" and self.name is None:
                name = json.loads(literal)
                self.name = name if isinstance(name, str) else None
            if self.value_start == self.args_start:
                self.args_end = i + 1

    def _value_ended(self, i: int) -> None:
        """A top-level value ended before ``raw[i]`` (a comma or the object's closing brace)."""
        if self.args_start >= 0 and self.args_end < 0 and self.value_start == self.args_start:
            self.args_end = len(self.raw[:i].rstrip())
        self.value_start = -1

    def arguments(self) -> str:
        """The arguments' text so far: an object or array as it comes, another value (a JSON string is given
        decoded: some models send the arguments' JSON as a string) only once whole; "{}" for a call closed
        without any."""
        if self.args_start < 0:
            return "{}" if self.closed else ""
        if self.raw[self.args_start] in "{[":
            return self.raw[self.args_start:self.args_end if self.args_end >= 0 else len(self.raw)]
        if self.args_end < 0:
            return ""
        value = self.raw[self.args_start:self.args_end]
        return json.loads(value) if value.startswith('"') else value


class ReplyReader:
    """Reads one reply for tool calls, piece by piece (``feed``); ``content`` and ``calls`` hold what it found."""

    def __init__(self, active: bool, forced: bool = False, parallel: bool = True,
                 thinking: ThinkSplitter | None = None):
        """
        Args:
            active: the reply is read for calls (else it is all text).
            forced: the reply is one call object (``tool_choice`` forced it), with no tags.
            parallel: more than one call may be taken (``parallel_tool_calls``); else those after the first are
                left out.
            thinking: a ``reasoning.ThinkSplitter`` that takes the reply's thinking out first (its pieces come as
                ``Reasoning`` parts), or None.
        """
        self.thinking = thinking
        self.active = active
        self.forced = forced
        self.parallel = parallel
        self.content = ""
        # OpenAI-shaped: {"id", "type": "function", "function": {"name", "arguments"}}
        self.calls: list[dict] = []
        self._pending = ""  # text not yet read
        self._space = ""  # whitespace after the content so far: shown only if more content follows
        self._segment_start = True  # whitespace here (the reply's start, after a call) is dropped
        self._call: _Call | None = _Call() if active and forced else None
        self._taken = False  # the current call is one of the calls
        self._sent = 0  # characters of the current call's arguments sent

    def feed(self, text: str, final: bool = False) -> list[Part]:
        """The parts that ``text`` (the reply's next piece) completes; ``final``: the reply ends with it."""
        parts: list[Part] = []
        if self.thinking is not None:
            thought, text = self.thinking.feed(text, final)
            if thought:
                parts.append(Reasoning(thought))
        if not self.active:
            self.content += text
            return parts + [Text(text)] if text else parts
        self._pending += text
        while self._pending:
            call = self._call
            if call is None:  # text, up to the next opening tag
                start = self._pending.find(OPEN)
                if start < 0:
                    keep = 0 if final else partial_tag(self._pending, OPEN)
                    self._text(self._pending[:len(self._pending) - keep], parts)
                    self._pending = self._pending[len(self._pending) - keep:]
                    break
                self._text(self._pending[:start], parts)
                self._pending = self._pending[start + len(OPEN):]
                self._call = _Call()
            elif call.closed:  # a Hermes block's tail, up to its closing tag (nothing follows a forced call)
                end = -1 if self.forced else self._pending.find(CLOSE)
                if end < 0:
                    keep = 0 if self.forced else partial_tag(self._pending, CLOSE)
                    self._pending = self._pending[len(self._pending) - keep:]
                    break
                self._pending = self._pending[end + len(CLOSE):]
                self._call = None
            else:
                self._pending = self._pending[call.scan(self._pending):]
                self._advance(call, parts)
                if call.invalid:
                    self._give_back(call, parts)
                elif not call.closed:
                    break
        if final:
            call = self._call
            if call is not None and not call.closed and not self._taken:
                self._give_back(call, parts)
                self._text(self._pending, parts)
            self._pending, self._call = "", None
        return parts

    def _advance(self, call: _Call, parts: list[Part]) -> None:
        """Take the call once its name is known and its arguments begin (or it closed without any), then send
        what arguments came."""
        if not self._taken and call.name is not None and (call.args_start >= 0 or call.closed):
            if self.calls and not self.parallel:
                return
            self._taken, self._sent, self._space = True, 0, ""
            self.calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            parts.append(CallStart(len(self.calls) - 1, self.calls[-1]["id"], call.name))
        if self._taken:
            arguments = call.arguments()
            if len(arguments) > self._sent:
                delta, self._sent = arguments[self._sent:], len(arguments)
                self.calls[-1]["function"]["arguments"] += delta
                parts.append(Arguments(len(self.calls) - 1, delta))
        if call.closed:
            if call.name is None:
                self._give_back(call, parts)
            else:
                self._taken, self._segment_start = False, True

    def _give_back(self, call: _Call, parts: list[Part]) -> None:
        """A block that is no call: its text, tag and all, is the reply's text."""
        self._call = None
        text, self._space = self._space + ("" if self.forced else OPEN) + call.raw, ""
        self._segment_start = False
        self._text(text, parts)

    def _text(self, text: str, parts: list[Part]) -> None:
        """Text outside the calls: its trailing whitespace waits to see whether more text or a call follows."""
        if self._segment_start:
            text = text.lstrip()
        if not text:
            return
        self._segment_start = False
        body = text.rstrip()
        if body:
            shown, self._space = self._space + body, text[len(body):]
            self.content += shown
            parts.append(Text(shown))
        else:
            self._space += text


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that begins ``tag``."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
