"""Why `dp-server scan` answers what it does: each config entry, and the host.

An empty or short answer must say what was found and what was expected: an
entry that selects nothing (with the nearest ID or mdev type name the host
has), an entry left to KubeVirt's virt-handler, a host without IOMMU groups.
The entries and the host are read by `dp_core.explain`, which `serve` logs
from too; here they are joined with the config file's own notes.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from dp_core import HostSnapshot
from dp_core.explain import EntryReport, entry_reports, host_notes
from dp_server.config.loader import ConfigFile, ConfigNote

__all__ = ["Explained", "explain"]


@attrs.frozen
class Explained:
    """The config's side and the host's side of a scan's answer."""

    config: ConfigFile
    entries: tuple[EntryReport, ...] = ()
    host: tuple[str, ...] = ()

    @property
    def notes(self) -> tuple[ConfigNote, ...]:
        return self.config.notes


def explain(
    loaded: ConfigFile, snapshot: HostSnapshot, sysfs: str, extra: Sequence[ConfigNote] = ()
) -> Explained:
    """Everything that explains the scan of `snapshot` with `loaded`."""
    roots = [p.reason for p in snapshot.problems if p.path in (sysfs, sysfs.rstrip("/") or "/")]
    permitted = loaded.config.permitted_host_devices
    if permitted is None:
        what = "is absent: dp serves every PCI function bound to vfio-pci, under a derived name"
        extra = [ConfigNote("info", "permittedHostDevices", what), *extra]
    elif not permitted.pci_host_devices and not permitted.mediated_devices:
        what = "has no entry: dp serves no PCI device and no mdev"
        extra = [ConfigNote("info", _entries_path(loaded), what), *extra]
    return Explained(
        attrs.evolve(loaded, notes=(*loaded.notes, *extra)),
        tuple(entry_reports(loaded.config, snapshot)),
        tuple(host_notes(loaded.config, snapshot, sysfs, roots)),
    )


def _entries_path(loaded: ConfigFile) -> str:
    prefix = "spec.configuration." if loaded.kubevirt_cr else ""
    return f"{prefix}permittedHostDevices"
