"""A reasoning model's thinking split from its answer, as the reply is generated (``[model] reasoning_parser``).

``"think"``: the thinking is the text inside ``<think>`` ... ``</think>``
(Qwen3, DeepSeek-R1 and its distills, QwQ). A reply that begins with the
opening tag thinks first; so does one whose prompt ends with it (templates
that open the thinking for the model, as DeepSeek-R1's do). The thinking
ends at the closing tag; a reply cut short inside it is all thinking. The
whitespace around the thinking and at the start of the answer is dropped.
The answer goes on to be read for tool calls (``tool_stream``, whose
reader gives the thinking as ``Reasoning`` parts). Under structured output
the reply is not split: the grammar holds from its first token.
"""

from __future__ import annotations

from conveyor.api.tool_stream import partial_tag

PARSERS = ("think",)
OPEN, CLOSE = "<think>", "</think>"


class ThinkSplitter:
    """Splits one reply, piece by piece, into its thinking (``reasoning``) and its answer."""

    def __init__(self, prompt_opens_thinking: bool):
        self.state = "thinking" if prompt_opens_thinking else "start"
        self.reasoning = ""
        self._pending = ""
        self._space = ""  # whitespace inside the thinking, shown only if more thinking follows
        self._lstrip = True  # at the start of the thinking or of the answer

    @property
    def thinking(self) -> bool:
        """The reply is inside its thinking now (or may be: it has not yet shown whether it opens with a tag)."""
        return self.state != "answer"

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The thinking and the answer that ``text``, the reply's next piece, completes."""
        self._pending += text
        if self._lstrip:
            self._pending = self._pending.lstrip()
        thought, answer = "", ""
        if self.state == "start":
            if self._pending.startswith(OPEN):
                self.state, self._pending = "thinking", self._pending[len(OPEN):].lstrip()
            elif OPEN.startswith(self._pending) and not final:
                return "", ""  # (it may yet open with the tag)
            else:
                self.state, self._lstrip = "answer", False
        if self.state == "thinking":
            end = self._pending.find(CLOSE)
            if end < 0:
                keep = 0 if final else partial_tag(self._pending, CLOSE)
                thought = self._think(self._pending[:len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep:]
                return thought, ""
            thought = self._think(self._pending[:end])
            self.state, self._pending = "answer", self._pending[end + len(CLOSE):].lstrip()
            self._lstrip = not self._pending
        if self.state == "answer":
            if self._lstrip:
                self._pending = self._pending.lstrip()
                self._lstrip = not self._pending
            answer, self._pending = self._pending, ""
        return thought, answer

    def _think(self, text: str) -> str:
        if not text:
            return ""
        self._lstrip = False
        body = text.rstrip()
        if not body:
            self._space += text
            return ""
        shown, self._space = self._space + body, text[len(body):]
        self.reasoning += shown
        return shown
