"""The device-plugin front end in the running server: its sockets, the
kubelet's connections, Register calls, ListAndWatch streams, PodResources
polls and the CDI spec per resource.

`DevicePluginRuntime` is the front end's `FrontendRuntime`: it makes the
core's `DevicePluginFrontend`, then wires it onto the loop: it registers the
handler of each of the front end's effects, serves the device plugin's calls
through `Loop.call` (`NodeCalls`), and follows the kubelet
(`KubeletFollower`), whose connections and restarts it feeds to the core.
What is served is the core's decision; nothing here decides. It learns of
the core only through its effects, and monitoring through the frozen view
the core hands out (`DevicePluginFrontend.view`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from pathlib import Path

import attrs

from dp_core import (
    DEVICE_PLUGIN,
    AllocationsObserved,
    AttributeConnection,
    CdiSpecsChanged,
    CdiSpecsWritten,
    Config,
    DevicePluginFrontend,
    EndStream,
    HealthChanged,
    KubeletCheckpointObserved,
    KubeletCheckpointWanted,
    Ledger,
    MetricFamily,
    Phase,
    Publish,
    RefreshAllocations,
    Register,
    RegistrationsSettled,
    Reject,
    Reply,
    SocketMode,
    WatchEnded,
    WatchStarted,
    endpoint_name,
)
from dp_server.cdi import SpecDirectory
from dp_server.config.settings import Settings, socket_name_room
from dp_server.deviceplugin.kubelet import KubeletFollower
from dp_server.deviceplugin.kubelet_checkpoint import CheckpointFile
from dp_server.deviceplugin.pod_resources import PodResourcesPoller
from dp_server.deviceplugin.register_client import RegisterClient
from dp_server.deviceplugin.service import DevicePluginService, MakeInput
from dp_server.deviceplugin.sockets import PluginSockets
from dp_server.deviceplugin.streams import Streams
from dp_server.loop import CallbackTimer, Loop, Readiness, Services, Timer

__all__ = ["KUBELET_SOCKET", "DevicePluginRuntime"]

KUBELET_SOCKET = "kubelet.sock"

_log = logging.getLogger("dp.runtime")
_SHUTTING_DOWN = "the device plugin is shutting down"
_CLOSE_TIMEOUT = 2.0  # for the kubelet's calls under way when dp stops


class DevicePluginRuntime:
    """The device-plugin front end of one server: made with the node's
    ledger, then attached to the loop (`FrontendRuntime`)."""

    def __init__(self, settings: Settings, config: Config, ledger: Ledger) -> None:
        self._settings = settings
        self.socket_mode = settings.socket_mode
        self.plugin_dir = Path(settings.device_plugin_dir)
        self.kubelet_socket = self.plugin_dir / KUBELET_SOCKET
        # Chosen here, told to the core for its Register effects, and kept for
        # the one socket of single-socket mode, made before any Register.
        self._prefix = settings.endpoint_prefix or f"dp-{os.urandom(3).hex()}"
        self.frontend = DevicePluginFrontend(
            ledger,
            settings.timing,
            socket_mode=settings.socket_mode,
            endpoint_prefix=self._prefix,
            endpoint_max_length=socket_name_room(settings.device_plugin_dir, self._prefix),
            cdi=settings.cdi_spec_dir is not None,
            pod_resources_interval=settings.pod_resources_interval,
        )
        self._core = self.frontend
        self._checkpoint = CheckpointFile(self.plugin_dir)
        self._checkpoint_wanted = False  # as the core last said (KubeletCheckpointWanted)
        self._streams = Streams()
        self._pods = PodResourcesPoller(
            settings.pod_resources_socket, settings.pod_resources_min_gap
        )
        self._cdi = SpecDirectory(settings.cdi_spec_dir) if settings.cdi_spec_dir else None
        self._present = False  # whether the kubelet's directory was there at the start

    # -- as a front end's wiring (FrontendRuntime) ----------------------------------

    @property
    def name(self) -> str:
        return DEVICE_PLUGIN

    @property
    def core(self) -> DevicePluginFrontend:
        return self.frontend

    def attach(self, loop: Loop, services: Services) -> None:
        settings = self._settings
        spawn, memory, stopping = services.spawn, services.memory, services.stopping
        self._loop = loop
        self._spawn = spawn
        self._memory = memory
        self._stopping = stopping
        self.kubelet = KubeletFollower(
            self.kubelet_socket,
            # Another channel to kubelet.sock for the Registers that follow.
            retire=lambda: self._registers.retire(),
            checkpoint=self._checkpoint.read,
            ids=loop.ids,
            feed=loop.feed,
            now=loop.now,
            spawn=spawn,
            memory=memory,
            stopping=stopping,
        )
        self._sockets = PluginSockets(self.plugin_dir, DevicePluginService(self), self.kubelet)
        self._registers = RegisterClient(
            self.kubelet_socket, settings.register_timeout, self._sockets, loop.feed, loop.now
        )
        loop.on(Publish, self._publish)
        loop.on(EndStream, self._end_stream)
        loop.on(Register, self._register)
        loop.on(RefreshAllocations, self._refresh_allocations)
        loop.on(CdiSpecsChanged, self._keep_cdi_specs)
        loop.on(AttributeConnection, self._log_attribution)
        loop.on(HealthChanged, _nothing)  # logged through the Log effect that comes with it
        loop.on(RegistrationsSettled, self._registrations_settled)
        loop.on(KubeletCheckpointWanted, self._checkpoint_wanted_changed)
        loop.answers(Reply, Reject)

    def timers(self) -> Sequence[Timer]:
        """PodResources polls, as the core asks for them (`RefreshAllocations`),
        spaced by the minimum gap."""
        return [CallbackTimer(lambda now: self._pods.due_at(), self._poll_due)]

    # -- NodeCalls (DevicePluginService) -------------------------------------------

    def call(self, connection: int, make: MakeInput) -> Reply | Reject | None:
        """Feed one unary RPC on `connection` to the core; return its answer to it."""
        answer: Reply | Reject | None = self._loop.call(
            lambda call: make(connection, call, self._loop.now())
        )
        return answer

    @contextlib.asynccontextmanager
    async def watch(self, connection: int) -> AsyncIterator[AsyncIterator[bytes]]:
        """A ListAndWatch stream on `connection`, for as long as the caller keeps it."""
        stream = next(self._loop.ids)
        slot = self._streams.open(stream)
        if self._stopping():
            slot.end(_SHUTTING_DOWN)
        try:
            self._loop.feed(WatchStarted(connection, stream, self._loop.now()))
            yield slot.updates()
        finally:
            self._streams.close(stream)
            self._loop.feed(WatchEnded(stream))

    # -- life cycle ---------------------------------------------------------------

    def watched(self) -> Sequence[Path]:
        return (self.plugin_dir,)

    def recall(self) -> None:
        """Remove sockets an earlier run left, if the kubelet's directory is there.

        The directory is the kubelet's: it makes it, and dp listens there once it
        exists (each Register makes dp's socket first)."""
        self._present = self.plugin_dir.is_dir()
        if self._present:
            self._sockets.remove_stale()

    async def start(self) -> None:
        """In single-socket mode, listen on the one socket before any Register."""
        if self._present and self.socket_mode is SocketMode.SINGLE:
            await self._sockets.ensure(endpoint_name(self._prefix, None), None)

    async def restore(self) -> None:
        """Listen again on sockets the kubelet deleted (PluginDirectoryLost if it
        can't); look at kubelet.sock, and at the kubelet's checkpoint while it
        syncs: each write of it may drop what the pods it has not listed were
        given; until kubelet.sock is there, keep looking for it."""
        await self._sockets.restore()
        self.kubelet.probe()
        if self._checkpoint_wanted and self._checkpoint.changed():
            self._loop.feed(KubeletCheckpointObserved(self._checkpoint.read(), self._loop.now()))
        if not self.kubelet.present:
            self.kubelet.follow(fast=False)

    async def close(self) -> None:
        """End every stream, stop registering, and close and remove the sockets."""
        self._streams.end_all(_SHUTTING_DOWN)
        self._registers.retire()
        await self._sockets.close(timeout=_CLOSE_TIMEOUT)

    async def closed(self) -> None:
        self._registers.close()

    # -- what monitoring reads --------------------------------------------------------

    def readiness(self) -> Readiness:
        phases = self._core.view().phases
        pending = [(name, phase) for name, phase in phases if phase is not Phase.LIVE]
        if not pending:
            return Readiness(True, f"{len(phases)} resources")
        shown = ", ".join(f"{name} ({phase.value})" for name, phase in pending[:8])
        more = f" and {len(pending) - 8} more" if len(pending) > 8 else ""
        return Readiness(
            False, f"{len(pending)} of {len(phases)} resources not registered: {shown}{more}"
        )

    def remarks(self) -> Sequence[str]:
        # CDI specs that cannot be written do not fail /healthz: a restart would
        # not make the directory writable, and Allocate works without them.
        problem = self._core.view().cdi_problem
        return (f"CDI specs not in place: {problem}",) if problem else ()

    def families(self) -> Iterable[MetricFamily]:
        return ()  # the core front end's are all there is (`dp_core.collect`)

    def serving(self) -> Mapping[str, object]:
        return {
            "resources": len(self._core.view().resources),
            "directory": str(self.plugin_dir),
            "sockets": ", ".join(p.name for p in self.socket_paths) or "none yet",
        }

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    @property
    def socket_paths(self) -> list[Path]:
        return self._sockets.paths

    # -- PodResources ---------------------------------------------------------------

    def _poll_due(self, now: float) -> None:
        if self._pods.may_poll(now):
            self._spawn(self._poll_pod_resources())

    async def _poll_pod_resources(self) -> None:
        held = await self._pods.poll(self._loop.now())
        if held is not None:
            self._loop.feed(AllocationsObserved(held, self._loop.now()))

    # -- effects (registered on the loop) ------------------------------------------

    def _publish(self, effect: Publish) -> None:
        self._streams.publish(effect.stream, effect.resource, effect.devices)

    def _end_stream(self, effect: EndStream) -> None:
        self._streams.end(effect.stream, effect.reason)

    def _register(self, effect: Register) -> None:
        if not self._stopping():
            self._spawn(self._registers.call(effect))

    def _registrations_settled(self, effect: RegistrationsSettled) -> None:
        self._memory.registrations_settled()

    def _checkpoint_wanted_changed(self, effect: KubeletCheckpointWanted) -> None:
        self._checkpoint_wanted = effect.wanted

    def _refresh_allocations(self, effect: RefreshAllocations) -> None:
        self._pods.request(self._loop.now())

    def _keep_cdi_specs(self, effect: CdiSpecsChanged) -> None:
        if self._cdi is None:
            return
        # Fed after this input's other effects, before anything else: an
        # Allocate read after it names only specs in place.
        result = self._cdi.sync(effect.specs)
        self._loop.feed(CdiSpecsWritten(result.in_place, result.problem))

    def _log_attribution(self, effect: AttributeConnection) -> None:
        _log.debug("connection-bound", extra={"dp_fields": attrs.asdict(effect)})


def _nothing(effect: object) -> None:
    pass
