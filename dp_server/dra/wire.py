"""A codec that refuses request bytes that are not well-formed protobuf.

betterproto2 reads what it can of a truncated or garbled message and carries
on (a length running past the end gives a short string, or nothing), so a
garbled NodePrepareResources would be answered as if for claims nobody sent.
Before it decodes, the bytes are walked here: every tag, varint and length
must be whole, no group wire types (proto3 has none), and each `Claim`
(field 1 of every DRA request) must itself be well formed with UTF-8 strings.
"""

from __future__ import annotations

from typing import Any

from grpclib.encoding.proto import ProtoCodec

__all__ = ["StrictCodec", "check_message"]


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data):
            raise ValueError(f"varint cut short at byte {at}")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7
        if shift >= 64:
            raise ValueError(f"varint longer than 10 bytes at byte {at}")


def check_message(
    data: bytes, strings: frozenset[int] = frozenset(), nested: int | None = None
) -> None:
    """Raise ValueError unless `data` is well-formed protobuf.

    Fields numbered in `strings` must be valid UTF-8; field `nested` holds
    messages whose fields 1-3 are strings (a DRA `Claim`).
    """
    at = 0
    while at < len(data):
        start = at
        key, at = _varint(data, at)
        number, kind = key >> 3, key & 7
        if number == 0:
            raise ValueError(f"field number 0 at byte {start}")
        if kind == 0:
            _, at = _varint(data, at)
        elif kind == 1 or kind == 5:
            at += 8 if kind == 1 else 4
            if at > len(data):
                raise ValueError(f"field {number} cut short at byte {start}")
        elif kind == 2:
            length, at = _varint(data, at)
            end = at + length
            if end > len(data):
                raise ValueError(
                    f"field {number} at byte {start} claims {length} bytes, "
                    f"{len(data) - at} are left"
                )
            body = data[at:end]
            if number in strings:
                try:
                    body.decode("utf-8")
                except UnicodeDecodeError:
                    raise ValueError(f"field {number} at byte {start} is not UTF-8") from None
            if number == nested:
                check_message(body, strings=frozenset({1, 2, 3}))
            at = end
        else:
            raise ValueError(f"field {number} at byte {start} has wire type {kind}")


class StrictCodec(ProtoCodec):
    """ProtoCodec that checks request bytes with `check_message` before decoding."""

    def decode(self, data: bytes, message_type: Any) -> Any:
        check_message(data, nested=1)
        return super().decode(data, message_type)
