"""Read sysfs and /dev into a `dp_core.HostSnapshot`.

This is the shell's only reader of the host's devices. It turns
`/sys/bus/pci/devices/*` (with each function's `vfio-dev/`),
`/sys/kernel/iommu_groups/*`, `/sys/class/mdev_bus/*` (the mdev types of
every parent, PCI function or not), `/sys/bus/mdev/devices/*`, `/dev/vfio/*`,
`/dev/vfio/devices/*` and `/dev/iommu` into plain data and never decides
anything: what is healthy, what may be allocated or rebound is the core's
business.

Two rules shape the code:

- **A scan never fails.** sysfs changes under our feet (hot-unplug, VFs being
  created, drivers rebinding) and a broken or odd entry must not take the
  server down or hide every other device. Each problem becomes a `ScanProblem`
  naming the path; a function whose identity (vendor, device) cannot be read is
  left out, and a function with one bad field keeps the rest, with the field set
  to the value that is *safe* for the core (see below).
- **Unknown is never read as harmless.** The core lets VFIO have a group only if
  every endpoint in it is on vfio-pci or has no driver, and never rebinds the
  boot display. So an unreadable driver becomes `UNKNOWN_DRIVER` (which blocks
  the group, where None would have let it through), an unreadable `boot_vga`
  becomes True, an unreadable class becomes `UNKNOWN_CLASS` (an endpoint, so
  viability checks it), and an IOMMU group that lists a member we could not
  read is left out of the snapshot entirely, because its viability cannot be
  known.

It is also written to be fast, because it runs on every rescan: one `listdir`
per function tells which optional links and files exist (no exception-driven
probing), small attributes are read with `os.open`/`os.read`, and links are
read with `os.readlink` and their basename taken, rather than resolving paths.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TypeVar

from dp_core import (
    HostSnapshot,
    MdevDevice,
    MdevType,
    PciAddress,
    PciDevice,
    ScanProblem,
)
from dp_server.host.iommu_groups import cross_checked_groups
from dp_server.host.reasons import why as _why
from dp_server.host.roots import root_problems
from dp_server.host.vfio_dev import cdev_nodes, read_vfio_dev

__all__ = ["UNKNOWN_CLASS", "UNKNOWN_DRIVER", "scan_host"]

_log = logging.getLogger("dp.scanner")
_T = TypeVar("_T")

# What a bad field becomes; see the module docstring for why these values.
UNKNOWN_DRIVER = "(unknown)"  # parentheses: no real driver can be named this
UNKNOWN_CLASS = 0x000000  # PCI base class 0x00, "unclassified": an endpoint

_CLASS_UNKNOWN = f"class treated as unknown ({UNKNOWN_CLASS:#08x})"
_DRIVER_UNKNOWN = f"driver treated as unknown ({UNKNOWN_DRIVER})"

# Problems already logged, so that a periodic rescan does not repeat its lines.
# Bounded: after this many distinct problems it starts over, and a line may repeat.
_LOGGED_PROBLEMS: set[tuple[str, str]] = set()
_LOGGED_LIMIT = 4096

_UUID = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
_O_READ = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
_O_DIRECTORY = _O_READ | getattr(os, "O_DIRECTORY", 0)


def _read_attribute(path: str, dir_fd: int | None = None) -> str:
    """The stripped text of one small sysfs attribute.

    With `dir_fd`, the file opened is the last component of `path` relative to
    that directory, so the kernel does not walk the whole path (and the
    `bus/pci/devices` symlink) again for every attribute of a function.
    `path` stays the full path, for messages and for tests, which replace this
    function to simulate unreadable files (they run as root, so permission bits
    would not stop a read). A sysfs attribute is at most one page and is
    returned whole by one read.
    """
    if dir_fd is None:
        fd = os.open(path, _O_READ)
    else:
        fd = os.open(path.rpartition("/")[2], _O_READ, dir_fd=dir_fd)
    try:
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    return data.decode("utf-8", "replace").strip()


def _link_name(path: str, dir_fd: int | None = None) -> str:
    """The last component of the target of the symlink at `path` (see `_read_attribute`)."""
    if dir_fd is None:
        target = os.readlink(path)
    else:
        target = os.readlink(path.rpartition("/")[2], dir_fd=dir_fd)
    return target.rstrip("/").rpartition("/")[2]


def _is_number(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _group_number(name: str) -> int | None:
    return int(name) if _is_number(name) else None


def _driver_name(name: str) -> str | None:
    return name or None


class _Scan:
    """One pass over the host; collects problems as it goes."""

    def __init__(self, sysfs_root: str, dev_root: str) -> None:
        self.sys = sysfs_root
        self.dev = dev_root
        self.problems: list[ScanProblem] = []
        self.mdev_types: list[MdevType] = []
        # Every function carries the same few vendor, device and class texts, and
        # physfn/virtfn links name functions the listing already named: one object
        # per distinct value keeps a large host's snapshot (and its parsing) small.
        self.values: dict[str, int] = {}
        self.addresses: dict[str, PciAddress] = {}

    # -- reporting --------------------------------------------------------

    def problem(self, path: str, reason: str) -> None:
        self.problems.append(ScanProblem(path, reason))
        key = (path, reason)
        if key not in _LOGGED_PROBLEMS:
            if len(_LOGGED_PROBLEMS) >= _LOGGED_LIMIT:
                _LOGGED_PROBLEMS.clear()
            _LOGGED_PROBLEMS.add(key)
            _log.warning("scan problem at %s: %s", path, reason)

    # -- small readers that report instead of raising ---------------------

    def read(self, path: str, consequence: str, dir_fd: int | None = None) -> str | None:
        try:
            return _read_attribute(path, dir_fd)
        except (OSError, ValueError) as exc:
            self.problem(path, f"cannot read: {_why(exc)}; {consequence}")
            return None

    def hex_field(
        self, path: str, limit: int, consequence: str, dir_fd: int | None = None
    ) -> int | None:
        text = self.read(path, consequence, dir_fd)
        if text is None:
            return None
        value = self.values.get(text)
        if value is None:
            try:
                value = int(text, 16)
            except ValueError:
                value = -1
            self.values[text] = value
        if not 0 <= value <= limit:
            self.problem(path, f"garbage value {text[:40]!r}; {consequence}")
            return None
        return value

    def listdir(self, path: str, consequence: str) -> list[str] | None:
        """Entries of a directory that must exist; None (and a problem) if it cannot be read."""
        try:
            return os.listdir(path)
        except (OSError, ValueError) as exc:
            self.problem(path, f"cannot list: {_why(exc)}; {consequence}")
            return None

    def optional_listdir(self, path: str) -> list[str] | None:
        """Entries of a directory that may legitimately be absent (no IOMMU, no mdev)."""
        try:
            return os.listdir(path)
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            self.problem(path, f"cannot list: {_why(exc)}")
            return None

    # -- IOMMU groups as the kernel lists them ----------------------------

    def kernel_groups(self) -> dict[int, list[str] | None] | None:
        """`kernel/iommu_groups/<n>/devices/*` names per group.

        A group maps to None when its member list could not be read; the whole
        result is None when the groups directory itself could not be listed.
        """
        groups_dir = f"{self.sys}/kernel/iommu_groups"
        names = self.optional_listdir(groups_dir)
        if names is None:
            return None
        groups: dict[int, list[str] | None] = {}
        for name in names:
            path = f"{groups_dir}/{name}"
            if not _is_number(name):
                self.problem(path, "is not an IOMMU group number; ignored")
                continue
            groups[int(name)] = self.group_members(name)
        return groups

    def group_members(self, name: str) -> list[str] | None:
        """`kernel/iommu_groups/<name>/devices/*` names; None (reported) if unreadable."""
        path = f"{self.sys}/kernel/iommu_groups/{name}/devices"
        return self.listdir(path, "group left out of the snapshot")

    # -- PCI functions ----------------------------------------------------

    def pci_functions(self, known_groups: Mapping[str, int] | None) -> dict[str, PciDevice]:
        """Every readable function under `bus/pci/devices`, in listing order.

        `known_groups` maps the group directory names the kernel listed to their
        numbers (None if that listing failed); links to them are accepted without
        a stat, and each function shares its group's number object.
        """
        pci_dir = f"{self.sys}/bus/pci/devices"
        drivers = self.optional_listdir(f"{self.sys}/bus/pci/drivers")
        # Each name once, so thousands of functions share one driver string.
        known_drivers = None if drivers is None else {name: name for name in drivers}
        try:
            with os.scandir(pci_dir) as listing:
                entries = [entry.name for entry in listing]
        except FileNotFoundError:
            return {}  # no PCI bus at all (some containers, some architectures)
        except OSError as exc:
            self.problem(pci_dir, f"cannot list: {_why(exc)}; no PCI function is known")
            return {}
        found = {}
        for name in entries:
            dev = self.pci_function(name, pci_dir, known_drivers, known_groups)
            if dev is not None:
                found[name] = dev
        return found

    def pci_function(
        self,
        name: str,
        pci_dir: str,
        known_drivers: Mapping[str, str] | None,
        known_groups: Mapping[str, int] | None,
    ) -> PciDevice | None:
        base = f"{pci_dir}/{name}"
        address = self.address(name)
        if address is None:
            self.problem(base, "is not a PCI address; ignored")
            return None
        try:
            fd = os.open(base, _O_DIRECTORY)
        except (OSError, ValueError) as exc:
            self.problem(base, f"cannot open: {_why(exc)}; function skipped")
            return None
        try:
            return self.pci_function_at(name, address, base, fd, known_drivers, known_groups)
        finally:
            os.close(fd)

    def pci_function_at(
        self,
        name: str,
        address: PciAddress,
        base: str,
        fd: int,
        known_drivers: Mapping[str, str] | None,
        known_groups: Mapping[str, int] | None,
    ) -> PciDevice | None:
        """Read one function through `fd`, an open descriptor of its directory."""
        skip = "function skipped"
        try:
            present = set(os.listdir(fd))
        except OSError as exc:
            self.problem(base, f"cannot list: {_why(exc)}; {skip}")
            return None
        vendor = self.hex_field(f"{base}/vendor", 0xFFFF, skip, fd)
        if vendor is None:
            return None
        device = self.hex_field(f"{base}/device", 0xFFFF, skip, fd)
        if device is None:
            return None
        class_code = self.hex_field(f"{base}/class", 0xFFFFFF, _CLASS_UNKNOWN, fd)
        if class_code is None:
            class_code = UNKNOWN_CLASS

        numa = None
        if "numa_node" in present:
            path = f"{base}/numa_node"
            text = self.read(path, "NUMA node treated as unknown", fd)
            if text is not None:
                try:
                    numa = int(text)
                except ValueError:
                    numa = -2
                if numa == -1:
                    numa = None
                elif numa < 0:
                    self.problem(path, f"garbage value {text[:40]!r}; NUMA node treated as unknown")
                    numa = None

        driver = None
        if "driver" in present:
            driver = self.link_target(
                f"{base}/driver",
                fd,
                known_drivers,
                _driver_name,
                _DRIVER_UNKNOWN,
            )
            if driver is None:
                driver = UNKNOWN_DRIVER

        group = None
        if "iommu_group" in present:
            group = self.link_target(
                f"{base}/iommu_group",
                fd,
                known_groups,
                _group_number,
                "IOMMU group treated as unknown",
            )

        physfn = None
        if "physfn" in present:
            physfn = self.address_link(f"{base}/physfn", "physical function treated as unknown", fd)

        virtfns: list[tuple[int, PciAddress]] = []
        sriov_numvfs: int | None = 0
        for entry in present:
            if entry.startswith("virtfn"):
                path = f"{base}/{entry}"
                index = entry[6:]
                if not _is_number(index):
                    self.problem(path, "is not virtfn<N>; VFs treated as unknown")
                    sriov_numvfs = None
                    continue
                vf = self.address_link(path, "VFs treated as unknown", fd)
                if vf is None:
                    sriov_numvfs = None
                else:
                    virtfns.append((int(index), vf))
        virtfns.sort()
        if "sriov_numvfs" in present and sriov_numvfs is not None:
            path = f"{base}/sriov_numvfs"
            text = self.read(path, "VFs treated as unknown", fd)
            if text is not None and _is_number(text):
                sriov_numvfs = int(text)
            else:
                if text is not None:
                    self.problem(path, f"garbage value {text[:40]!r}; VFs treated as unknown")
                sriov_numvfs = None

        boot_vga = False
        if "boot_vga" in present:
            path = f"{base}/boot_vga"
            consequence = "treated as the boot display, so it is never rebound"
            text = self.read(path, consequence, fd)
            if text is None:
                boot_vga = True
            elif text in ("0", "1"):
                boot_vga = text == "1"
            else:
                self.problem(path, f"garbage value {text[:40]!r}; {consequence}")
                boot_vga = True

        vfio_dev = None
        if "vfio-dev" in present:
            vfio_dev = read_vfio_dev(f"{base}/vfio-dev", self.problem)

        # Cannot fail: every field was range-checked as it was read.
        return PciDevice(
            address=address,
            vendor=vendor,
            device=device,
            class_code=class_code,
            driver=driver,
            iommu_group=group,
            numa_node=numa,
            physfn=physfn,
            virtfns=tuple(vf for _, vf in virtfns),
            sriov_numvfs=sriov_numvfs,
            boot_vga=boot_vga,
            vfio_dev=vfio_dev,
        )

    def link_target(
        self,
        path: str,
        dir_fd: int | None,
        known: Mapping[str, _T] | None,
        parse: Callable[[str], _T | None],
        consequence: str,
    ) -> _T | None:
        """What the basename of a link to an existing, well-formed entry stands for.

        `known` maps the listing of the directory such links point into to the
        values of its names; a name found there is accepted without a stat.
        Otherwise `parse` turns the name into its value (None if malformed) and
        the link is followed once, so a dangling link is told apart from a
        listing that raced.
        """
        try:
            name = _link_name(path, dir_fd)
        except (OSError, ValueError) as exc:
            self.problem(path, f"cannot read link: {_why(exc)}; {consequence}")
            return None
        value = None if known is None else known.get(name)
        if value is not None:
            return value
        value = parse(name)
        if value is None:
            self.problem(path, f"link to unexpected name {name[:60]!r}; {consequence}")
            return None
        if not os.path.exists(path):
            self.problem(path, f"dangling link (to {name!r}); {consequence}")
            return None
        return value

    def address_link(
        self, path: str, consequence: str, dir_fd: int | None = None
    ) -> PciAddress | None:
        try:
            name = _link_name(path, dir_fd)
        except (OSError, ValueError) as exc:
            self.problem(path, f"cannot read link: {_why(exc)}; {consequence}")
            return None
        address = self.address(name)
        if address is None:
            self.problem(path, f"link to {name[:60]!r}, not a PCI address; {consequence}")
        return address

    def address(self, text: str) -> PciAddress | None:
        """`text` parsed as a PCI address, or None."""
        address = self.addresses.get(text)
        if address is None:
            try:
                address = PciAddress.parse(text)
            except ValueError:
                return None
            self.addresses[text] = address
        return address

    # -- mediated devices -------------------------------------------------

    def mdev_parents(self) -> None:
        """The mdev types of every parent, which the kernel links into `class/mdev_bus/`
        by its device name: a PCI address, or a virtual device's name (`mtty`, `matrix`)."""
        bus_dir = f"{self.sys}/class/mdev_bus"
        for name in sorted(self.optional_listdir(bus_dir) or ()):
            path = f"{bus_dir}/{name}"
            if name.startswith(".") or not name.isprintable():
                self.problem(path, "is not a device name; its mdev types are ignored")
                continue
            self.mdev_supported_types(name, f"{path}/mdev_supported_types")

    def mdev_supported_types(self, parent: str, types_dir: str) -> None:
        type_ids = self.listdir(types_dir, "no mdev type of this parent is known")
        for type_id in type_ids or ():
            type_dir = f"{types_dir}/{type_id}"
            name = self.read(f"{type_dir}/name", "mdev type skipped")
            if name is None:
                continue
            available = None
            text = self.read(f"{type_dir}/available_instances", "available instances unknown")
            if text is not None:
                try:
                    available = int(text)
                except ValueError:
                    available = -1
                if available < 0:
                    self.problem(
                        f"{type_dir}/available_instances",
                        f"garbage value {text[:40]!r}; available instances unknown",
                    )
                    available = None
            self.mdev_types.append(MdevType(parent, type_id, name, available))

    def mdevs(self, known_groups: Mapping[str, int] | None) -> list[MdevDevice]:
        mdev_dir = f"{self.sys}/bus/mdev/devices"
        names = self.optional_listdir(mdev_dir)
        found = []
        for name in names or ():
            path = f"{mdev_dir}/{name}"
            if _UUID.match(name) is None:
                self.problem(path, "is not an mdev UUID; ignored")
                continue
            try:
                # The mdev's directory is inside its parent's, whatever the parent is.
                target = os.readlink(path)
                parent = target.rstrip("/").rpartition("/")[0].rpartition("/")[2]
                if parent in ("", ".", "..") or not parent.isprintable():
                    raise ValueError(f"link to {target[:80]!r} names no device")
                type_id = _link_name(f"{path}/mdev_type")
            except (OSError, ValueError) as exc:
                self.problem(path, f"cannot tell its parent and type: {_why(exc)}; mdev skipped")
                continue
            group = None
            group_link = f"{path}/iommu_group"
            if os.path.lexists(group_link):
                group = self.link_target(
                    group_link, None, known_groups, _group_number, "IOMMU group treated as unknown"
                )
            vfio_dev = None
            if os.path.isdir(f"{path}/vfio-dev"):
                vfio_dev = read_vfio_dev(f"{path}/vfio-dev", self.problem)
            found.append(MdevDevice(name, parent, type_id, group, vfio_dev))
        return found

    # -- /dev -------------------------------------------------------------

    def dev_nodes(self, dev_paths: Iterable[str]) -> set[str]:
        nodes: set[str] = set()
        for name in self.optional_listdir(f"{self.dev}/vfio") or ():
            if name == "vfio" or _is_number(name):
                nodes.add(f"/dev/vfio/{name}")
        nodes |= cdev_nodes(self.dev, self.optional_listdir)
        for host_path in dev_paths:
            relative = host_path.removeprefix("/dev/")
            if (
                relative == host_path
                or not relative
                or ".." in relative.split("/")
                or relative.startswith("/")
            ):
                self.problem(host_path, "is not a path under /dev/; not checked")
                continue
            if os.path.exists(f"{self.dev}/{relative}"):
                nodes.add(host_path)
        return nodes


