"""Kernel uevents: parsing the kernel's messages, and one look per burst.

The messages are the kernel's own format (`lib/kobject_uevent.c`), in the
shapes Linux 6.12 sent in the real-kernel tier's guest when VFs were made
and bound; tests/test_real_kernel_iommufd.py sees dp act on the real ones.
Here a datagram socket pair stands in for the netlink socket.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from dp_server.host.uevents import Uevent, UeventMonitor, parse_uevent

VF = "/devices/pci0000:00/0000:00:01.0/0000:01:00.1"


def message(action: str, devpath: str, **fields: str) -> bytes:
    pairs = {"ACTION": action, "DEVPATH": devpath, **fields, "SEQNUM": "2231"}
    return f"{action}@{devpath}\0".encode() + b"".join(
        f"{k}={v}\0".encode() for k, v in pairs.items()
    )


@pytest.mark.parametrize(
    ("data", "parsed"),
    [
        (
            message("add", VF, SUBSYSTEM="pci", PCI_CLASS="10802", PCI_ID="1B36:0010"),
            Uevent("add", VF, "pci"),
        ),
        (message("bind", VF, SUBSYSTEM="pci", DRIVER="vfio-pci"), Uevent("bind", VF, "pci")),
        (
            message("remove", "/devices/virtual/mtty/mtty/83b8f4f2", SUBSYSTEM="mdev"),
            Uevent("remove", "/devices/virtual/mtty/mtty/83b8f4f2", "mdev"),
        ),
        (message("add", "/devices/virtual/vfio/7"), Uevent("add", "/devices/virtual/vfio/7", "")),
        # udev's re-broadcast (group 2), which is never asked for, and garbage
        (b"libudev\0\xfe\xed\xca\xfe(\0\0\0", None),
        (b"", None),
        (b"no at sign\0SUBSYSTEM=pci\0", None),
        (b"add@\0SUBSYSTEM=pci\0", None),
        (b"a-b@/devices\0SUBSYSTEM=pci\0", None),
    ],
)
def test_parse_uevent(data: bytes, parsed: Uevent | None) -> None:
    assert parse_uevent(data) == parsed


async def test_one_look_per_burst_of_relevant_events() -> None:
    ours, kernel = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    ours.setblocking(False)
    monitor = UeventMonitor(ours, {"pci", "mdev"})
    looks: list[float] = []
    loop = asyncio.get_running_loop()

    async def follow() -> None:
        async for _ in monitor.changes():
            looks.append(loop.time())

    task = asyncio.create_task(follow())
    try:
        # Two VFs made: an `add` and a `bind` each, in a row.
        for address in ("0000:01:00.1", "0000:01:00.2"):
            devpath = f"/devices/pci0000:00/0000:00:01.0/{address}"
            kernel.send(message("add", devpath, SUBSYSTEM="pci"))
            kernel.send(message("bind", devpath, SUBSYSTEM="pci", DRIVER="vfio-pci"))
        await asyncio.sleep(0.2)
        assert len(looks) == 1
        # A device of no interest (a network interface) asks for no look.
        kernel.send(message("add", "/devices/virtual/net/tap0", SUBSYSTEM="net"))
        await asyncio.sleep(0.2)
        assert len(looks) == 1
        kernel.send(message("remove", "/devices/virtual/mtty/mtty/83b8f4f2", SUBSYSTEM="mdev"))
        await asyncio.sleep(0.2)
        assert len(looks) == 2
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        kernel.close()
    assert ours.fileno() == -1  # closed with the watch


async def test_the_kernel_socket_opens_and_closes_with_the_watch() -> None:
    # Any process may listen to the kernel's uevents; the watch closes the socket.
    monitor = UeventMonitor.open()
    assert monitor is not None
    changes = monitor.changes()
    waiting = asyncio.ensure_future(changes.__anext__())
    await asyncio.sleep(0.05)
    assert not waiting.done()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
