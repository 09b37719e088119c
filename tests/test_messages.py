"""The pipe's framing: whatever way the bytes arrive, the reader yields each frame's message once,
in order, and an unreadable frame becomes a BadFrame without ending the stream."""

from __future__ import annotations

import pytest

from llmserve.engine.messages import (
    HEADER,
    MAX_FRAME,
    AbortRequests,
    BadFrame,
    FrameReader,
    GetStats,
    ToCore,
    frame,
)


def messages_of(pieces: list[bytes]) -> list:
    reader = FrameReader(ToCore)
    return [m for p in pieces for m in reader.feed(p)]


MSGS = [AbortRequests(["a", "b"]), GetStats(7), AbortRequests(["x" * 5000])]
WIRE = b"".join(frame(m) for m in MSGS)


@pytest.mark.parametrize("size", [1, 3, 4, 5, 17, 4096, len(WIRE)])
def test_frames_split_anywhere_decode_in_order(size):
    pieces = [WIRE[i : i + size] for i in range(0, len(WIRE), size)]
    assert messages_of(pieces) == MSGS


def test_a_bad_frame_is_reported_and_the_next_one_still_read():
    body = b"\x92\xa5nope!\x01"
    got = messages_of([frame(MSGS[0]) + HEADER.pack(len(body)) + body + frame(MSGS[1])])
    assert got[0] == MSGS[0] and got[2] == MSGS[1]
    assert isinstance(got[1], BadFrame) and got[1].body == body


def test_an_oversized_header_is_refused_even_when_it_arrives_in_pieces():
    header = HEADER.pack(MAX_FRAME + 1)
    reader = FrameReader(ToCore)
    assert reader.feed(header[:2]) == []
    with pytest.raises(ValueError):
        reader.feed(header[2:])
