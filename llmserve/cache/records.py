"""The one format of every value llmserve keeps outside its process (Redis) or replays (the
response cache): msgspec Structs, as the engine's messages are, encoded as msgpack.

  value  = Sealed [crc32, body]          msgpack array; crc32 = CRC-32 of body
  body   = one Record, tagged            msgpack array [tag, fields...]; the tag names the kind
                                         and its version ("kv/3", "response/2", ...)

Redis contents are untrusted (never pickle). `decode` answers None for anything that is not
exactly the record asked for: another kind or version (tag), a missing, extra or mistyped
field, truncation, or a flipped byte (CRC-32). Byte payloads (KV blocks, vectors) decode as
memoryviews of the value, without a copy.
"""

from __future__ import annotations

import functools
import zlib
from typing import TypeVar

import msgspec


class Record(msgspec.Struct, array_like=True, forbid_unknown_fields=True, tag_field="kind"):
    """Base of every stored record; a subclass sets tag="<kind>/<version>"."""


class Sealed(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    crc32: int
    body: memoryview  # msgpack of one Record


R = TypeVar("R", bound=Record)
_encoder = msgspec.msgpack.Encoder()
_sealed = msgspec.msgpack.Decoder(Sealed)


def encode(record: Record) -> bytes:
    body = _encoder.encode(record)
    return _encoder.encode(Sealed(zlib.crc32(body), memoryview(body)))


def decode(raw: bytes | memoryview, kind: type[R]) -> R | None:
    """The `kind` record in raw, or None if anything about it is off."""
    try:
        sealed = _sealed.decode(raw)
        if zlib.crc32(sealed.body) != sealed.crc32:
            return None
        return _decoder(kind).decode(sealed.body)
    except (msgspec.DecodeError, RecursionError):  # ValidationError is a DecodeError
        return None


@functools.cache
def _decoder(kind: type[R]) -> msgspec.msgpack.Decoder[R]:
    return msgspec.msgpack.Decoder(kind)
