"""What `serve` logs of what `scan` explains: at start, and when it changes.

`dp-server scan` says why a device is missing (a selector that matches
nothing, a device skipped and why, a host without IOMMU groups); a server
says the same in its log, so that `kubectl logs` tells why a GPU is not in
the node's Capacity. It says each thing once: when it first holds, and again
only when it changes or stops holding, never at every rescan (the inventory
is rebuilt at every one).
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from ..config import Config
from ..host import HostSnapshot
from ..inventory import OFFERED_BY_DRA, Inventory
from ..log import Log
from .entries import entry_reports, host_findings

__all__ = ["Explainer", "Finding", "findings"]

# A log names at most this many devices of one skipped group; the count says the rest.
_NAMED = 8
# The sysfs a finding names: the kernel's, as the DaemonSet mounts it (the
# core does not know a --sysfs given elsewhere; `scan` names that one).
_SYSFS = "/sys"


@attrs.frozen
class Finding:
    """One thing that explains a short answer: its log event and fields."""

    level: str
    event: str
    fields: tuple[tuple[str, str], ...]

    def log(self) -> Log:
        return Log(self.level, self.event, self.fields)


def _skipped(inventory: Inventory) -> Iterable[Finding]:
    """Skipped devices, one finding per resource and reason. A device the DRA
    front end offers is skipped only by the device-plugin API's view: served."""
    groups: dict[tuple[str, str], list[str]] = {}
    for device in inventory.skipped:
        if device.reason == OFFERED_BY_DRA:
            continue
        groups.setdefault((device.resource_name or "", device.reason), []).append(device.id)
    for (resource, reason), ids in sorted(groups.items()):
        named = ",".join(ids[:_NAMED]) + (f",... ({len(ids)} in all)" if len(ids) > _NAMED else "")
        fields = (("resource", resource), ("devices", named), ("reason", reason))
        yield Finding("info", "devices-skipped", fields)


def findings(config: Config, snapshot: HostSnapshot, inventory: Inventory) -> frozenset[Finding]:
    """Everything `scan` would explain of this host, config and inventory."""
    found: set[Finding] = set()
    for report in entry_reports(config, snapshot):
        if report.served_by == "dp" and report.devices == 0:
            fields = (
                ("entry", report.where),
                ("selector", report.selector),
                ("resource", report.resource or "(a derived name)"),
                ("reason", report.note),
            )
            found.add(Finding("warning", "selector-matches-nothing", fields))
    found.update(_skipped(inventory))
    for event, why in host_findings(config, snapshot, _SYSFS):
        found.add(Finding("warning", event, (("reason", why),)))
    return frozenset(found)


class Explainer:
    """Holds what was last said; `changed` gives the logs of what is new or over."""

    def __init__(self) -> None:
        self._said: frozenset[Finding] = frozenset()
        self._seen: tuple[HostSnapshot, Config, Inventory] | None = None

    def changed(
        self, snapshot: HostSnapshot, config: Config, inventory: Inventory, scanned: bool
    ) -> list[Log]:
        """The logs for a rebuilt inventory; none before the first scan (an
        empty host is not yet this host), and none when nothing it explains
        changed."""
        if not scanned:
            return []
        seen = self._seen
        if seen is not None and seen[0] is snapshot and seen[1] is config:
            if seen[2].skipped == inventory.skipped:
                return []  # the same host and config: the entries say the same
        self._seen = (snapshot, config, inventory)
        now = findings(config, snapshot, inventory)
        logs = [finding.log() for finding in sorted(now - self._said, key=_order)]
        logs += [
            Log.info("explained-no-longer", was=finding.event, **dict(finding.fields))
            for finding in sorted(self._said - now, key=_order)
        ]
        self._said = now
        return logs


def _order(finding: Finding) -> tuple[str, tuple[tuple[str, str], ...]]:
    return finding.event, finding.fields
