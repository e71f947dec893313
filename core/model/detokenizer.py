"""Incremental detokenization with stop strings."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from conveyor.model.tokenizer import Tokenizer
from conveyor.sampling import SamplingParams


class TextStream:
    """Turns one request's tokens into text as they arrive.

    Multi-byte characters split across tokens are held until complete (the
    ``tokenizers`` DecodeStream). Text that could be the start of a stop
    string is held back until it is known not to be one; a stop string ends
    the text before it (after it with ``include_stop_str_in_output``). As in
    vLLM, stop strings are looked for only from the ``min_tokens``-th token's
    text on, and the text of a ``stop_token_ids`` token that ends the request
    is left out (kept with ``include_stop_str_in_output``).
    """

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams):
        self.tokenizer = tokenizer
        self.decoder = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self.skip_special_tokens = params.skip_special_tokens
        self.stops: list[str] = list(params.stop)
        self.stop_token_ids = set(params.stop_token_ids)
        self.min_tokens = params.min_tokens
        self.include_stop = params.include_stop_str_in_output
        self.token_ids: list[int] = []
        self.text = ""
        # characters of `text` already returned
        self.num_emitted = 0
        # the text before the min_tokens-th token's, where no stop string is looked for
        self.searched_from = 0
        self.stopped = False
        # the stop string that ended the text (None: none did)
        self.matched: str | None = None

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """Feed new tokens; return the text that is now safe to show (``final``: the request's last tokens).

        After a stop string appears, ``stopped`` is True and later tokens are ignored.
        """
        if final and token_ids and token_ids[-1] in self.stop_token_ids and not self.include_stop:
            token_ids = token_ids[:-1]  # (the engine ended the request on it: a stop token id is not text)
        for token_id in token_ids:
            if self.stopped:
                break
            self.token_ids.append(token_id)
            piece = self.decoder.step(self.tokenizer.hf, token_id)
            if piece:
                self._append(piece)
            if len(self.token_ids) < self.min_tokens:
                self.searched_from = len(self.text)
        if final and not self.stopped:
            # Bytes that never formed a valid character are still pending in
            # the stream; the full decode shows them as U+FFFD.
            full = self.tokenizer.decode(self.token_ids, self.skip_special_tokens)
            if full.startswith(self.text) and len(full) > len(self.text):
                self._append(full[len(self.text) :])
        if self.stopped or final:
            end = len(self.text)
        else:
            end = len(self.text) - self._held_back()
        delta = self.text[self.num_emitted : end]
        self.num_emitted = max(self.num_emitted, end)
        return delta

    def _append(self, piece: str) -> None:
        longest = max((len(s) for s in self.stops), default=0)
        search_from = max(self.searched_from, len(self.text) - longest + 1)
        self.text += piece
        if not self.stops or len(self.token_ids) < self.min_tokens:
            return
        hits = [(i, s) for s in self.stops if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            end, self.matched = min(hits)
            self.text = self.text[: end + len(self.matched) if self.include_stop else end]
            self.stopped = True

    def _held_back(self) -> int:
        """Length of the longest tail of the text that begins some stop string (a tail where stop strings are
        looked for)."""
        tail = self.text[max(self.num_emitted, self.searched_from) :]
        for size in range(min(len(tail), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            if any(s.startswith(tail[-size:]) for s in self.stops):
                return size
        return 0
