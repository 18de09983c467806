"""The text of a completion as its tokens come, for `mt generate` and `mt serve`: decoded
from all its tokens so far (a character split over tokens appears once whole), cut at the
first stop string, and streamed in pieces that hold back what could still turn into a stop
string or is an unfinished character."""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["TextStream"]


class TextStream:
    """One completion's text. :meth:`push` each new token; it returns the text now safe to
    show. :attr:`stopped` turns True when a stop string appears (the text ends before it)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()) -> None:
        self.decode, self.stop = decode, tuple(s for s in stop if s)
        self.tokens: list[int] = []
        self.text, self.shown, self.stopped = "", 0, False

    def push(self, token: int) -> str:
        """Add ``token``; the new text that is safe to show (may be empty)."""
        if self.stopped:
            return ""
        self.tokens.append(token)
        text = self.decode(self.tokens)
        cut = min((text.index(s) for s in self.stop if s in text), default=None)
        if cut is not None:
            self.text, self.stopped = text[:cut], True
            return self.flush()
        self.text = text
        hold = max((self._partial(s, text) for s in self.stop), default=0)
        if text.endswith("\ufffd"):  # part of a character whose next bytes are to come
            hold = max(hold, len(text) - len(text.rstrip("\ufffd")))
        return self._show(len(text) - hold)

    @staticmethod
    def _partial(stop: str, text: str) -> int:
        """The length of the longest start of ``stop`` (shorter than it) that ``text`` ends
        with: at most ``len(text)`` tries, however long the stop string."""
        return next((k for k in range(min(len(stop) - 1, len(text)), 0, -1)
                     if text.endswith(stop[:k])), 0)

    def flush(self) -> str:
        """The rest of the text (at the end of the completion)."""
        return self._show(len(self.text))

    def _show(self, upto: int) -> str:
        delta = self.text[self.shown:upto] if upto > self.shown else ""
        self.shown = max(self.shown, upto)
        return delta

    def kept(self) -> int:
        """How many tokens the text covers (all, unless a stop string cut it: then the
        fewest whose text holds all of it)."""
        if not self.stopped:
            return len(self.tokens)
        return next(n for n in range(len(self.tokens) + 1)
                    if self.decode(self.tokens[:n]).startswith(self.text))
