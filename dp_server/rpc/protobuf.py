"""Protobuf read strictly, field by field.

betterproto2 reads what it can of a truncated or garbled message and carries
on: a length running past the end gives a short string or nothing, a field of
the wrong wire type an odd value. Where that would do harm (an Allocate read
as asking for no devices, a PodResources answer read as nobody holding
anything, a NodePrepareResources for claims nobody sent) the bytes are walked
here first, and anything malformed raises `WireError` naming the message and
the field.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from grpclib.encoding.proto import ProtoCodec

__all__ = ["StrictCodec", "WireError", "check_message", "fields"]


class WireError(ValueError):
    """A message that is not valid protobuf for the type it claims to be."""


def fields(data: bytes, message: str) -> Iterator[tuple[int, bytes | int]]:
    """(field number, value) of each field: bytes if length-delimited, else an int.

    Fields of any number are yielded, as protobuf requires unknown ones to be
    skipped by whoever reads them; group wire types (3, 4; proto3 has none)
    and field number 0 raise WireError.
    """
    position, end = 0, len(data)
    while position < end:
        key, position = _read_varint(data, position, message)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise WireError(f"{message}: field number 0")
        if wire_type == 0:
            value, position = _read_varint(data, position, message)
            yield number, value
            continue
        if wire_type == 2:
            size, position = _read_varint(data, position, message)
        elif wire_type in (1, 5):
            size = 8 if wire_type == 1 else 4
        else:
            raise WireError(f"{message}: field {number} has unsupported wire type {wire_type}")
        if position + size > end:
            raise WireError(f"{message}: field {number} runs past the end of the message")
        raw = data[position : position + size]
        position += size
        yield number, raw if wire_type == 2 else int.from_bytes(raw, "little")


def _read_varint(data: bytes, position: int, message: str) -> tuple[int, int]:
    value = shift = 0
    while shift < 70:
        if position >= len(data):
            raise WireError(f"{message}: truncated varint")
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7
    raise WireError(f"{message}: varint longer than 10 bytes")


def check_message(
    data: bytes,
    message: str = "request",
    strings: frozenset[int] = frozenset(),
    nested: int | None = None,
) -> None:
    """Raise WireError unless `data` is well-formed protobuf.

    Fields numbered in `strings` must be valid UTF-8; field `nested` holds
    messages whose fields 1-3 are strings (a DRA `Claim`).
    """
    for number, value in fields(data, message):
        if not isinstance(value, bytes):
            continue
        if number in strings:
            try:
                value.decode("utf-8")
            except UnicodeDecodeError:
                raise WireError(f"{message}: field {number} is not UTF-8") from None
        if number == nested:
            check_message(value, f"{message} field {number}", frozenset({1, 2, 3}))


class StrictCodec(ProtoCodec):
    """ProtoCodec that checks request bytes with `check_message` before decoding.

    Every DRA request holds its claims in field 1.
    """

    def decode(self, data: bytes, message_type: Any) -> Any:
        check_message(data, message_type.__name__, nested=1)
        return super().decode(data, message_type)
