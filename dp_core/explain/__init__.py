"""Why an answer is empty or short, for `scan` to print and `serve` to log."""

from .changes import Explainer, Finding, findings
from .entries import EntryReport, entry_reports, host_findings, host_notes

__all__ = [
    "EntryReport",
    "Explainer",
    "Finding",
    "entry_reports",
    "findings",
    "host_findings",
    "host_notes",
]
