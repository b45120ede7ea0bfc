"""What a Node reports to monitoring, as metric families.

`collect(node)` reads the node's own state and `Tally` (host scans, the
binding plan) and asks each front end for its part (`Frontend.metrics`),
as plain `MetricFamily` values. Rendering them in Prometheus' text format is
the shell's job, so another shell can export them another way.
"""

from __future__ import annotations

from typing import Any

from .metric import MetricFamily, family
from .node import Node

__all__ = ["collect"]


def _node_wide(node: Node[Any]) -> list[MetricFamily]:
    tally = node.tally
    return [
        family(
            "gauge",
            "dp_skipped_devices",
            "Selected devices dp does not advertise; `dp-server scan` says why.",
            [((), len(node.inventory.skipped))],
        ),
        family(
            "gauge",
            "dp_host_scan_problems",
            "Entries the last host scan could not read (malformed or vanished sysfs).",
            [((), len(node.snapshot.problems))],
        ),
        family(
            "gauge",
            "dp_bind_functions",
            "Functions dp is moving to vfio-pci now (in_flight), failed to move (failed), "
            "or is giving back to their driver because their IOMMU group could not be "
            "moved whole (giving_back).",
            [
                ((("state", "in_flight"),), len(node.bind_book.in_flight)),
                ((("state", "failed"),), len(node.bind_book.failed)),
                ((("state", "giving_back"),), len(node.bind_book.giving_back)),
            ],
        ),
        family(
            "counter",
            "dp_binds_total",
            "Moves of a function to vfio-pci that dp carried out, by result.",
            (
                ((("result", "ok" if ok else "failed"),), n)
                for ok, n in sorted(tally.bindings.items())
            ),
        ),
        family(
            "counter",
            "dp_host_scans_total",
            "Host scans the core was given.",
            [((), tally.host_scans)],
        ),
    ]


def collect(node: Node[Any]) -> tuple[MetricFamily, ...]:
    """Every dp metric family of `node`, in a stable order: the node's, then
    each front end's in the node's order."""
    return (
        *_node_wide(node),
        *(part for frontend in node.frontends for part in frontend.metrics()),
    )
