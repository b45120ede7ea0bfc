"""A fake kernel for the rebinding files of a fixture sysfs tree (docs/design.md §8).

`FakeKernel.write` stands in for `dp_server.binding.binder.write_attribute`: it applies
what the kernel does for a write to a function's `driver_override`, a driver's
`unbind` and `bind`, and `bus/pci/drivers_probe`, on a tree from `write_sysfs`, including
the `/dev/vfio/<group>` node that appears and goes with vfio-pci. A write to
any other file is refused, and every write is recorded, so tests can check
that nothing outside the config's selection was touched.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

__all__ = ["FakeKernel"]

VFIO = "vfio-pci"


class FakeKernel:
    def __init__(self, sys_root: Path, dev_root: Path) -> None:
        self.sys = Path(sys_root)
        self.dev = Path(dev_root)
        self.writes: list[tuple[str, str]] = []  # (path relative to sys, text)
        self.busy: set[str] = set()  # addresses whose unbind fails with EBUSY
        self.refuses_bind: set[str] = set()  # drivers whose explicit bind fails with ENODEV
        self._native: dict[str, str] = {}  # the driver a function had before unbind

    # -- what the binder calls ------------------------------------------------------

    def write(self, path: str, text: str) -> None:
        relative = os.path.relpath(path, self.sys)
        self.writes.append((relative, text))
        parts = relative.split("/")
        if parts[:3] == ["bus", "pci", "devices"] and parts[4:] == ["driver_override"]:
            self._override(parts[3], text)
        elif parts[:3] == ["bus", "pci", "drivers"] and parts[4:] == ["unbind"]:
            self._unbind(parts[3], text.strip())
        elif parts[:3] == ["bus", "pci", "drivers"] and parts[4:] == ["bind"]:
            self._bind(parts[3], text.strip())
        elif relative == "bus/pci/drivers_probe":
            self._probe(text.strip())
        else:
            raise PermissionError(errno.EACCES, "the fake kernel refuses this write", path)

    # -- queries for tests ---------------------------------------------------------

    def driver(self, address: str) -> str | None:
        link = self._device(address) / "driver"
        return os.path.basename(os.readlink(link)) if link.is_symlink() else None

    def override(self, address: str) -> str:
        return (self._device(address) / "driver_override").read_text().strip()

    def addresses_written(self) -> set[str]:
        found = set()
        for relative, text in self.writes:
            parts = relative.split("/")
            found.add(parts[3] if parts[4:] == ["driver_override"] else text.strip())
        return found

    # -- the kernel's side ------------------------------------------------------------

    def _device(self, address: str) -> Path:
        device = self.sys / "bus/pci/devices" / address
        if not device.exists():
            raise OSError(errno.ENODEV, "no such device", str(device))
        return device

    def _override(self, address: str, text: str) -> None:
        value = text.strip()
        (self._device(address) / "driver_override").write_text(f"{value or '(null)'}\n")

    def _unbind(self, driver: str, address: str) -> None:
        if self.driver(address) != driver:
            raise OSError(errno.ENODEV, f"{address} is not bound to {driver}")
        if address in self.busy:
            raise OSError(errno.EBUSY, "device or resource busy")
        (self._device(address) / "driver").unlink()
        (self.sys / "bus/pci/drivers" / driver / address).unlink()
        if driver == VFIO:
            self._vfio_node(address)
        else:
            self._native[address] = driver

    def _probe(self, address: str) -> None:
        if self.driver(address) is not None:
            return
        override = self.override(address)
        target = override if override != "(null)" else self._native.get(address)
        if target is None or not (self.sys / "bus/pci/drivers" / target).is_dir():
            return  # no driver takes it
        self._attach(address, target)

    def _bind(self, driver: str, address: str) -> None:
        """An explicit bind: refused when bound already, or when the override
        names another driver, or when the driver does not drive it."""
        if not (self.sys / "bus/pci/drivers" / driver).is_dir():
            raise OSError(errno.ENOENT, f"no driver {driver}")
        if self.driver(address) is not None:
            raise OSError(errno.EBUSY, f"{address} is bound already")
        override = self.override(address)
        if override not in ("(null)", driver) or driver in self.refuses_bind:
            raise OSError(errno.ENODEV, f"{driver} does not take {address}")
        self._attach(address, driver)

    def _attach(self, address: str, target: str) -> None:
        device, driver_dir = self._device(address), self.sys / "bus/pci/drivers" / target
        real_device, real_driver = device.resolve(), driver_dir.resolve()
        (real_device / "driver").symlink_to(os.path.relpath(real_driver, real_device))
        (real_driver / address).symlink_to(os.path.relpath(real_device, real_driver))
        if target == VFIO:
            self._vfio_node(address)

    def _vfio_node(self, address: str) -> None:
        """/dev/vfio/<group> exists while some member of the group is on vfio-pci."""
        group_link = self._device(address) / "iommu_group"
        if not group_link.is_symlink():
            return
        group = os.path.basename(os.readlink(group_link))
        members = (self.sys / "kernel/iommu_groups" / group / "devices").iterdir()
        node = self.dev / "vfio" / group
        if any(self.driver(member.name) == VFIO for member in members):
            node.parent.mkdir(parents=True, exist_ok=True)
            node.touch()
        elif node.exists():
            node.unlink()
