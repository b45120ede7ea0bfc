"""Files of the node changing under a running server, end to end through the emulator.

Operators and node agents touch the device-plugin directory and /dev without
the kubelet restarting: a relabel or chmod of a socket, a socket file removed
by hand, /dev/vfio removed when the last VFIO device goes away. Each of these
must leave the kubelet's view right: connections that still work keep being
served, and changes keep reaching the kubelet.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from e2e_harness import ALL, NVME, QAT, Harness

pytestmark = pytest.mark.asyncio


def _chmod(path: Path) -> None:
    os.chmod(path, 0o600)


def _hard_link(path: Path) -> None:
    link = path.with_name(path.name + ".link")
    os.link(path, link)
    link.unlink()


def _touch(path: Path) -> None:
    os.utime(path)


def _remove(path: Path) -> None:
    path.unlink()


async def _changes_still_reach_the_kubelet(harness: Harness) -> None:
    """A host change is published on the kubelet's existing streams, and an
    Allocate on its existing connection is answered."""
    emulator = harness.emulator
    assert emulator is not None
    (harness.dev / "vfio" / "109").unlink()  # QAT VF 0000:6b:00.2 loses its group node
    assert await harness.wait(
        lambda e: e.resources()[QAT].devices["0000:6b:00.2"].health == "Unhealthy"
    ), emulator.resources()[QAT].devices
    response = await harness.kubelet("allocate", NVME, ["0000:5e:01.0"])
    assert response.envs["PCI_RESOURCE_DEVICES_KUBEVIRT_IO_NVME"] == "0000:5e:01.0"


@pytest.mark.parametrize(
    "change",
    [_chmod, _hard_link, _touch, _remove],
    ids=["chmod", "hard link", "touch", "removed"],
)
async def test_our_socket_file_changing_keeps_the_kubelets_streams(
    harness: Harness, change: Callable[[Path], None]
) -> None:
    runtime = await harness.serve()
    emulator = harness.emulator
    assert emulator is not None
    registrations = {name: emulator.registration_count(name) for name in ALL}
    socket = runtime.socket_paths[0]
    identity = (socket.stat().st_ino, socket.stat().st_mtime_ns)
    change(socket)
    await asyncio.sleep(0.5)  # the watcher's batch, and whatever the server does with it
    assert socket.is_socket()  # there, or listened on again
    if change in (_chmod, _hard_link):  # the same file: nothing to do
        assert (socket.stat().st_ino, socket.stat().st_mtime_ns) == identity
    await _changes_still_reach_the_kubelet(harness)
    # The kubelet did not restart: nothing registers again.
    assert {name: emulator.registration_count(name) for name in ALL} == registrations
    assert len(runtime._streams) == len(ALL)


async def test_a_chmod_of_kubelet_sock_is_not_a_kubelet_restart(harness: Harness) -> None:
    runtime = await harness.serve()
    emulator = harness.emulator
    assert emulator is not None
    registrations = {name: emulator.registration_count(name) for name in ALL}
    os.chmod(harness.plugin_dir / "kubelet.sock", 0o600)
    await asyncio.sleep(0.5)
    assert {name: emulator.registration_count(name) for name in ALL} == registrations
    assert len(runtime._streams) == len(ALL)
    await _changes_still_reach_the_kubelet(harness)
