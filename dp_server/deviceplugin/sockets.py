"""The plugin's listening sockets in the kubelet's device-plugin directory.

The kubelet deletes every socket there when it restarts, so a socket is
known by its identity (inode and modification time), and one whose file was
deleted or replaced is listened on again under the same name. Connections
made through the old file are not cut: the kubelet's end decides when they
close.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from dp_server.deviceplugin import wire
from dp_server.deviceplugin.connections import ConnectionEvents, ConnectionServer
from dp_server.files.sockets import listened_on, socket_identity
from dp_server.loop import FrontendLost

if TYPE_CHECKING:
    from dp_server.deviceplugin.service import DevicePluginService

__all__ = ["PluginDirectoryLost", "PluginSockets"]

_log = logging.getLogger("dp")


class PluginDirectoryLost(FrontendLost):
    """The device-plugin directory is now one the kubelet cannot be using."""


@attrs.define
class _Listener:
    path: Path
    resource: str | None  # in per-resource mode; None for the shared socket
    server: ConnectionServer
    identity: tuple[int, int] | None


class PluginSockets:
    """Listening sockets by endpoint name, each a grpclib server of `service`."""

    def __init__(
        self, directory: Path, service: DevicePluginService, events: ConnectionEvents
    ) -> None:
        self.directory = directory
        self._service = service
        self._events = events
        self._listeners: dict[str, _Listener] = {}
        # Servers whose socket file was deleted or replaced, kept while
        # connections made through it live (a kubelet that is not restarting
        # still uses them). Nobody can connect to them any more: a Unix
        # socket is reached only through its file.
        self._retired: list[ConnectionServer] = []
        self._lock = asyncio.Lock()
        self._filesystem: int | None = None  # the directory's st_dev when first listened in
        self._missing = False

    @property
    def paths(self) -> list[Path]:
        return [listener.path for listener in self._listeners.values()]

    @property
    def servers(self) -> list[ConnectionServer]:
        return [listener.server for listener in self._listeners.values()] + self._forget_idle()

    def _forget_idle(self) -> list[ConnectionServer]:
        """The retired servers that still have connections; the others are closed."""
        keep = []
        for server in self._retired:
            if server.connected:
                keep.append(server)
            else:
                server.close()
        self._retired = keep
        return self._retired

    async def ensure(self, endpoint: str, resource: str | None) -> None:
        """Listen on `endpoint` unless our socket is already there."""
        async with self._lock:
            path = self.directory / endpoint
            listener = self._listeners.get(endpoint)
            if listener is not None and socket_identity(path) == listener.identity:
                return
            if listener is not None:
                # The kubelet deleted our socket (it does on every restart), or
                # someone replaced it. The old server's connections end when
                # their peer closes them (a restarting kubelet does at once),
                # or at shutdown; it is closed once they have.
                self._retired.append(listener.server)
                self._forget_idle()
                _log.info("socket-recreated", extra={"dp_fields": {"path": str(path)}})
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            server = ConnectionServer(
                [self._service], self._events, resource, codec=wire.PreEncodedCodec()
            )
            try:
                await server.start(path=str(path))
            except OSError as error:
                reason = error.strerror or str(error)
                raise OSError(error.errno, f"cannot listen on {path}: {reason}") from None
            self._listeners[endpoint] = _Listener(path, resource, server, socket_identity(path))
            if self._filesystem is None:
                self._filesystem = os.stat(self.directory).st_dev

    async def restore(self) -> None:
        """Listen again on every socket whose file was deleted or replaced.

        While the directory itself is gone there is nowhere to listen: the
        kubelet's open connections are still served, and the sockets come back
        with the directory. A directory that comes back on another filesystem
        raises PluginDirectoryLost: that is what a container sees once the
        host directory its hostPath volume mounted was removed, and no socket
        made there reaches the kubelet.
        """
        try:
            info = os.stat(self.directory)
        except OSError:
            info = None
        if info is None or not stat.S_ISDIR(info.st_mode):
            # Before dp first listened there, the wait for the kubelet says it.
            if not self._missing and self._filesystem is not None:
                _log.warning(
                    "plugin-dir-missing",
                    extra={
                        "dp_fields": {
                            "path": str(self.directory),
                            "effect": "open connections are still served; "
                            "the sockets are made again when the directory is back",
                        }
                    },
                )
            self._missing = True
            return
        self._missing = False
        if self._filesystem is not None and info.st_dev != self._filesystem:
            raise PluginDirectoryLost(
                f"the device-plugin directory {self.directory} is now on another filesystem "
                f"(device {info.st_dev}, was {self._filesystem}): in a container, its hostPath "
                "mount ended when the directory was removed on the host, and only a restart "
                "mounts the kubelet's directory again"
            )
        for endpoint, listener in list(self._listeners.items()):
            if socket_identity(listener.path) != listener.identity:
                await self.ensure(endpoint, listener.resource)

    def remove_stale(self) -> None:
        """Drop `dp-*.sock` files that no process listens on any more."""
        for path in self.directory.glob("dp-*.sock"):
            if not listened_on(path):
                with contextlib.suppress(OSError):
                    path.unlink()
                    _log.info("stale-socket-removed", extra={"dp_fields": {"path": str(path)}})

    async def close(self, timeout: float) -> None:
        """Stop listening, wait up to `timeout` for each server, remove our files."""
        servers = self.servers
        for server in servers:
            server.close()
        for server in servers:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(server.wait_closed(), timeout)
        for listener in self._listeners.values():
            # Another process may have taken the name since: leave its socket alone.
            if socket_identity(listener.path) == listener.identity:
                with contextlib.suppress(OSError):
                    os.unlink(listener.path)
        self._listeners.clear()
        self._retired.clear()
