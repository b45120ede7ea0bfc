"""Finding and reading the PCI ID database (`pci.ids`) for `naming.source: pci-ids`.

Debian and Ubuntu ship it as `/usr/share/misc/pci.ids` (package `pci.ids`),
Fedora and RHEL as `/usr/share/hwdata/pci.ids` (package `hwdata`); some
distributions ship only the gzip-compressed `pci.ids.gz`. Parsing is the
core's (`dp_core.config.names.parse_pci_ids`); this module only finds and reads.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence
from pathlib import Path

from dp_core.config import parse_pci_ids
from dp_core.host import PciId
from dp_server.config.loader import ConfigFileError

__all__ = ["PCI_IDS_SEARCH_PATHS", "find_pci_ids", "load_pci_names"]

PCI_IDS_SEARCH_PATHS: tuple[str, ...] = (
    "/usr/share/misc/pci.ids",
    "/usr/share/hwdata/pci.ids",
    "/usr/share/pci.ids",
    "/usr/local/share/pci.ids",
)

_GZIP_MAGIC = b"\x1f\x8b"


def find_pci_ids(
    explicit: str | os.PathLike[str] | None = None,
    *,
    search_paths: Sequence[str | os.PathLike[str]] = PCI_IDS_SEARCH_PATHS,
) -> Path | None:
    """The `pci.ids` file to use, or None when there is none.

    An explicit path (the config's `naming.pciIdsPath`) must exist; otherwise
    each of `search_paths` is tried, and next to each its `.gz` variant.
    """
    if explicit is not None:
        path = Path(explicit)
        if not path.is_file():
            reason = "is not a file" if path.exists() else "does not exist"
            raise ConfigFileError([f"naming.pciIdsPath: {os.fspath(explicit)!r} {reason}"])
        return path
    for candidate in search_paths:
        plain = Path(candidate)
        for path in (plain, plain.with_name(plain.name + ".gz")):
            if path.is_file():
                return path
    return None


def load_pci_names(path: str | os.PathLike[str]) -> dict[PciId, str]:
    """Device names by vendor:device from a `pci.ids` file, plain or gzip-compressed."""
    try:
        data = Path(path).read_bytes()
        if data.startswith(_GZIP_MAGIC):
            import gzip  # only some distributions compress it; the server rarely needs it

            data = gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigFileError(
            [f"{os.fspath(path)}: cannot read the PCI ID database: {reason}"]
        ) from None
    return parse_pci_ids(data.decode("utf-8", errors="replace"))
