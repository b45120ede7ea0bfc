"""The asyncio shell: one event loop serving every resource.

`Runtime` owns the listening sockets, the kubelet connections and the
ListAndWatch streams, feeds every event to a `dp_core.Node`, and carries out
the effects it returns. Watching (watchfiles on the device-plugin directory
and /dev/vfio), rescans, PodResources polls and timers all run as tasks on the
one loop; nothing here decides policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import grpclib.server
from grpclib.exceptions import GRPCError

from dp_core import (
    AllocationsObserved,
    AttributeConnection,
    BindDevice,
    Config,
    ConfigApplied,
    ConnectionClosed,
    ConnectionOpened,
    Effect,
    EndStream,
    HostObserved,
    Input,
    KubeletStarted,
    KubeletStopped,
    Log,
    MovesChanged,
    MovesRecalled,
    Node,
    PciId,
    Publish,
    RefreshAllocations,
    Register,
    Reject,
    Reply,
    HealthChanged,
    SocketMode,
    Tick,
    UnbindDevice,
    WatchEnded,
    WatchStarted,
    endpoint_name,
)

from . import wire
from .bind_queue import BindQueue
from .binder import Binder
from .logs import emit
from .moves_file import MovesStore
from .pod_resources import PodResourcesPoller
from .register_client import RegisterClient
from .scanner import scan_host
from .service import DevicePluginService
from .settings import Settings, SettingsError, socket_name_room
from .sockets import PluginDirectoryLost, PluginSockets, socket_identity
from .streams import StreamSlot
from .transport import ConnectionTracker
from .watcher import DirectoryWatcher, FileVersion

if TYPE_CHECKING:
    from .status import StatusEndpoint

__all__ = ["KUBELET_SOCKET", "Runtime", "Settings", "SettingsError"]

KUBELET_SOCKET = "kubelet.sock"

_log = logging.getLogger("dp.runtime")
# After a kubelet connection closes, kubelet.sock is looked at every 5 ms for a
# second, then every 50 ms for half a minute: a restarted kubelet's new socket
# is seen within milliseconds if it comes back at once, within 50 ms if it takes
# its time (the file watcher alone reports up to a few hundred ms late). That
# is a few thousand stat calls per lost connection.
_FOLLOW_FAST = (0.005, 1.0)  # (step, for how long)
_FOLLOW_SLOW = (0.05, 30.0)
_LOOK_WHILE_ABSENT = 1.0  # seconds between looks at kubelet.sock while there is none
_COLLECT_AFTER_REGISTRATION = 1.0  # seconds after every resource is registered again
_CONFIG_SETTLE = 1.0  # a changed config file is read once it stayed the same this long
_T = TypeVar("_T")


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
        self._clock = clock
        prefix = settings.endpoint_prefix or f"dp-{os.urandom(3).hex()}"
        self.node = Node(
            config,
            socket_mode=settings.socket_mode,
            endpoint_prefix=prefix,
            endpoint_max_length=socket_name_room(settings.device_plugin_dir, prefix),
            timing=settings.timing,
            pci_names=pci_names,
        )
        self._binds = BindQueue(
            binder or Binder(settings.sysfs),
            self.node,
            self.feed,
            self.now,
            lambda: self._stopping,
            lambda: self._safely(self.rescan),
        )
        self.plugin_dir = Path(settings.device_plugin_dir)
        self.kubelet_socket = self.plugin_dir / KUBELET_SOCKET
        self._service = DevicePluginService(self)
        self._connections: dict[int, int] = {}  # id(transport) -> connection
        self._tracker = ConnectionTracker(self._connection_made, self._connection_lost)
        self._moves = MovesStore(settings.state_dir)
        self._sockets = PluginSockets(self.plugin_dir, self._service, self._tracker)
        self._registers = RegisterClient(
            self.kubelet_socket, settings.register_timeout, self._sockets, self.feed, self.now
        )
        self._streams: dict[int, StreamSlot] = {}
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._wake = asyncio.Event()
        self._timer_deadline: float | None = None  # what the timer loop sleeps until
        self._stop = asyncio.Event()
        self._watcher: DirectoryWatcher | None = None
        self._stopping = False
        self.failure: str | None = None  # why the server stopped itself, if it did
        self._kubelet_identity: tuple[int, int] | None = None
        self._follower: asyncio.Task[None] | None = None
        self._scanned = False
        self._registering = False
        self._follow_kubelet_since = 0.0
        self._encoded_lists: dict[str, tuple[object, bytes]] = {}
        self._next_rescan = 0.0
        self._pods = PodResourcesPoller(
            settings.pod_resources_socket,
            settings.pod_resources_interval,
            settings.pod_resources_min_gap,
        )
        self.ready = asyncio.Event()
        self.last_rescan: tuple[float, float] | None = None  # (when, seconds it took)
        self.rescan_failures = 0
        self._timer: asyncio.Task[None] | None = None
        self._status: StatusEndpoint | None = None  # serving /metrics, with --metrics-address
        watched = settings.config_path if reload is not None else None
        self._config_version = (
            FileVersion(Path(watched).absolute(), settle=_CONFIG_SETTLE) if watched else None
        )

    # -- feeding the core ------------------------------------------------------

    def now(self) -> float:
        return self._clock()

    def feed(self, event: Input) -> list[Effect]:
        effects = self.node.handle(event)
        for effect in effects:
            self._execute(effect)
        if self._registering and self.node.registrar.settled():
            self._registering = False
            # Dropped connections stay in reference cycles (grpclib keeps a
            # stream's error, whose traceback holds the stream) that only a full
            # collection frees, and nothing else triggers one on a quiet server.
            # Losing them all is handled in _connection_lost; for the rest (one
            # connection closed, failed Registers), collect once the storm is
            # over, off the path of the last registrations.
            asyncio.get_running_loop().call_later(_COLLECT_AFTER_REGISTRATION, gc.collect)
        # Waking the timer loop costs a task switch; most inputs (every Allocate)
        # leave the deadlines alone, and a later one only makes a wake-up early.
        if self._timer_deadline is None or self._deadline() < self._timer_deadline:
            self._wake.set()
        return effects

    def _execute(self, effect: Effect) -> None:
        if isinstance(effect, Publish):
            slot = self._streams.get(effect.stream)
            if slot is not None:
                slot.publish(self._device_list(effect.resource, effect.devices))
        elif isinstance(effect, EndStream):
            slot = self._streams.get(effect.stream)
            if slot is not None:
                slot.end(effect.reason)
        elif isinstance(effect, Register):
            self._registering = True
            if not self._stopping:
                self._spawn(self._registers.call(effect))
        elif isinstance(effect, Log):
            emit(effect)
        elif isinstance(effect, RefreshAllocations):
            self._pods.request(self.now())
        elif isinstance(effect, BindDevice | UnbindDevice):
            if not self._stopping:
                self._spawn(self._binds.submit(effect))
        elif isinstance(effect, MovesChanged):
            self._moves.keep(effect.moves)
        elif isinstance(effect, AttributeConnection):
            _log.debug("connection-bound", extra={"dp_fields": attrs.asdict(effect)})
        elif isinstance(effect, (Reply, Reject, HealthChanged)):
            pass  # answered by the caller of feed(); health is logged by a Log effect

    def _device_list(self, resource: str, devices: tuple[Any, ...]) -> bytes:
        # Every stream of a resource is sent the same list, and after a kubelet
        # restart the same list again: encode each list once, when it changes.
        cached_devices, message = self._encoded_lists.get(resource, (None, b""))
        if cached_devices is not devices:
            message = wire.encoded_device_list(devices)
            self._encoded_lists[resource] = (devices, message)
        return message

    def _spawn(self, coroutine: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            _log.error("task-failed", exc_info=task.exception())

    # -- RPCs --------------------------------------------------------------------

    def connection_of(self, stream: grpclib.server.Stream[Any, Any]) -> int:
        # grpclib exposes the transport only through Peer; it identifies the
        # HTTP/2 connection, which is what the kubelet opens per resource.
        transport = stream.peer._transport
        connection = self._connections.get(id(transport))
        if connection is None:
            raise GRPCError(grpclib.const.Status.UNAVAILABLE, "connection is not tracked")
        return connection

    def call(
        self,
        connection: int,
        make: Callable[[int, int, float], Input],
        expected: type[_T],
    ) -> _T:
        """Feed one unary RPC on `connection` to the core; return its answer or raise its status."""
        call = next(self._ids)
        effects = self.feed(make(connection, call, self.now()))
        for effect in effects:
            if isinstance(effect, Reject) and effect.call == call:
                raise GRPCError(wire.STATUS[effect.status], effect.message)
            if isinstance(effect, Reply) and effect.call == call:
                return effect.answer  # type: ignore[return-value]
        raise GRPCError(grpclib.const.Status.INTERNAL, "the core gave no answer")

    @contextlib.asynccontextmanager
    async def watch(
        self, stream: grpclib.server.Stream[Any, Any]
    ) -> AsyncIterator[AsyncIterator[bytes]]:
        connection = self.connection_of(stream)
        stream_id = next(self._ids)
        slot = self._streams[stream_id] = StreamSlot()
        if self._stopping:
            slot.end("the device plugin is shutting down")
        try:
            self.feed(WatchStarted(connection, stream_id, self.now()))
            yield slot.updates()
        finally:
            self._streams.pop(stream_id, None)
            self.feed(WatchEnded(stream_id))

    def _connection_made(self, transport: asyncio.BaseTransport, listener: str | None) -> int:
        connection = next(self._ids)
        self._connections[id(transport)] = connection
        self.feed(ConnectionOpened(connection, self.now(), listener))
        return connection

    def _connection_lost(self, connection: int) -> None:
        for key, value in list(self._connections.items()):
            if value == connection:
                del self._connections[key]
        if self._stopping:  # at shutdown every connection closes; nothing to redo
            return
        if not self._connections:
            # The kubelet is gone (restarting, most likely). Everything of its
            # connections is garbage once their calls have unwound, much of it
            # in reference cycles (grpclib keeps a stream's error, whose
            # traceback holds the stream). Free it before the kubelet is back,
            # so that its new connections reuse that memory instead of adding
            # 2 MB to the high-water mark: a few milliseconds for 64 connections,
            # while the kubelet is still starting.
            asyncio.get_running_loop().call_soon(gc.collect)
        # A kubelet restart drops every connection at once. Look at kubelet.sock
        # before re-registering this resource, so that a restart already visible
        # registers everything once rather than this resource twice; then keep
        # looking for a moment, because the watcher groups file events for up to
        # a few hundred milliseconds before it reports them.
        self._probe_kubelet()
        self.feed(ConnectionClosed(connection, self.now()))
        self._follow_kubelet()

    def _follow_kubelet(self, *, fast: bool = True) -> None:
        """Look at kubelet.sock often for a while (`fast`), or, while there is
        none, once a second until there is."""
        idle = self._follower is None or self._follower.done()
        if fast:
            self._follow_kubelet_since = self.now()
            if not idle:  # it may be in a slow step: start looking often now
                assert self._follower is not None
                self._follower.cancel()
                idle = True
        elif idle:
            self._follow_kubelet_since = self.now() - _FOLLOW_SLOW[1]
        if idle:
            self._follower = self._spawn(self._look_at_kubelet())

    async def _look_at_kubelet(self) -> None:
        while not self._stopping:
            elapsed = self.now() - self._follow_kubelet_since
            if elapsed < _FOLLOW_FAST[1]:
                step = _FOLLOW_FAST[0]
            elif elapsed < _FOLLOW_SLOW[1]:
                step = _FOLLOW_SLOW[0]
            elif self._kubelet_identity is None:
                # Still no kubelet: keep a slow look besides the watcher, which
                # misses a socket made before its watch was in place.
                step = _LOOK_WHILE_ABSENT
            else:
                return
            await asyncio.sleep(step)
            # kubelet.sock alone: each Register re-creates its own listening
            # socket if the kubelet deleted it, so 64 of them are not re-created
            # (or looked at) before the first Register goes out.
            self._probe_kubelet()

    # -- sockets -------------------------------------------------------------------

    async def _check_sockets(self) -> None:
        """React to the kubelet (re)creating kubelet.sock or deleting our sockets."""
        try:
            await self._sockets.restore()
        except PluginDirectoryLost as error:
            self.fail(str(error))
            return
        self._probe_kubelet()

    def _probe_kubelet(self) -> None:
        identity = socket_identity(self.kubelet_socket)
        if identity == self._kubelet_identity:
            return
        self._kubelet_identity = identity
        self._registers.retire()
        if identity is None:
            self.feed(KubeletStopped(self.now()))
            self._follow_kubelet(fast=False)
        else:
            self.feed(KubeletStarted(self.now()))

    # -- host ------------------------------------------------------------------------

    def rescan(self) -> None:
        started = time.perf_counter()
        shared_paths = [device.path for device in self.config.enabled_shared_devices]
        snapshot = scan_host(self.settings.sysfs, self.settings.dev, dev_paths=shared_paths)
        scanned_in = time.perf_counter() - started
        self.feed(HostObserved(snapshot, self.now()))
        self._next_rescan = self.now() + self.settings.rescan_interval
        self.last_rescan = (self.now(), scanned_in)
        # The host model is thousands of long-lived objects; left to the cyclic
        # collector, each full collection walks them all, in the middle of some
        # Allocate. Collect here, between requests, and keep what survives out
        # of later collections (unfreezing first, so a cycle that died since the
        # last rescan is still collected). At start a full collection frees
        # little (0.3 MB on 4,096 functions) and costs 30-40 ms before the first
        # Register: freeze only; the next rescan collects.
        if self._scanned:
            gc.unfreeze()
            gc.collect()
        gc.freeze()
        self._scanned = True

    async def _poll_pod_resources(self) -> None:
        held = await self._pods.poll(self.now())
        if held is not None:
            self.feed(AllocationsObserved(held, self.now()))

    # -- loops -------------------------------------------------------------------------

    def _deadline(self) -> float:
        candidates = [self._next_rescan]
        pod_poll = self._pods.due_at(self.node.allocations, self.now())
        config = self._config_version.due_at if self._config_version else None
        for deadline in (self.node.next_deadline(), pod_poll, config):
            if deadline is not None:
                candidates.append(deadline)
        return min(candidates)

    async def _timer_loop(self) -> None:
        while not self._stopping:
            self._timer_deadline = self._deadline()
            timeout = max(0.0, self._timer_deadline - self.now())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            self._wake.clear()
            self._timer_deadline = None
            if self._stopping:
                return
            now = self.now()
            node_deadline = self.node.next_deadline()
            if node_deadline is not None and node_deadline <= now:
                self.feed(Tick(now))
            if self._next_rescan <= now:
                self._safely(self.rescan)
                # Should a file event ever be missed, the periodic look catches it.
                self._spawn(self._check_sockets())
                self._reload_if_changed()
            poll_at = self._pods.due_at(self.node.allocations, now)
            if poll_at is not None and poll_at <= now and self._pods.may_poll(now):
                self._spawn(self._poll_pod_resources())
            if self._config_version is not None and self._config_version.settled(now):
                self.reload_config()

    def _safely(self, action: Callable[[], None]) -> None:
        try:
            action()
        except Exception:  # one bad rescan must not stop the server
            self.rescan_failures += 1
            _log.exception("rescan-failed")
            self._next_rescan = self.now() + self.settings.rescan_interval

    def _reload_if_changed(self) -> None:
        if self._config_version is not None:
            self._config_version.noticed(self.now())
            self._wake.set()  # the timer loop reads it once it has settled

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
        self.config = config
        self.feed(ConfigApplied(config, self.now(), names))
        _log.info("config-applied", extra={"dp_fields": {"path": self.settings.config_path}})
        self.rescan()

    async def _watch_files(self) -> None:
        # watchfiles reports absolute paths, whatever the flags said.
        plugin_dir, vfio = self.plugin_dir.absolute(), Path(self.settings.dev).absolute() / "vfio"
        config = self._config_version.path.parent if self._config_version else None
        directories = list(dict.fromkeys(d for d in (plugin_dir, vfio, config) if d is not None))
        self._watcher = DirectoryWatcher(directories)
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
                if vfio in touched:
                    self._safely(self.rescan)
                if config in touched:
                    self._reload_if_changed()
            except Exception:  # noqa: BLE001 - the next change must still be seen
                _log.exception("watch-event-failed")

    # -- life cycle ----------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until `stop()`; then end streams, close and remove sockets."""
        if self.settings.metrics_address is not None:
            from .status import start_status  # only with the flag: h11 stays unloaded

            host, port = self.settings.metrics_address
            try:
                self._status = await start_status(self, (host, port))
            except OSError as error:
                reason = error.strerror or error
                message = f"--metrics-address {host or ''}:{port}: cannot listen: {reason}"
                raise SettingsError(message) from error
        try:
            self.plugin_dir.mkdir(parents=True, exist_ok=True)
            self._sockets.remove_stale()
            recalled = self._moves.recall()
            if recalled:
                self.feed(MovesRecalled(recalled))
            self.rescan()
            if self.settings.socket_mode is SocketMode.SINGLE:
                await self._sockets.ensure(endpoint_name(self.node.endpoint_prefix, None), None)
            self._spawn(self._watch_files())
            self._timer = self._spawn(self._timer_loop())
            await self._check_sockets()
            if self._kubelet_identity is None:
                self._follow_kubelet(fast=False)
        except BaseException:
            if self._status is not None:
                await self._status.close()
            raise
        self.ready.set()
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
        self._wake.set()

    async def _shutdown(self) -> None:
        self._stopping = True
        for slot in self._streams.values():
            slot.end("the device plugin is shutting down")
        self._registers.retire()
        await self._sockets.close(timeout=2.0)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._registers.close()
        if self._watcher is not None:
            self._watcher.stop()
        if self._status is not None:
            await self._status.close()
        _log.info("stopped")

    def timer_stopped(self) -> bool:  # the loop that drives rescans, ticks and polls
        return self._timer is not None and self._timer.done()

    @property
    def status_address(self) -> tuple[str, int] | None:
        """Where /metrics is served, once `run()` has started it (port 0 resolved)."""
        return self._status.address if self._status is not None else None

    @property
    def socket_paths(self) -> list[Path]:
        return self._sockets.paths
