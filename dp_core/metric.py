"""A metric family as the core reports it: a plain value, named and labelled.

The names, label sets and help texts of dp's families are its monitoring
interface; each part of the core that counts something builds its own
(`metrics.collect` joins them). Rendering them in Prometheus' text format is
the shell's job, so another shell can export them another way.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Literal

import attrs

__all__ = ["Labels", "MetricFamily", "Sample", "family"]

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")

Labels = tuple[tuple[str, str], ...]


def _check_labels(instance: object, attribute: object, labels: Labels) -> None:
    for name, _ in labels:
        if not _LABEL_NAME.fullmatch(name) or name.startswith("__"):
            raise ValueError(f"{name!r} is not a metric label name")


@attrs.frozen
class Sample:
    """One value of a family, with its labels in a fixed order."""

    labels: Labels = attrs.field(validator=_check_labels)
    value: float


def _check_name(instance: MetricFamily, attribute: object, name: str) -> None:
    if not _METRIC_NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a metric name")
    if instance.kind == "counter" and not name.endswith("_total"):
        raise ValueError(f"counter {name!r} must end in _total")


@attrs.frozen
class MetricFamily:
    kind: Literal["gauge", "counter"] = attrs.field(
        validator=attrs.validators.in_(("gauge", "counter"))
    )
    name: str = attrs.field(validator=_check_name)
    help: str
    samples: tuple[Sample, ...]


def family(
    kind: Literal["gauge", "counter"],
    name: str,
    text: str,
    samples: Iterable[tuple[Labels, float]],
) -> MetricFamily:
    return MetricFamily(kind, name, text, tuple(Sample(labels, value) for labels, value in samples))
