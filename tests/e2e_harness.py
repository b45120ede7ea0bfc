"""The real runtime on the fixture node, against the grpcio kubelet emulator."""

from __future__ import annotations

import asyncio
import gc
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from dp_core import Backoff, Config, PciId, SocketMode, Timing
from dp_server.binding.binder import Binder
from dp_server.cli.demo import DEMO_CONFIG
from dp_server.cli.main import load_settings
from dp_server.config.loader import parse_config
from dp_server.runtime.frontends import FRONTENDS, Plug
from dp_server.runtime.runtime import Runtime, Settings
from dp_testing.emulator import KubeletEmulator
from dp_testing.topology import fixture_topology, write_sysfs

GPU = "nvidia.com/TU104GL_Tesla_T4"
QAT = "intel.com/qat_vf"
NVME = "devices.kubevirt.io/nvme"
VGPU = "nvidia.com/GRID_RTX6000-4Q"
KVM = "devices.kubevirt.io/kvm"
TUN = "devices.kubevirt.io/tun"
VHOST = "devices.kubevirt.io/vhost-net"
ALL = (KVM, NVME, TUN, VHOST, QAT, VGPU, GPU)

FAST = Timing(dial_wait=1.0, backoff=Backoff(first=0.05, cap=0.5), release_grace=0.2)


def live(kind: type) -> list[Any]:
    """Every instance of `kind`, including garbage not yet collected."""
    return [o for o in gc.get_objects() if isinstance(o, kind)]


class Harness:
    """Owns a temp dir with a fixture host, an emulator and a runtime."""

    def __init__(self) -> None:
        # Unix socket paths are limited to 108 bytes: keep the directory short.
        self.root = Path(tempfile.mkdtemp(prefix="dp-t-"))
        self.sysfs, self.dev = write_sysfs(fixture_topology(), self.root / "host")
        self.plugin_dir = self.root / "dp"
        self.plugin_dir.mkdir()  # the kubelet's, there before dp starts, as on a node
        self.pod_resources = self.root / "pr.sock"
        self.emulator: KubeletEmulator | None = None
        self.runtime: Runtime | None = None
        self._serving: asyncio.Task[None] | None = None

    def settings(self, **overrides: Any) -> Settings:
        base = Settings(
            sysfs=str(self.sysfs),
            dev=str(self.dev),
            device_plugin_dir=str(self.plugin_dir),
            pod_resources_socket=str(self.pod_resources),
            rescan_interval=3600.0,
            pod_resources_interval=0.2,
            pod_resources_min_gap=0.05,
            timing=FAST,
        )
        return attrs.evolve(base, **overrides)

    def start_kubelet(self, **kwargs: Any) -> KubeletEmulator:
        kwargs.setdefault("pod_resources_socket", self.pod_resources)
        self.emulator = KubeletEmulator(self.plugin_dir, **kwargs).start()
        return self.emulator

    async def start_server(
        self,
        config: Config | None = None,
        socket_mode: SocketMode = SocketMode.SINGLE,
        binder: Binder | None = None,
        frontends: Sequence[Plug] = FRONTENDS,
        **overrides: Any,
    ) -> Runtime:
        config = config or parse_config(DEMO_CONFIG, "<demo>")
        settings = self.settings(socket_mode=socket_mode, **overrides)
        self.runtime = Runtime(settings, config, binder=binder, frontends=frontends)
        self._serving = asyncio.create_task(self.runtime.run())
        await asyncio.wait_for(self.runtime.ready.wait(), 5)
        return self.runtime

    async def stop_server(self) -> None:
        """Stop the server as SIGTERM does, and wait until it has."""
        assert self.runtime is not None and self._serving is not None
        self.runtime.stop()
        await asyncio.wait_for(self._serving, 10)
        self.runtime = self._serving = None

    async def serve_config_file(
        self, path: Path, reload: Callable[[], tuple[Config, dict[PciId, str]]] | None = None
    ) -> tuple[Runtime, Config]:
        """Start the kubelet, then serve `path` as `dp-server serve --config` does:
        loaded, and watched for changes (reloaded with `reload`, or by loading it)."""
        config, _ = load_settings(str(path))
        self.start_kubelet()
        self.runtime = Runtime(
            self.settings(config_path=str(path)),
            config,
            reload=reload or (lambda: load_settings(str(path))),
        )
        self._serving = asyncio.create_task(self.runtime.run())
        await self.runtime.ready.wait()
        assert await self.registered()
        return self.runtime, config

    async def config_read(self, runtime: Runtime, timeout: float = 5) -> None:
        """Wait until a change to the served config file has been noticed and,
        once settled, read (or rejected)."""
        async with asyncio.timeout(timeout):
            while runtime.config_change_due is None:  # the watcher's batch has not come yet
                await asyncio.sleep(0.02)
            while runtime.config_change_due is not None:
                await asyncio.sleep(0.02)

    async def serve(self, kubelet: dict[str, Any] | None = None, **server: Any) -> Runtime:
        """Start the kubelet (with `kubelet` options), then the server (with
        `server` options), and wait until every resource is listed."""
        emulator = self.start_kubelet(**(kubelet or {}))
        runtime = await self.start_server(**server)
        assert await self.registered(), emulator.resources()
        return runtime

    async def restart_kubelet(self) -> dict[str, int]:
        """Restart the kubelet and wait until every resource has registered again
        and is listed; returns each resource's registration count before."""
        emulator = self.emulator
        assert emulator is not None
        before = {name: emulator.registration_count(name) for name in ALL}
        await self.kubelet("restart")
        assert await self.wait(
            lambda e: all(e.registration_count(n) > before[n] for n in ALL), timeout=5
        )
        assert await self.registered()
        return before

    async def wait(self, predicate: Callable[[KubeletEmulator], bool], timeout: float = 5) -> bool:
        assert self.emulator is not None
        return await asyncio.to_thread(self.emulator.wait_for, predicate, timeout)

    async def registered(self, names: tuple[str, ...] = ALL, timeout: float = 5) -> bool:
        assert self.emulator is not None
        return await asyncio.to_thread(self.emulator.wait_registered, names, timeout, listed=True)

    async def kubelet(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call a blocking emulator method off the loop the server runs on."""
        assert self.emulator is not None
        return await asyncio.to_thread(getattr(self.emulator, method), *args, **kwargs)

    def sockets(self) -> list[str]:
        return sorted(p.name for p in self.plugin_dir.iterdir() if p.is_socket())

    async def close(self) -> None:
        if self.runtime is not None:
            self.runtime.stop()
        if self._serving is not None:
            await asyncio.wait_for(self._serving, 10)
        if self.emulator is not None:
            await asyncio.to_thread(self.emulator.stop)
        shutil.rmtree(self.root, ignore_errors=True)
