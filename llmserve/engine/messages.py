"""Messages between the server process and the engine-core process, and their framing.

Wire: each message is one frame, `u32 little-endian length | msgpack body` (msgspec, typed
decoding: never pickle). Over one pipe each way:

  server -> core   Configure (the first frame), then AddRequest | AbortRequests | GetStats | Shutdown
  core -> server   Ready | StartupFailed (once), then StepOutputs (one per engine step: every
                   request's new tokens) | StatsReply
"""

from __future__ import annotations

import os
import select
import struct

import msgspec

from llmserve.config import EngineConfig
from llmserve.engine.admission import EngineCoreRequest, EngineInfo
from llmserve.engine.outputs import EngineStats, RequestOutput

HEADER = struct.Struct("<I")
MAX_FRAME = 1 << 30


class Configure(msgspec.Struct, tag="config", array_like=True):
    config: EngineConfig
    log_level: str


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request: EngineCoreRequest


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class GetStats(msgspec.Struct, tag="stats", array_like=True):
    call_id: int


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class Ready(msgspec.Struct, tag="ready", array_like=True):
    info: EngineInfo


class StartupFailed(msgspec.Struct, tag="failed", array_like=True):
    error_type: str  # an llmserve.errors class name, or "internal"
    message: str


class StepOutputs(msgspec.Struct, tag="step", array_like=True):
    outputs: list[RequestOutput]
    stats: EngineStats  # after the step
    step_durations: list[float]  # seconds, of each engine step since the last StepOutputs
    rejected: list[tuple[str, str]]  # (request_id, message): refused by the core (an unreadable adapter or frame)
    stage_seconds: list[float]  # those steps' time in each profiling.STAGES stage, summed


class StatsReply(msgspec.Struct, tag="stats_reply", array_like=True):
    call_id: int
    stats: EngineStats


ToCore = Configure | AddRequest | AbortRequests | GetStats | Shutdown
FromCore = Ready | StartupFailed | StepOutputs | StatsReply

_encoder = msgspec.msgpack.Encoder()


def frame(msg: object) -> bytes:
    body = _encoder.encode(msg)
    return HEADER.pack(len(body)) + body


class BadFrame(msgspec.Struct):
    """A frame that did not decode as its reader's type (its raw body and why)."""

    body: bytes
    error: str

    def added_request(self) -> str | None:
        """The request id of an AddRequest frame, when its body is readable at all."""
        try:
            tag, fields = msgspec.msgpack.decode(self.body)
            if tag == "add":
                return str(fields["request_id"])
        except (msgspec.DecodeError, ValueError, TypeError, KeyError):
            pass
        return None


class FrameReader:
    """Splits a byte stream into frames and decodes each as `type`; a frame that does not
    decode becomes a BadFrame, never an exception that would end the reader."""

    def __init__(self, type_: object):
        self.decoder = msgspec.msgpack.Decoder(type_)
        self.buffer = bytearray()

    def feed(self, data: bytes) -> list:
        """The messages of every frame `data` completes; a partial frame's bytes wait for the
        next call. Bodies are decoded in place (no copy per frame)."""
        if self.buffer:
            self.buffer += data
            if not _holds_frame(self.buffer):  # a long frame arriving piece by piece: copied once, when whole
                return []
            data = bytes(self.buffer)
        view, at, messages = memoryview(data), 0, []
        while len(data) - at >= HEADER.size:
            (n,) = HEADER.unpack_from(data, at)
            if n > MAX_FRAME:
                raise ValueError(f"frame of {n} bytes")
            end = at + HEADER.size + n
            if end > len(data):
                break
            body = view[at + HEADER.size : end]
            try:
                messages.append(self.decoder.decode(body))
            except msgspec.DecodeError as e:  # ValidationError included
                messages.append(BadFrame(bytes(body), str(e)))
            at = end
        self.buffer = bytearray(view[at:])
        return messages


def _holds_frame(data: bytes | bytearray) -> bool:
    """Whether `data` begins with one whole frame (or a header feed() refuses at once)."""
    if len(data) < HEADER.size:
        return False
    (n,) = HEADER.unpack_from(data)
    return n > MAX_FRAME or len(data) >= HEADER.size + n


def read_available(fd: int, reader: FrameReader, timeout: float | None) -> list | None:
    """Messages that arrive on a blocking fd within `timeout` seconds (None: wait for one);
    None at end of file (the other side has gone)."""
    while True:
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            return []
        data = os.read(fd, 1 << 20)
        if not data:
            return None
        messages = reader.feed(data)
        if messages or timeout is not None:
            return messages


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
