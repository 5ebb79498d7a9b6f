"""A fake sequence's text: its tokens spelt incrementally by the model's tokenizer, cut
at the first stop string (which, as in vLLM, the output does not include)."""

from __future__ import annotations

from typing import Any


class TextStream:
    def __init__(self, tokenizer: Any | None, stop: tuple[str, ...], skip_special: bool) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        self._decoder: Any = None
        if tokenizer is not None:
            from tokenizers.decoders import DecodeStream

            self._decoder = DecodeStream(skip_special_tokens=skip_special)
        self._text = ""
        self._sent = 0
        self.stopped = False
        """A stop string was found: the sequence ends with this delta."""

    def delta(self, token_ids: list[int]) -> str:
        """The new text that ``token_ids`` add (up to a stop string)."""
        if self._decoder is None or self.stopped:
            return ""
        for token in token_ids:
            piece = self._decoder.step(self._tokenizer, token)
            if piece:
                self._text += piece
        end = len(self._text)
        for stop in self._stop:
            found = self._text.find(stop, max(0, self._sent - len(stop) + 1))
            if found != -1 and found < end:
                end, self.stopped = found, True
        delta = self._text[self._sent : end]
        self._sent = max(self._sent, end)
        return delta
