"""The one effect every part of the core emits: a structured log line."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

__all__ = ["Log"]


@attrs.frozen
class Log:
    level: str
    event: str
    # Pairs, in order; a sequence that renders them when read may stand in
    # for the tuple (see `deviceplugin.allocations._AllocationFields`).
    fields: Sequence[tuple[str, object]] = ()

    @classmethod
    def info(cls, event: str, **fields: object) -> Log:
        return cls("info", event, tuple(fields.items()))

    @classmethod
    def warning(cls, event: str, **fields: object) -> Log:
        return cls("warning", event, tuple(fields.items()))

    @classmethod
    def error(cls, event: str, **fields: object) -> Log:
        return cls("error", event, tuple(fields.items()))
