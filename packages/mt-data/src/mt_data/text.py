"""Whether a Python string is Unicode text that UTF-8 (and so every tokenizer) can carry.

A ``str`` can hold what is not text: a lone UTF-16 surrogate, which JSON's ``\\udXXX``
escapes allow, and bytes that were not UTF-8 where Python decoded them with
``surrogateescape`` (command-line arguments, file names), each such byte as ``\\udcXX``.
"""

from __future__ import annotations

__all__ = ["not_utf8"]


def not_utf8(text: str) -> str | None:
    """What in ``text`` is not Unicode text, described with its place, or None: ``a lone
    surrogate \\ud800 at character 7``; for a byte Python kept with ``surrogateescape``,
    ``the byte 0xff, not UTF-8, at character 3``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(text[err.start])
        if 0xDC80 <= code <= 0xDCFF:
            return f"the byte {code - 0xDC00:#04x}, not UTF-8, at character {err.start}"
        return f"a lone surrogate \\u{code:04x} at character {err.start}"
    return None
