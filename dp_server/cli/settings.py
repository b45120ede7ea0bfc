"""What a config file brings besides the `Config`: the PCI ID database's names."""

from __future__ import annotations

from dp_core import Config, PciId
from dp_server.config.loader import ConfigNote

__all__ = ["pci_names"]


def pci_names(config: Config) -> tuple[dict[PciId, str], ConfigNote | None]:
    """In pci-ids naming mode, the PCI ID database's names; a note when it is missing."""
    if config.naming.source != "pci-ids":
        return {}, None
    # Imported here: `serve` is measured in resident megabytes, and most
    # configs never need these modules.
    from dp_server.config.pci_ids import find_pci_ids, load_pci_names

    found = find_pci_ids(config.naming.pci_ids_path)
    if found is None:
        missing = "no PCI ID database was found: PCI resources get vendor_device names"
        return {}, ConfigNote("warning", "naming.source", missing)
    return load_pci_names(found), None
