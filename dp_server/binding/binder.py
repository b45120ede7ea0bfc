"""Carrying out `BindDevice` and `UnbindDevice`: the kernel's rebinding files.

docs/design.md §6: write `vfio-pci` to the function's `driver_override`, unbind it
from its driver, then ask the kernel to probe it; never `new_id`, which would
bind every function with that vendor and device ID. The core decided that the
function may be moved (`dp_core.binding`); this checks just before writing
that the driver the core saw still holds it, and gives the function back
(previous `driver_override`, probe) when the move fails halfway, so a failed
bind does not leave a device driverless. `UnbindDevice` gives a function
dp moved back to the driver it was taken from, by an explicit bind.

Every write goes through one function, so tests can stand a fake kernel in
for sysfs (tests/fake_kernel.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from dp_core import VFIO_DRIVER, PciAddress

__all__ = ["Binder", "Writer", "write_attribute"]

_log = logging.getLogger("dp.binder")

Writer = Callable[[str, str], None]


def write_attribute(path: str, text: str) -> None:
    """One write to a sysfs attribute, as the kernel expects it.

    Never creates the file: a missing attribute is an error to report, and on a
    real sysfs creating files is impossible anyway.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _unexpected(what: str, address: PciAddress, error: Exception) -> str:
    """An unexpected error as an answer: the core must hear back in every case."""
    _log.exception("%s of %s failed unexpectedly", what, address)
    return f"unexpected {type(error).__name__}: {error}; check the device by hand"


def _override_text(previous: str) -> str:
    """What to write to restore a `driver_override` read as `previous`.

    The kernel shows an empty override as "(null)"; writing a newline clears it.
    """
    return "\n" if previous in ("", "(null)") else previous


def _why(error: OSError) -> str:
    return error.strerror or type(error).__name__


