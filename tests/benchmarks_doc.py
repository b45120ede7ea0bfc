"""Figures docs/benchmarks.md records, for the tests that hold manifests to them."""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["measured_peak_mib", "mebibytes"]

BENCHMARKS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def mebibytes(quantity: str) -> float:
    """A Kubernetes memory quantity the manifests write in Mi."""
    assert quantity.endswith("Mi"), quantity
    return float(quantity[:-2])


def measured_peak_mib(command: str) -> float:
    """The peak RSS docs/benchmarks.md's "Peak memory" table gives for `command`."""
    section = BENCHMARKS.read_text().split("\n## Peak memory", 1)[1].split("\n## ", 1)[0]
    for line in section.splitlines():
        if line.startswith(f"| `{command}` |"):
            return float(re.findall(r"([\d.]+) MiB", line)[-1])
    raise AssertionError(f"docs/benchmarks.md gives no peak for `{command}`")
