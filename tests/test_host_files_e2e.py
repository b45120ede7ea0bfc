"""Files of the node changing under a running server, end to end through the emulator.

Operators and node agents touch the device-plugin directory and /dev without
the kubelet restarting: a relabel or chmod of a socket, a socket file removed
by hand, /dev/vfio removed when the last VFIO device goes away. Each of these
must leave the kubelet's view right: connections that still work keep being
served, and changes keep reaching the kubelet.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import socket as socket_module
import subprocess
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from dp_core import KubeletCheckpoint, KubeletStarted
from dp_server.cli.demo import DEMO_CONFIG
from dp_server.deviceplugin.kubelet import KubeletFollower
from dp_server.deviceplugin.wiring import DevicePluginRuntime
from dp_server.loop.memory import CollectionPolicy

from e2e_harness import ALL, GPU, KVM, NVME, QAT, Harness

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
    socket = runtime.frontend(DevicePluginRuntime).socket_paths[0]
    identity = (socket.stat().st_ino, socket.stat().st_mtime_ns)
    change(socket)
    await asyncio.sleep(0.5)  # the watcher's batch, and whatever the server does with it
    assert socket.is_socket()  # there, or listened on again
    if change in (_chmod, _hard_link):  # the same file: nothing to do
        assert (socket.stat().st_ino, socket.stat().st_mtime_ns) == identity
    await _changes_still_reach_the_kubelet(harness)
    # The kubelet did not restart: nothing registers again.
    assert {name: emulator.registration_count(name) for name in ALL} == registrations
    assert runtime.frontend(DevicePluginRuntime).open_streams == len(ALL)


async def test_a_chmod_of_kubelet_sock_is_not_a_kubelet_restart(harness: Harness) -> None:
    runtime = await harness.serve()
    emulator = harness.emulator
    assert emulator is not None
    registrations = {name: emulator.registration_count(name) for name in ALL}
    os.chmod(harness.plugin_dir / "kubelet.sock", 0o600)
    await asyncio.sleep(0.5)
    assert {name: emulator.registration_count(name) for name in ALL} == registrations
    assert runtime.frontend(DevicePluginRuntime).open_streams == len(ALL)
    await _changes_still_reach_the_kubelet(harness)


async def test_a_device_plugin_directory_made_again_is_watched_again(harness: Harness) -> None:
    """Removed with the server's socket in it and made again (a node cleanup),
    then the kubelet starts: it is seen at once, not at the next rescan an
    hour later, because the watcher watches the new directory."""
    runtime = await harness.start_server()
    shutil.rmtree(harness.plugin_dir)
    await asyncio.sleep(0.5)
    harness.plugin_dir.mkdir()
    await asyncio.sleep(1.5)  # the watcher's recheck finds the new directory
    assert harness.sockets() == [
        runtime.frontend(DevicePluginRuntime).socket_paths[0].name
    ]  # listening there again
    harness.start_kubelet()
    assert await harness.registered(timeout=5)
    response = await harness.kubelet("allocate", NVME, ["0000:5e:01.0"])
    assert response.envs["PCI_RESOURCE_DEVICES_KUBEVIRT_IO_NVME"] == "0000:5e:01.0"


async def test_while_the_device_plugin_directory_is_gone_open_connections_are_served(
    harness: Harness,
) -> None:
    runtime = await harness.serve()
    for _ in range(50):
        for path in harness.plugin_dir.iterdir():
            path.unlink(missing_ok=True)
        try:
            harness.plugin_dir.rmdir()
            break
        except OSError:  # the kubelet wrote its checkpoint meanwhile, as it does at each list
            await asyncio.sleep(0.02)
    await asyncio.sleep(0.5)
    assert harness.runtime is not None and harness.runtime.failure is None
    response = await harness.kubelet("allocate", NVME, ["0000:5e:01.0"])
    assert response.envs["PCI_RESOURCE_DEVICES_KUBEVIRT_IO_NVME"] == "0000:5e:01.0"
    assert runtime.frontend(DevicePluginRuntime).open_streams == len(ALL)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a filesystem needs root (CI runs as root)")
async def test_a_device_plugin_directory_on_another_filesystem_stops_the_server(
    harness: Harness,
) -> None:
    """What a container sees when the host directory its hostPath volume
    mounted is removed: the path is the container's own empty directory, on
    another filesystem. Nothing made there reaches the kubelet; the server
    stops with a reason, and its restart mounts the kubelet's directory again.
    A tmpfs mounted over the directory gives the path another filesystem."""
    runtime = await harness.serve(rescan_interval=0.2)  # the periodic look finds it
    subprocess.run(["mount", "-t", "tmpfs", "dp-test", str(harness.plugin_dir)], check=True)
    try:
        assert harness._serving is not None
        await asyncio.wait_for(harness._serving, 5)
        assert runtime.failure is not None
        assert str(harness.plugin_dir) in runtime.failure
        assert "another filesystem" in runtime.failure
        # Nothing was made on the other filesystem.
        assert not [name for name in harness.sockets() if name != "kubelet.sock"]
    finally:
        subprocess.run(["umount", str(harness.plugin_dir)], check=True)


async def test_dev_vfio_removed_and_made_again_is_seen_without_a_rescan(harness: Harness) -> None:
    """devtmpfs removes /dev/vfio with its last group node (every device left
    vfio-pci) and makes it again with the next; the watcher follows it."""
    await harness.serve()
    vfio = harness.dev / "vfio"
    parked = harness.root / "vfio-parked"
    vfio.rename(parked)
    assert await harness.wait(
        lambda e: all(not d.healthy for d in e.resources()[NVME].devices.values())
    )
    parked.rename(vfio)
    assert await harness.wait(
        lambda e: all(d.healthy for d in e.resources()[NVME].devices.values())
    )
    (vfio / "109").unlink()  # and changes inside the new directory are seen too
    assert await harness.wait(
        lambda e: e.resources()[QAT].devices["0000:6b:00.2"].health == "Unhealthy"
    )


async def test_a_config_written_in_place_is_read_once_it_is_whole(harness: Harness) -> None:
    """An editor, `tee` or a copy writes the file in place: empty first, then
    the new text. Read half-way, it would be another config (the defaults),
    and the kubelet would see the GPUs go and come back."""
    path = harness.root / "config.yaml"
    path.write_text(DEMO_CONFIG)
    runtime, _ = await harness.serve_config_file(path)
    emulator = harness.emulator
    assert emulator is not None
    gpus_seen: list[int] = []

    async def watch_gpus() -> None:
        while True:
            gpus_seen.append(emulator.allocatable().get(GPU, 0))
            await asyncio.sleep(0.02)

    watching = asyncio.create_task(watch_gpus())
    try:
        with path.open("w") as config:
            config.flush()  # empty, for longer than the watcher's debounce
            await asyncio.sleep(0.4)
            config.write(DEMO_CONFIG.replace("{count: 1000}", "{count: 9}"))
        assert await harness.wait(lambda e: len(e.resources()[KVM].devices) == 9)
    finally:
        watching.cancel()
    assert gpus_seen and set(gpus_seen) == {gpus_seen[0]} and gpus_seen[0] > 0
    assert runtime.config.shared_devices[0].count == 9


async def test_an_emptied_config_keeps_the_previous_one(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="dp.runtime")
    path = harness.root / "config.yaml"
    path.write_text(DEMO_CONFIG)
    runtime, config = await harness.serve_config_file(path)
    path.write_text("")
    await harness.config_read(runtime)
    assert runtime.config == config
    rejected = [r for r in caplog.records if r.getMessage() == "config-rejected"]
    assert [r.dp_fields["error"] for r in rejected] == [f"{path} is empty"]  # type: ignore[attr-defined]


class _Follower:
    """A KubeletFollower with no file watcher beside it, on its own kubelet.sock."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "kubelet.sock"
        self.inputs: list[object] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.follower = KubeletFollower(
            self.path,
            retire=lambda: None,
            checkpoint=KubeletCheckpoint,
            ids=itertools.count(1),
            feed=self.inputs.append,
            now=time.monotonic,
            spawn=self.spawn,
            memory=CollectionPolicy(),
            stopping=lambda: False,
        )

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coroutine)
        self.tasks.append(task)
        return task

    def make_kubelet_sock(self) -> socket_module.socket:
        listening = socket_module.socket(socket_module.AF_UNIX)
        listening.bind(str(self.path))
        return listening

    async def started_within(self, seconds: float) -> bool:
        async with asyncio.timeout(seconds):
            while not any(isinstance(i, KubeletStarted) for i in self.inputs):
                await asyncio.sleep(0.002)
        return True

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def test_a_kubelet_the_watcher_missed_is_found_by_looking(tmp_path: Path) -> None:
    """While there is no kubelet.sock the server also looks for it once a
    second: a socket made before the file watch was in place (the watcher
    starts in its own thread) gives no event."""
    follower = _Follower(tmp_path)
    follower.follower.follow(fast=False)  # what the runtime does without a kubelet
    await asyncio.sleep(0.05)
    kubelet = follower.make_kubelet_sock()
    try:
        assert await follower.started_within(2.5)
    finally:
        kubelet.close()
        await follower.close()


async def test_a_kubelet_restart_cuts_a_slow_look_short(tmp_path: Path) -> None:
    """Looking once a second while there is no kubelet.sock must not delay the
    quick looks a lost kubelet connection starts: the slow one is replaced."""
    follower = _Follower(tmp_path)
    follower.follower.follow(fast=False)  # no kubelet: looking once a second
    await asyncio.sleep(0.05)  # the slow look is asleep
    follower.follower.follow()  # what a lost kubelet connection does
    kubelet = follower.make_kubelet_sock()
    started = time.monotonic()
    try:
        assert await follower.started_within(2.5)
        assert time.monotonic() - started < 0.5  # not at the slow look's next step
    finally:
        kubelet.close()
        await follower.close()