class Binder:
    """Moves PCI functions under `sysfs_root` to vfio-pci, one call at a time."""

    def __init__(self, sysfs_root: str, write: Writer = write_attribute) -> None:
        self.sys = os.fspath(sysfs_root).rstrip("/")
        self._write = write

    def driver_of(self, address: PciAddress) -> str | None:
        """The driver bound to `address`, None if none; OSError if that cannot be read."""
        try:
            return os.path.basename(os.readlink(f"{self._device(address)}/driver"))
        except FileNotFoundError:
            return None

    def on_vfio(self, address: PciAddress) -> bool:
        """Whether vfio-pci holds `address` now (False when that cannot be read)."""
        try:
            return self.driver_of(address) == VFIO_DRIVER
        except OSError:
            return False

    def bind(self, address: PciAddress, driver: str | None) -> str | None:
        """Move `address` from `driver` to vfio-pci: None when it got there, else why not."""
        return self.move(address, driver)[0]

    def move(self, address: PciAddress, driver: str | None) -> tuple[str | None, bool]:
        """`bind`, and whether the function's driver_override named `driver` before:
        a function held by its driver only through an override (pci-stub, an
        administrator's pin) needs it back when it is given back (`pinned`)."""
        try:
            return self._bind(address, driver)
        except Exception as error:  # noqa: BLE001
            return _unexpected("bind", address, error), False

    def _bind(self, address: PciAddress, driver: str | None) -> tuple[str | None, bool]:
        device = self._device(address)
        try:
            current = self.driver_of(address)
            with open(f"{device}/driver_override", errors="replace") as file:
                previous = file.read().strip()
            enabled_vfs = self._enabled_vfs(device)
        except OSError as error:
            return f"cannot read {device}: {_why(error)}; left alone", False
        if current != driver:
            why = f"its driver is {current or 'none'} now, not {driver or 'none'} as scanned"
            return why + "; left alone", False
        if enabled_vfs and driver is not None:
            why = f"{enabled_vfs} now; unbinding {driver} would remove them"
            return why + ", so it is left alone", False
        steps = [(f"{device}/driver_override", VFIO_DRIVER)]
        if driver is not None:
            steps.append((f"{self.sys}/bus/pci/drivers/{driver}/unbind", str(address)))
        steps.append((f"{self.sys}/bus/pci/drivers_probe", str(address)))
        error_text: str | None = None
        for path, text in steps:
            try:
                self._write(path, text)
            except OSError as error:
                error_text = f"writing {text!r} to {path} failed: {_why(error)}"
                break
        try:
            after = self.driver_of(address)
        except OSError as error:
            after = None
            error_text = error_text or f"its driver cannot be read after the bind: {_why(error)}"
        if error_text is None and after == VFIO_DRIVER:
            # Only an override naming `driver` is put back by a give-back: one
            # naming another driver would stop the function's rebind.
            return None, driver is not None and previous == driver
        if error_text is None:
            error_text = f"after drivers_probe it is bound to {after or 'no driver'}"
        return error_text + self._give_back(address, previous, after), False

    def unbind(
        self, address: PciAddress, driver: str | None, *, pinned: bool = False
    ) -> str | None:
        """Give `address` back from vfio-pci to `driver`, its driver_override naming
        `driver` again if `pinned` (see `move`): None when it got there, else why not."""
        try:
            return self._unbind(address, driver, pinned)
        except Exception as error:  # noqa: BLE001
            return _unexpected("give-back", address, error)

    def _unbind(self, address: PciAddress, driver: str | None, pinned: bool) -> str | None:
        device = self._device(address)
        try:
            current = self.driver_of(address)
        except OSError as error:
            return f"cannot read {device}: {_why(error)}; left alone"
        if current != VFIO_DRIVER:
            return f"its driver is {current or 'none'} now, not {VFIO_DRIVER}; left alone"
        # Unbind, then put back the override the function had before dp moved
        # it (usually none), which would otherwise tie it to vfio-pci, then
        # bind explicitly: a probe could pick another driver that matches.
        steps = [
            (f"{self.sys}/bus/pci/drivers/{VFIO_DRIVER}/unbind", str(address)),
            (f"{device}/driver_override", _override_text(driver if pinned and driver else "")),
        ]
        if driver is not None:
            steps.append((f"{self.sys}/bus/pci/drivers/{driver}/bind", str(address)))
        for path, text in steps:
            try:
                self._write(path, text)
            except OSError as error:
                return f"writing {text.strip()!r} to {path} failed: {_why(error)}"
        try:
            after = self.driver_of(address)
        except OSError as error:
            return f"its driver cannot be read after the give-back: {_why(error)}"
        if after != driver:
            return f"after the give-back it is bound to {after or 'no driver'}"
        return None

    @staticmethod
    def _enabled_vfs(device: str) -> str:
        """The virtual functions enabled on `device`, as a phrase; empty if none.

        Read again just before the unbind: VFs may have been enabled since the
        scan, and unbinding their physical function's driver destroys them.
        """
        links = sum(1 for name in os.listdir(device) if name.startswith("virtfn"))
        try:
            with open(f"{device}/sriov_numvfs") as file:
                text = file.read().strip()
        except FileNotFoundError:
            text = "0"  # not SR-IOV capable
        if links or text != "0":
            return f"it has virtual functions enabled (sriov_numvfs {text!r}, {links} virtfn links)"
        return ""

    def _give_back(self, address: PciAddress, previous: str, now: str | None) -> str:
        """Undo a bind that did not finish; what could not be undone, for the message."""
        device = self._device(address)
        try:
            self._write(f"{device}/driver_override", _override_text(previous))
            if now is None:
                self._write(f"{self.sys}/bus/pci/drivers_probe", str(address))
        except OSError as error:
            _log.error("could not give %s back to its driver: %s", address, _why(error))
            return f"; giving it back failed too: {_why(error)}"
        try:
            back = self.driver_of(address)
        except OSError as error:
            return f"; its driver cannot be read: {_why(error)}"
        return f"; given back to {back}" if back else "; it has no driver now"

    def _device(self, address: PciAddress) -> str:
        return f"{self.sys}/bus/pci/devices/{address}"
