"""The two log formats: one line per event, fields as key=value text or JSON."""

from __future__ import annotations

import json
import logging

import pytest

from dp_server.monitoring.logs import JsonFormatter, TextFormatter


def record(event: str, **fields: object) -> logging.LogRecord:
    made = logging.LogRecord("dp.runtime", logging.INFO, "", 0, event, None, None)
    made.dp_fields = fields
    made.created = 1_790_000_000.25
    made.msecs = 250.0
    return made


@pytest.mark.parametrize(
    "value, shown",
    [
        ("0000:3b:00.0", "0000:3b:00.0"),
        ("nvidia.com/TU104GL_Tesla_T4", "nvidia.com/TU104GL_Tesla_T4"),
        (3, "3"),
        ("", '""'),
        ("two words", '"two words"'),
        ("tab\there", '"tab\\there"'),
        ("line\nbreak", '"line\\nbreak"'),
        ('say "hi"', '"say \\"hi\\""'),
        ("a=b", '"a=b"'),
    ],
)
def test_text_quotes_a_value_only_when_it_would_be_ambiguous(value: object, shown: str) -> None:
    line = TextFormatter().format(record("allocated", device=value))
    assert line == f"2026-09-21T14:13:20.250Z info allocated device={shown}"


def test_json_carries_the_event_and_its_fields() -> None:
    line = JsonFormatter().format(record("allocated", device="0000:3b:00.0", count=1))
    assert json.loads(line) == {
        "ts": 1_790_000_000.25,
        "level": "info",
        "logger": "dp.runtime",
        "event": "allocated",
        "device": "0000:3b:00.0",
        "count": 1,
    }


def test_debug_level_shows_dps_lines_not_every_http2_frame() -> None:
    """h2 and hpack log each frame and header at debug; at --log-level debug the
    operator wants dp's own debug lines (which connection went to which resource)."""
    from dp_server.monitoring.logs import configure_logging

    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        configure_logging("text", "debug")
        assert logging.getLogger("dp.runtime").isEnabledFor(logging.DEBUG)
        for chatty in ("hpack.hpack", "h2.connection", "asyncio"):
            assert not logging.getLogger(chatty).isEnabledFor(logging.DEBUG), chatty
        # One line per API request is the client's trace, not an operator's line.
        import lightkube  # noqa: F401 - its HTTP client's logger is the one that must be quiet

        for client in ("httpx", "httpx2"):
            assert not logging.getLogger(client).isEnabledFor(logging.INFO), client
    finally:
        root.handlers[:], root.level = saved