def _by_address(dev: PciDevice) -> tuple[int, int, int, int]:
    # attrs' generated ordering on PciAddress builds tuples through generic
    # helpers and dominated a 10,000-function scan; a plain tuple key is 10x cheaper.
    a = dev.address
    return (a.domain, a.bus, a.slot, a.function)


def _type_key(t: MdevType) -> tuple[int, int, int, int, int, str, str]:
    # PCI parents by address, then the others (virtual devices) by name.
    a = t.parent_address
    if a is None:
        return (1, 0, 0, 0, 0, t.parent, t.type_id)
    return (0, a.domain, a.bus, a.slot, a.function, "", t.type_id)


def scan_host(
    sysfs_root: str | Path = "/sys",
    dev_root: str | Path = "/dev",
    dev_paths: Iterable[str] = (),
) -> HostSnapshot:
    """Read the host's PCI functions, IOMMU groups, mdevs and device nodes.

    `dev_paths` are host paths (`/dev/kvm`, ...) to check for existence in
    addition to `/dev/vfio/*`, `/dev/vfio/devices/*` and `/dev/iommu`; they
    are looked up under `dev_root`, but always reported as `/dev/...` host
    paths, so a snapshot of a fixture tree reads like one of the real host.
    Never raises for anything it finds on disk: every oddity is a
    `ScanProblem` in the result (and one log line the first time).
    The result is in canonical order (functions and members by address, groups
    by number, mdev types by parent and id, mdevs by UUID, problems by path), so
    two scans of an unchanged host compare equal.
    """
    return _scan_host(sysfs_root, dev_root, dev_paths)


