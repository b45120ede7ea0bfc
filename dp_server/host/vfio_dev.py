"""VFIO character devices for the scanner: sysfs `vfio-dev/`, `/dev/vfio/devices`, `/dev/iommu`.

The kernel's iommufd interface gives each VFIO device a node of its own,
`/dev/vfio/devices/vfioN`, next to the group interface. sysfs shows it as the
function's `vfio-dev/vfioN` entry, with a `dev` file only when the kernel is
built with `CONFIG_VFIO_DEVICE_CDEV` (Debian's kernels are not). Whatever is
odd here costs the function its character device, never the function: it
keeps the group interface, and the reason is a scan problem.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from dp_core import IOMMUFD_NODE, VfioDevEntry
from dp_server.host.reasons import why as _why

__all__ = ["VFIO_CDEV_DIR", "cdev_nodes", "read_vfio_dev"]

VFIO_CDEV_DIR = "/dev/vfio/devices"
_KEEPS_GROUP = "no VFIO character device is offered; the group interface stays"


def _is_cdev_name(name: str) -> bool:
    digits = name.removeprefix("vfio")
    return digits != name and digits.isascii() and digits.isdigit()


def read_vfio_dev(path: str, problem: Callable[[str, str], None]) -> VfioDevEntry:
    """The `vfio-dev/` directory at `path` as a `VfioDevEntry`; problems are reported.

    The kernel puts exactly one `vfioN` entry there; anything else (an
    unreadable directory, a stray name, two entries) is reported, and the
    entry comes back with `problem` set.
    """
    try:
        names = sorted(os.listdir(path))
    except (OSError, ValueError) as exc:
        reason = f"cannot list: {_why(exc)}"
        problem(path, f"{reason}; {_KEEPS_GROUP}")
        return VfioDevEntry(problem=reason)
    entries = [name for name in names if _is_cdev_name(name)]
    if len(entries) != 1 or len(names) != 1:
        shown = ", ".join(repr(name[:40]) for name in names[:4]) or "nothing"
        reason = f"holds {shown}, not one vfio<N> entry"
        problem(path, f"{reason}; {_KEEPS_GROUP}")
        return VfioDevEntry(name=entries[0] if len(entries) == 1 else "", problem=reason)
    name = entries[0]
    entry = f"{path}/{name}"
    try:
        has_dev = "dev" in os.listdir(entry)
    except (OSError, ValueError) as exc:
        reason = f"cannot list {name}: {_why(exc)}"
        problem(entry, f"cannot list: {_why(exc)}; {_KEEPS_GROUP}")
        return VfioDevEntry(name=name, problem=reason)
    return VfioDevEntry(name=name, has_dev=has_dev)


def cdev_nodes(dev_root: str, listdir: Callable[[str], list[str] | None]) -> set[str]:
    """`/dev/vfio/devices/vfioN` nodes and `/dev/iommu`, as host paths, found under `dev_root`.

    `listdir` lists a directory that may be absent (None, reported, when it
    cannot be read).
    """
    nodes = {
        f"{VFIO_CDEV_DIR}/{name}"
        for name in listdir(f"{dev_root}/vfio/devices") or ()
        if _is_cdev_name(name)
    }
    if os.path.exists(f"{dev_root}/{IOMMUFD_NODE.removeprefix('/dev/')}"):
        nodes.add(IOMMUFD_NODE)
    return nodes
