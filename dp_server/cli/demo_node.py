"""The demo's node: the fixture host served by a runtime to emulated kubelets.

`serving` starts the device-plugin kubelet emulator and, with the config's
`dra`, the DRA kubelet and API-server emulators, all under one temporary
directory, and the real runtime, exactly as `serve` would run it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import attrs

from dp_core import Config, DevicePluginFrontend, PciId, SocketMode
from dp_server.files.sockets import SOCKET_PATH_MAX
from dp_server.runtime.runtime import Runtime, Settings
from dp_testing.apiserver import ApiServerEmulator
from dp_testing.dra_kubelet import DraKubeletEmulator
from dp_testing.emulator import KubeletEmulator

__all__ = ["NODE", "DemoError", "Served", "check_room", "serving"]

NODE = "demo-node"  # the Node the API-server emulator holds, and the DRA pool's name


class DemoError(Exception):
    """The demo cannot run here; the message says why, in one line."""


@attrs.frozen
class Served:
    """A runtime serving the fixture node, and the emulators it is served to."""

    runtime: Runtime
    kubelet: KubeletEmulator
    plugin_dir: Path
    root: Path
    api: ApiServerEmulator | None = None
    dra_kubelet: DraKubeletEmulator | None = None


def _socket_paths(workdir: Path, config: Config) -> list[Path]:
    """Every unix socket the demo makes under `workdir`."""
    plugins = workdir / "device-plugins"
    paths = [plugins / "kubelet.sock", plugins / "dp-000000.sock", workdir / "pod-resources.sock"]
    if config.dra is not None:
        driver = config.dra.driver_name
        paths += [
            workdir / "plugins_registry" / f"{driver}-reg.sock",
            workdir / "plugins" / driver / "dra.sock",
        ]
    return paths


def check_room(workdir: Path, configs: Iterable[Config]) -> None:
    for config in configs:
        for path in _socket_paths(workdir, config):
            if len(os.fsencode(path)) > SOCKET_PATH_MAX:
                raise DemoError(
                    f"TMPDIR={tempfile.gettempdir()} is too long for the demo's unix sockets: "
                    f"{path} would be {len(os.fsencode(path))} bytes, over the "
                    f"{SOCKET_PATH_MAX} Linux allows; run it with a shorter TMPDIR, "
                    "such as TMPDIR=/tmp"
                )


@contextlib.asynccontextmanager
async def serving(
    config: Config,
    root: Path,
    sysfs: Path,
    dev: Path,
    socket_mode: SocketMode = SocketMode.SINGLE,
    names: dict[PciId, str] | None = None,
) -> AsyncIterator[Served]:
    """Serve `config` on the fixture host under `root` until the block ends."""
    plugin_dir = root / "device-plugins"
    kubelet = KubeletEmulator(plugin_dir, pod_resources_socket=root / "pod-resources.sock")
    api = dra_kubelet = None
    settings = Settings(
        sysfs=str(sysfs),
        dev=str(dev),
        device_plugin_dir=str(plugin_dir),
        pod_resources_socket=str(root / "pod-resources.sock"),
        socket_mode=socket_mode,
        state_dir=str(root / "state"),
    )
    if config.dra is not None:
        api = ApiServerEmulator()
        await api.start()
        api.add_node(NODE)
        dra_kubelet = DraKubeletEmulator(root / "plugins_registry")
        await asyncio.to_thread(dra_kubelet.start)
        (root / "cdi").mkdir()
        settings = attrs.evolve(
            settings,
            cdi_spec_dir=str(root / "cdi"),
            node_name=NODE,
            plugins_registry_dir=str(root / "plugins_registry"),
            plugins_dir=str(root / "plugins"),
            kube_api_server=api.url,
        )
    await asyncio.to_thread(kubelet.start)
    runtime = Runtime(settings, config, pci_names=names)
    running = asyncio.create_task(runtime.run())
    try:
        await runtime.ready.wait()
        wanted = runtime.node.frontend(DevicePluginFrontend).resource_names()
        if not await asyncio.to_thread(kubelet.wait_registered, wanted, 10.0, listed=True):
            raise RuntimeError("the emulated kubelet did not see every resource register")
        yield Served(runtime, kubelet, plugin_dir, root, api, dra_kubelet)
    finally:
        runtime.stop()
        await running
        await asyncio.to_thread(kubelet.stop)
        if dra_kubelet is not None:
            await asyncio.to_thread(dra_kubelet.stop)
        if api is not None:
            await api.stop()