def _scan_host(
    sysfs_root: str | Path, dev_root: str | Path, dev_paths: Iterable[str]
) -> HostSnapshot:
    # Without a trailing slash, so problem paths read `/sys/bus/...`, not `/sys//bus`;
    # "/" becomes "", which joins to the same absolute paths.
    scan = _Scan(os.fspath(sysfs_root).rstrip("/"), os.fspath(dev_root).rstrip("/"))
    for path, reason in root_problems(os.fspath(sysfs_root), os.fspath(dev_root)):
        scan.problem(path, reason)
    kernel_groups = scan.kernel_groups()
    known_groups = None if kernel_groups is None else {str(n): n for n in kernel_groups}
    found = scan.pci_functions(known_groups)
    devices = dict(sorted(found.items(), key=lambda item: _by_address(item[1])))
    scan.mdev_parents()
    mdevs = scan.mdevs(known_groups)
    if kernel_groups is None:
        # The groups directory could not be listed: ask each group a function
        # names for its members, rather than build it from the functions' own
        # links alone, where a member the scan skipped would go unseen.
        named = {d.iommu_group for d in devices.values()} | {m.iommu_group for m in mdevs}
        numbers = sorted(n for n in named if n is not None)
        kernel_groups = {number: scan.group_members(str(number)) for number in numbers}
    groups = cross_checked_groups(scan.sys, kernel_groups, devices, mdevs, scan.problem)
    dev_nodes = scan.dev_nodes(dev_paths)
    # Only binding looks at these. Absent, no driver is registered; unreadable
    # (None), binding waits rather than calling vfio-pci missing.
    drivers = scan.optional_listdir(f"{scan.sys}/bus/pci/drivers")

    return HostSnapshot(
        pci_devices=tuple(devices.values()),
        iommu_groups=groups,
        mdev_types=sorted(scan.mdev_types, key=_type_key),
        mdevs=sorted(mdevs, key=lambda m: m.uuid),
        dev_nodes=dev_nodes,
        problems=sorted(scan.problems, key=lambda p: (p.path, p.reason)),
        pci_drivers=None if drivers is None else sorted(drivers),
    )
