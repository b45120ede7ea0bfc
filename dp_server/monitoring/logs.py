"""Structured logs: one line per event, as `key=value` text or as JSON."""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any

from dp_core import Log

__all__ = ["configure_logging", "emit"]

_LOGGER = logging.getLogger("dp")
_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def emit(effect: Log) -> None:
    """Write a core Log effect through the `dp` logger."""
    _LOGGER.log(
        _LEVELS.get(effect.level, logging.INFO),
        effect.event,
        extra={"dp_fields": dict(effect.fields)},
    )


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "dp_fields", None)
    return dict(fields) if isinstance(fields, dict) else {}


_NEEDS_QUOTES = re.compile(r'[\s"=]')


def _text_value(value: object) -> str:
    text = str(value)
    if text == "" or _NEEDS_QUOTES.search(text):
        return json.dumps(text)
    return text


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        parts = [f"{stamp}.{int(record.msecs):03d}Z", record.levelname.lower(), record.getMessage()]
        parts += [f"{key}={_text_value(value)}" for key, value in _fields(record).items()]
        if record.exc_info:
            parts.append(self.formatException(record.exc_info).replace("\n", " | "))
        return " ".join(parts)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        for key, value in _fields(record).items():
            payload.setdefault(key, value)
        if record.exc_info:
            payload["exception"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str)


def configure_logging(fmt: str = "text", level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Neither format shows where a line was logged from, nor the thread or
    # process: skip collecting them for every record (the logging HOWTO's
    # "Optimization"; a line per Allocate is on the hot path).
    logging._srcfile = None  # type: ignore[attr-defined]
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    # grpclib logs every peer that hangs up mid-stream at error level; that is
    # ordinary kubelet behaviour, so keep it out of the operator's way.
    logging.getLogger("grpclib").setLevel(logging.CRITICAL)
    # watchfiles logs every batch of changes at info; the runtime logs what it does about them.
    logging.getLogger("watchfiles").setLevel(logging.WARNING)
    # h2 and its header codec log every frame and header at debug: thousands of
    # lines a second that would bury dp's own debug lines (which RPC went to
    # which resource) under the wire's.
    for chatty in ("hpack", "h2", "asyncio"):
        logging.getLogger(chatty).setLevel(logging.INFO)
    # httpx logs each API-server request at info; the DRA front end logs what
    # it wrote (resourceslices-published) and what failed, in dp's own form.
    for client in ("httpx", "httpx2"):  # lightkube's HTTP client, by either name
        logging.getLogger(client).setLevel(logging.WARNING)
