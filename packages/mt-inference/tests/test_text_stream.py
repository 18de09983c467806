"""TextStream: what `mt generate` and `mt serve` stream, and where a stop string cuts."""

from __future__ import annotations

from mt_inference.text import TextStream

# Token i is the i-th byte string: a character split over two tokens, a stop string split too.
PIECES = [b"Hello", b" wor", b"ld", b"\xc3", b"\xa9", b"\n", b"\n", b"Q:", b" more"]


def _decode(tokens: list[int]) -> str:
    return b"".join(PIECES[t] for t in tokens).decode("utf-8", errors="replace")


def test_streams_whole_characters_and_cuts_at_a_stop_string() -> None:
    stream = TextStream(_decode, stop=["\n\nQ:"])
    shown = [stream.push(t) for t in range(len(PIECES))]
    assert shown[:3] == ["Hello", " wor", "ld"]
    assert shown[3] == "" and shown[4] == "\u00e9"  # held until the character is whole
    assert shown[5] == shown[6] == ""  # could be the start of the stop string
    assert shown[7] == "" and stream.stopped and shown[8] == ""
    assert "".join(shown) + stream.flush() == stream.text == "Hello world\u00e9"
    assert stream.kept() == 5  # the tokens up to the text before the stop string


def test_held_text_is_released_when_no_stop_string_follows() -> None:
    stream = TextStream(_decode, stop=["\n\nX"])
    shown = "".join(stream.push(t) for t in range(len(PIECES)))
    assert not stream.stopped and shown + stream.flush() == _decode(list(range(9)))
    assert stream.kept() == 9
