"""The byte layout of every value llmserve keeps in Redis (never pickle: Redis contents are
untrusted): MAGIC (6 bytes, one per kind of value) | u32 little-endian header length | JSON
header (a dict) | payload. Each store checks its own header fields (version, checksum, ...)."""

from __future__ import annotations

import json


def frame(magic: bytes, header: dict, payload: bytes) -> bytes:
    h = json.dumps(header, separators=(",", ":")).encode()
    return magic + len(h).to_bytes(4, "little") + h + payload


def unframe(raw: bytes, magic: bytes) -> tuple[dict, memoryview] | None:
    """(header, payload as a view of raw), or None when the magic, the length or the JSON is off."""
    if not raw.startswith(magic):
        return None
    start = len(magic) + 4
    n = int.from_bytes(raw[len(magic) : start], "little")
    try:
        header = json.loads(bytes(raw[start : start + n]))
    except (ValueError, RecursionError):  # JSON and UTF-8 errors are ValueErrors
        return None
    if not isinstance(header, dict) or len(raw) < start + n:
        return None
    return header, memoryview(raw)[start + n :]
