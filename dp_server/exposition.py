"""Metric families in Prometheus' text exposition format, version 0.0.4.

Hand-written rather than taken from prometheus-client: that package imports
http.server, urllib and ssl for its own servers, 1.9 MB of a 35 MB budget,
while all dp needs is this one serialisation of gauges and counters. The
tests parse the output with prometheus-client's own parser.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from dp_core import MetricFamily

__all__ = ["CONTENT_TYPE", "render"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    # Integral floats print as integers while exact; beyond 2**53 repr is honest.
    if math.isfinite(value) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def render(families: Iterable[MetricFamily]) -> bytes:
    """The exposition of `families`; a family without samples still says what it is."""
    lines: list[str] = []
    for family in families:
        lines.append(f"# HELP {family.name} {_escape_help(family.help)}")
        lines.append(f"# TYPE {family.name} {family.kind}")
        for sample in family.samples:
            if sample.labels:
                labels = ",".join(f'{k}="{_escape_label(v)}"' for k, v in sample.labels)
                lines.append(f"{family.name}{{{labels}}} {_number(sample.value)}")
            else:
                lines.append(f"{family.name} {_number(sample.value)}")
    lines.append("")
    return "\n".join(lines).encode()
