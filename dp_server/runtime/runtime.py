"""The asyncio shell: one event loop serving every front end.

`Runtime` puts the sub-systems together around one `dp_core.Node` on one
`Loop` (feed, call, the effect handlers each sub-system registers):

- the front ends' wiring (`FrontendRuntime`, one entry each in
  `frontends.FRONTENDS`: the device plugin's sockets, kubelet and
  PodResources; DRA's sockets, claims and slices), each made with the
  node's one ledger and driven alike, by none's name;
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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from dp_core import (
    Config,
    ConfigApplied,
    HostObserved,
    Input,
    Ledger,
    Log,
    Node,
    PciId,
    Tick,
)
from dp_server.binding.binder import Binder
from dp_server.binding.wiring import BindingRuntime
from dp_server.config.settings import Settings, SettingsError
from dp_server.deviceplugin.wiring import KUBELET_SOCKET
from dp_server.host.scanner import scan_host
from dp_server.host.uevents import UeventMonitor
from dp_server.host.watcher import DirectoryWatcher, FileVersion
from dp_server.loop import (
    CallbackTimer,
    CollectionPolicy,
    FrontendLost,
    FrontendRuntime,
    Loop,
    Services,
    Tasks,
    TimerLoop,
)
from dp_server.monitoring.logs import emit
from dp_server.runtime.frontends import FRONTENDS, Plug

if TYPE_CHECKING:
    from dp_server.monitoring.endpoint import StatusEndpoint

__all__ = ["KUBELET_SOCKET", "Runtime", "Settings"]

W = TypeVar("W")

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
        frontends: Sequence[Plug] = FRONTENDS,
    ) -> None:
        self.settings = settings
        self.config = config
        self._reload = reload
        # One ledger for every front end, made with it (frontends.FRONTENDS).
        ledger = Ledger()
        made = (plug(settings, config, ledger) for plug in frontends)
        self.frontends: tuple[FrontendRuntime, ...] = tuple(f for f in made if f is not None)
        self.node = Node(
            config, [f.core for f in self.frontends], ledger=ledger, pci_names=pci_names
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
        services = Services(self._tasks.spawn, self._memory, self.stopping)
        for frontend in self.frontends:
            frontend.attach(self.loop, services)
        self.binding = BindingRuntime(
            self.loop,
            binder or Binder(settings.sysfs),
            settings.state_dir,
            spawn=self._tasks.spawn,
            stopping=self.stopping,
            rescan=self.try_rescan,
        )
        self._timers = TimerLoop(
            [
                CallbackTimer(lambda now: self.node.next_deadline(), self._tick),
                CallbackTimer(lambda now: self._next_rescan, self._rescan_due),
                *(timer for frontend in self.frontends for timer in frontend.timers()),
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

    def frontend(self, kind: type[W]) -> W:
        """The front end's wiring of class `kind`."""
        for frontend in self.frontends:
            if isinstance(frontend, kind):
                return frontend
        raise LookupError(f"this server runs no {kind.__name__}")

    # -- sockets -----------------------------------------------------------------------

    async def _restore(self, frontends: Sequence[FrontendRuntime]) -> None:
        """React to what changed outside dp's hands: the kubelet (re)creating its
        socket, our sockets deleted."""
        for frontend in frontends:
            try:
                await frontend.restore()
            except FrontendLost as error:
                self.fail(str(error))
                return

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
        self._tasks.spawn(self._restore(self.frontends))
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
            # The front ends are made for one config's dra (the DRA sockets,
            # the API client and the pool are made for one driver).
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
        vfio = Path(self.settings.dev).absolute() / "vfio"
        # The VFIO character devices live one level down, and the watch is
        # not recursive. (/dev/iommu comes and goes only with the iommufd
        # module: the periodic rescan sees it.)
        cdevs = vfio / "devices"
        config = self._config_version.path.parent if self._config_version else None
        fronts = {
            frontend: {path.absolute() for path in frontend.watched()}
            for frontend in self.frontends
        }
        watched = (vfio, cdevs, config, *(d for dirs in fronts.values() for d in dirs))
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
            everything = not changed
            try:
                await self._restore(
                    [f for f, dirs in fronts.items() if everything or not dirs.isdisjoint(touched)]
                )
                if vfio in touched or cdevs in touched:
                    self.try_rescan()
                if everything or config in touched:
                    self._notice_config()
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
            self.binding.recall()
            # Listening before the first scan: no device that comes meanwhile is missed.
            uevents = self._open_uevents()
            self.rescan()
            for frontend in self.frontends:
                frontend.recall()  # before it serves anything
            for frontend in self.frontends:
                await frontend.start()
            self._tasks.spawn(self._watch_files(), essential="file-watch")
            if uevents is not None:
                self._tasks.spawn(self._follow_uevents(uevents))
            self._tasks.spawn(self._timers.run(), essential="timer-loop")
            await self._restore(self.frontends)
        except BaseException:
            if self._status is not None:
                await self._status.close()
            for frontend in self.frontends:
                await frontend.close()
            await self._tasks.cancel_all()
            for frontend in self.frontends:
                await frontend.closed()
            raise
        self.ready.set()
        serving: dict[str, object] = {}
        for frontend in self.frontends:
            serving.update(frontend.serving())
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
        for frontend in self.frontends:
            await frontend.close()  # DRA's claim files and checkpoint stay
        await self._tasks.cancel_all()
        for frontend in self.frontends:
            await frontend.closed()
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
    def config_change_due(self) -> float | None:
        """When a change to the config file that was noticed will be read
        (once it has stayed the same for a second); None: none is waiting."""
        return self._config_version.due_at if self._config_version is not None else None

    @property
    def status_address(self) -> tuple[str, int] | None:
        """Where /metrics is served, once `run()` has started it (port 0 resolved)."""
        return self._status.address if self._status is not None else None
