"""The asyncio shell: one event loop serving every front end.

`Runtime` puts the sub-systems together around one `dp_core.Node` on one
`Loop` (feed, call, the effect handlers each sub-system registers):

- `DevicePluginRuntime` (deviceplugin): the plugin sockets, the kubelet and
  its connections, Registers, streams, PodResources, the CDI spec directory;
- `DraRuntime` (dra), with the config's `dra`: the DRA sockets, claims and
  their files, the checkpoint, the ResourceSlices;
- `BindingRuntime` (binding): moves to vfio-pci and back, the moves file;
- `TimerLoop` wakes the server at its deadlines, `CollectionPolicy` decides
  when to run the garbage collector, `Tasks` keeps the background tasks;
- with `--metrics-address`, the status endpoint (monitoring).

What is Runtime's own is the host and the config: watching (watchfiles on the
device-plugin directory, /dev/vfio and the config's directory; the kernel's
uevents for devices that come or change driver), rescans, config reloads,
and the life cycle. Nothing here decides policy.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dp_core import (
    Config,
    ConfigApplied,
    HostObserved,
    Input,
    Log,
    PciId,
    StandardNode,
    Tick,
)
from dp_server.binding.binder import Binder
from dp_server.binding.runtime import BindingRuntime
from dp_server.config.settings import Settings, SettingsError, socket_name_room
from dp_server.deviceplugin.runtime import KUBELET_SOCKET, DevicePluginRuntime
from dp_server.deviceplugin.sockets import PluginDirectoryLost
from dp_server.host.scanner import scan_host
from dp_server.host.uevents import UeventMonitor
from dp_server.host.watcher import DirectoryWatcher, FileVersion
from dp_server.loop import CallbackTimer, CollectionPolicy, Loop, Tasks, TimerLoop
from dp_server.monitoring.logs import emit

if TYPE_CHECKING:
    from dp_server.deviceplugin.kubelet import KubeletFollower
    from dp_server.dra.runtime import DraRuntime
    from dp_server.monitoring.endpoint import StatusEndpoint

__all__ = ["KUBELET_SOCKET", "Runtime", "Settings"]

_log = logging.getLogger("dp.runtime")
_CONFIG_SETTLE = 1.0  # a changed config file is read once it stayed the same this long


class Runtime:
    """Runs a Node against the real world. Create, `await run()`, `stop()`."""

    def __init__(
        self,
        settings: Settings,
        config: Config,
        *,
        pci_names: dict[PciId, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        reload: Callable[[], tuple[Config, dict[PciId, str]]] | None = None,
        binder: Binder | None = None,
    ) -> None:
        self.settings = settings
        self.config = config
        self._reload = reload
        prefix = settings.endpoint_prefix or f"dp-{os.urandom(3).hex()}"
        if config.dra is not None and not settings.node_name:
            raise SettingsError(
                "the config's dra section turns the DRA front end on, which needs this "
                "node's name: --node-name or the NODE_NAME environment variable"
            )
        self.node = StandardNode(
            config,
            socket_mode=settings.socket_mode,
            endpoint_prefix=prefix,
            endpoint_max_length=socket_name_room(settings.device_plugin_dir, prefix),
            timing=settings.timing,
            pci_names=pci_names,
            cdi=settings.cdi_spec_dir is not None,
            node_name=settings.node_name,
        )
        self.loop = Loop(self.node, clock)
        self.loop.on(Log, emit)  # every part of the core logs
        self.ready = asyncio.Event()
        self.failure: str | None = None  # why the server stopped itself, if it did
        self.last_rescan: tuple[float, float] | None = None  # (when, seconds it took)
        self.rescan_failures = 0
        self._stopping = False
        self._stop = asyncio.Event()
        self._next_rescan = 0.0
        self._watcher: DirectoryWatcher | None = None
        self._status: StatusEndpoint | None = None  # serving /metrics, with --metrics-address
        watched = settings.config_path if reload is not None else None
        self._config_version = (
            FileVersion(Path(watched).absolute(), settle=_CONFIG_SETTLE) if watched else None
        )

        self._tasks = Tasks(self.stopping)
        self._memory = CollectionPolicy()
        self.device_plugin = DevicePluginRuntime(
            settings,
            self.loop,
            spawn=self._tasks.spawn,
            memory=self._memory,
            stopping=self.stopping,
        )
        self.plugin_dir = self.device_plugin.plugin_dir
        self.kubelet_socket = self.device_plugin.kubelet_socket
        self.binding = BindingRuntime(
            self.loop,
            binder or Binder(settings.sysfs),
            settings.state_dir,
            spawn=self._tasks.spawn,
            stopping=self.stopping,
            rescan=self.try_rescan,
        )
        self.dra: DraRuntime | None = None
        if config.dra is not None:
            # Only with the config's dra section: the Kubernetes client
            # (lightkube, httpx, anyio) is no part of a device plugin's memory.
            from dp_server.dra.runtime import DraRuntime

            self.dra = DraRuntime(settings, config.dra.driver_name, self.loop)
        self._timers = TimerLoop(
            [
                CallbackTimer(lambda now: self.node.next_deadline(), self._tick),
                CallbackTimer(lambda now: self._next_rescan, self._rescan_due),
                *self.device_plugin.timers(),
                CallbackTimer(self._config_due_at, self._config_settled),
            ],
            self.now,
        )
        self.loop.after_input(self._timers.poke)

    # -- feeding the core ------------------------------------------------------

    def now(self) -> float:
        return self.loop.now()

    def stopping(self) -> bool:
        return self._stopping

    def feed(self, event: Input) -> None:
        """Hand `event` to the core, and carry out what it answers (`Loop.feed`)."""
        self.loop.feed(event)

    @property
    def kubelet(self) -> KubeletFollower:
        return self.device_plugin.kubelet

    # -- sockets -----------------------------------------------------------------------

    async def _check_sockets(self) -> None:
        """React to the kubelet (re)creating kubelet.sock or deleting our sockets."""
        try:
            await self.device_plugin.restore()
        except PluginDirectoryLost as error:
            self.fail(str(error))
            return
        if self.dra is not None:
            await self.dra.restore()
        self.device_plugin.look()

    # -- the host ----------------------------------------------------------------------

    def rescan(self) -> None:
        started = time.perf_counter()
        shared_paths = [device.path for device in self.config.enabled_shared_devices]
        with self._memory.scanning():
            snapshot = scan_host(self.settings.sysfs, self.settings.dev, dev_paths=shared_paths)
        scanned_in = time.perf_counter() - started
        self.feed(HostObserved(snapshot, self.now()))
        self._next_rescan = self.now() + self.settings.rescan_interval
        self.last_rescan = (self.now(), scanned_in)
        self._memory.after_rescan()

    def try_rescan(self) -> bool:
        """Rescan; a failure is logged and counted in `rescan_failures`, not raised.

        One bad rescan must not stop the server: the next one is tried after
        the rescan interval, and the health probe reports the failures.
        """
        try:
            self.rescan()
        except Exception:  # noqa: BLE001
            self.rescan_failures += 1
            _log.exception("rescan-failed")
            self._next_rescan = self.now() + self.settings.rescan_interval
            return False
        return True

    # -- timers ------------------------------------------------------------------------

    def _tick(self, now: float) -> None:
        self.feed(Tick(now))

    def _rescan_due(self, now: float) -> None:
        self.try_rescan()
        # Should a file event ever be missed, the periodic look catches it.
        self._tasks.spawn(self._check_sockets())
        self._notice_config()

    def _config_due_at(self, now: float) -> float | None:
        return self._config_version.due_at if self._config_version is not None else None

    def _config_settled(self, now: float) -> None:
        if self._config_version is not None and self._config_version.settled(now):
            self.reload_config()

    # -- the config file ---------------------------------------------------------------

    def _notice_config(self) -> None:
        if self._config_version is not None:
            self._config_version.noticed(self.now())
            self._timers.wake()  # it is read once it has settled

    def reload_config(self) -> None:
        """Apply the config file again; a broken one is logged and the old one kept."""
        if self._reload is None:
            return
        try:
            if self._config_version is not None and self._config_version.empty():
                # Defaults at start; in a running server, a write caught half-way.
                raise ValueError(f"{self._config_version.path} is empty")
            config, names = self._reload()
        except Exception as error:  # noqa: BLE001 - every failure keeps the old config
            _log.error(
                "config-rejected",
                extra={"dp_fields": {"error": str(error), "kept": "the previous config"}},
            )
            return
        if config == self.config:
            return
        if config.dra != self.config.dra:
            # The DRA sockets, the API client and the pool are made for one driver.
            _log.error(
                "config-rejected",
                extra={
                    "dp_fields": {
                        "error": "a change to the dra section takes a restart of dp",
                        "kept": "the previous config",
                    }
                },
            )
            return
        self.config = config
        self.feed(ConfigApplied(config, self.now(), names))
        _log.info("config-applied", extra={"dp_fields": {"path": self.settings.config_path}})
        self.rescan()

    # -- watched directories -----------------------------------------------------------

    async def _watch_files(self) -> None:
        # watchfiles reports absolute paths, whatever the flags said.
        plugin_dir, vfio = self.plugin_dir.absolute(), Path(self.settings.dev).absolute() / "vfio"
        # The VFIO character devices live one level down, and the watch is
        # not recursive. (/dev/iommu comes and goes only with the iommufd
        # module: the periodic rescan sees it.)
        cdevs = vfio / "devices"
        config = self._config_version.path.parent if self._config_version else None
        dra_dirs: tuple[Path, ...] = ()
        if self.dra is not None:
            endpoints = self.dra.endpoints
            dra_dirs = tuple(
                p.parent.absolute()
                for p in (endpoints.registration_socket_path, endpoints.dra_socket_path)
            )
        watched = (plugin_dir, vfio, cdevs, config, *dra_dirs)
        directories = list(dict.fromkeys(d for d in watched if d is not None))
        # A removed /dev/vfio node is a device turning Unhealthy: the watch
        # reports it 20-40 ms after it happens (at 50 ms steps, 50-100 ms),
        # for about 0.1 % of a core more while idle.
        self._watcher = DirectoryWatcher(directories, step_ms=20)
        async for changed in self._watcher.changes():
            # An entry changed, or the directory itself (removed, made again);
            # nothing: the watch is in place now, and kubelet.sock or the config
            # may have changed before it was.
            touched: set[Path | None] = {*changed, *(path.parent for path in changed)}
            if not changed:
                touched = {plugin_dir, config}
            try:
                if plugin_dir in touched:
                    await self._check_sockets()
                if vfio in touched or cdevs in touched:
                    self.try_rescan()
                if config in touched:
                    self._notice_config()
                if self.dra is not None and any(d in touched for d in dra_dirs):
                    await self.dra.restore()  # the plugin watcher registers a new socket
            except Exception:  # noqa: BLE001 - the next change must still be seen
                _log.exception("watch-event-failed")

    def _open_uevents(self) -> UeventMonitor | None:
        # Devices that come or change driver without touching /dev/vfio (VFs
        # made by sriov_numvfs, a hot-plugged function): the kernel's uevents,
        # for the kernel's own /sys only (a fixture tree has no such events).
        if os.path.realpath(self.settings.sysfs) != "/sys":
            return None
        return UeventMonitor.open()

    async def _follow_uevents(self, monitor: UeventMonitor) -> None:
        async for _ in monitor.changes():
            self.try_rescan()

    @property
    def watching(self) -> bool:
        """Whether the file watcher's thread is running."""
        return self._watcher is not None and self._watcher.running

    # -- life cycle --------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until `stop()`; then end streams, close and remove sockets."""
        if self.settings.metrics_address is not None:
            # Only with the flag: prometheus-client and h11 are 3 MB of a
            # server that does not use them otherwise.
            from dp_server.monitoring.endpoint import start_status

            host, port = self.settings.metrics_address
            try:
                self._status = await start_status(self, (host, port))
            except OSError as error:
                reason = error.strerror or error
                message = f"--metrics-address {host or ''}:{port}: cannot listen: {reason}"
                raise SettingsError(message) from error
        try:
            plugin_dir_present = self.device_plugin.clear()
            self.binding.recall()
            # Listening before the first scan: no device that comes meanwhile is missed.
            uevents = self._open_uevents()
            self.rescan()
            if self.dra is not None:
                self.dra.recall()  # before the DRA sockets serve a Prepare
            if plugin_dir_present:
                await self.device_plugin.listen()
            self._tasks.spawn(self._watch_files(), essential="file-watch")
            if uevents is not None:
                self._tasks.spawn(self._follow_uevents(uevents))
            self._tasks.spawn(self._timers.run(), essential="timer-loop")
            await self._check_sockets()
            self.device_plugin.follow()
            if self.dra is not None:
                await self.dra.start(self._tasks.spawn)
        except BaseException:
            if self._status is not None:
                await self._status.close()
            if self.dra is not None:
                await self.dra.close()
                await self._tasks.cancel_all()
                await self.dra.close_api()
            raise
        self.ready.set()
        serving: dict[str, object] = {
            "resources": len(self.node.device_plugin.resource_names()),
            "directory": str(self.plugin_dir),
            "sockets": ", ".join(p.name for p in self.socket_paths) or "none yet",
        }
        if self.settings.config_path or self._reload is not None:
            serving["config"] = self.settings.config_path or "none (the defaults)"
        _log.info("serving", extra={"dp_fields": serving})
        try:
            await self._stop.wait()
        finally:
            await self._shutdown()

    def fail(self, reason: str) -> None:
        """Stop, for a reason only a restart of the process can fix."""
        _log.error("stopping", extra={"dp_fields": {"reason": reason}})
        self.failure = reason
        self.stop()

    def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.stop(timeout=0)  # let its thread wind down meanwhile
        self._stopping = True
        self._stop.set()
        self._timers.stop()

    async def _shutdown(self) -> None:
        self._stopping = True
        await self.device_plugin.close(timeout=2.0)
        if self.dra is not None:
            await self.dra.close()  # the claim files and the checkpoint stay
        await self._tasks.cancel_all()
        if self.dra is not None:
            await self.dra.close_api()
        self.device_plugin.close_channels()
        if self._watcher is not None:
            self._watcher.stop()
        if self._status is not None:
            await self._status.close()
        _log.info("stopped")

    def timer_stopped(self) -> bool:
        """Whether the loop that drives rescans, ticks and polls has ended."""
        return self._timers.stopped

    def essential_tasks(self) -> dict[str, str]:
        """Each task dp cannot work without, by name -> why it ended ("" while it runs)."""
        return dict(self._tasks.essential)

    @property
    def open_streams(self) -> int:
        """How many ListAndWatch streams are being served."""
        return self.device_plugin.open_streams

    @property
    def config_change_due(self) -> float | None:
        """When a change to the config file that was noticed will be read
        (once it has stayed the same for a second); None: none is waiting."""
        return self._config_version.due_at if self._config_version is not None else None

    @property
    def status_address(self) -> tuple[str, int] | None:
        """Where /metrics is served, once `run()` has started it (port 0 resolved)."""
        return self._status.address if self._status is not None else None

    @property
    def socket_paths(self) -> list[Path]:
        return self.device_plugin.socket_paths
