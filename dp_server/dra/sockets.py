"""One listening Unix socket of the DRA front end, kept where the kubelet looks for it.

A socket is known by its identity (inode and modification time): one whose
file was deleted is listened on again under the same name, which is how the
kubelet's plugin watcher sees a plugin come back (it re-registers on the
create event). Only a socket file nobody listens on is ever removed: a live
socket at our path is another process's, and is left alone with an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import stat
from collections.abc import Collection
from pathlib import Path
from typing import Any

from grpclib.encoding.base import CodecBase
from grpclib.server import Server

from dp_server.files.sockets import SOCKET_PATH_MAX, listened_on, socket_identity
from dp_server.rpc import GrpcServer

__all__ = ["SOCKET_MODE", "ForeignSocket", "MissingDirectory", "ServedSocket"]

_log = logging.getLogger("dp")

#: The kubelet (root) is the only peer; nobody else has a reason to connect.
SOCKET_MODE = 0o600


class ForeignSocket(OSError):
    """Our path holds something that is not a stale socket of ours."""


class MissingDirectory(OSError):
    """A directory above our socket is missing, and is not ours to make."""


def _clear(path: Path) -> None:
    """Remove a stale socket of ours at `path`; refuse anything else that is there."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise ForeignSocket(errno.EEXIST, f"{path} exists and is not a socket; left as it is")
    if listened_on(path):
        raise ForeignSocket(errno.EADDRINUSE, f"another process listens on {path}; left as it is")
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    _log.info("stale-socket-removed", extra={"dp_fields": {"path": str(path)}})


class ServedSocket:
    """A grpclib server of `handlers` on `path`, listened on again when its file goes.

    With `own_directory`, the directory the socket is in is ours (the
    driver's own directory under the kubelet's plugins directory) and is made
    when missing; the directory above it never is. Without it, the socket's
    directory is the kubelet's (its plugin registry), and is never made.
    """

    def __init__(
        self,
        path: Path,
        handlers: Collection[Any],
        codec: CodecBase | None = None,
        *,
        own_directory: bool = False,
    ) -> None:
        if len(os.fsencode(path)) > SOCKET_PATH_MAX:
            raise ValueError(
                f"socket path {path} is {len(os.fsencode(path))} bytes, "
                f"over the {SOCKET_PATH_MAX}-byte limit of a Unix socket path"
            )
        self.path = path
        self._own_directory = own_directory
        self._handlers = handlers
        self._codec = codec
        self._server: Server | None = None
        self._identity: tuple[int, int] | None = None
        # Servers whose file was deleted: unreachable, closed at close().
        self._retired: list[Server] = []
        self._blocked = False  # a foreign file sits at our path: warned once

    @property
    def listening(self) -> bool:
        """Whether the file at `path` is the socket we listen on."""
        return self._server is not None and socket_identity(self.path) == self._identity

    async def start(self) -> None:
        """Listen on `path`, after removing a stale socket of ours; ForeignSocket
        otherwise, and MissingDirectory when the kubelet's directory is not there."""
        theirs = self.path.parent.parent if self._own_directory else self.path.parent
        if not theirs.is_dir():
            raise MissingDirectory(
                errno.ENOENT,
                f"{theirs} does not exist: it is the kubelet's, which makes it at start",
            )
        if self._own_directory:
            with contextlib.suppress(FileExistsError):
                self.path.parent.mkdir(mode=0o750)
        _clear(self.path)
        server = GrpcServer(self._handlers, name=self.path.name, codec=self._codec)
        try:
            await server.start(path=str(self.path))
        except OSError as error:
            reason = error.strerror or str(error)
            raise OSError(error.errno, f"cannot listen on {self.path}: {reason}") from None
        # Between bind and chmod the socket has the umask's mode; the parent
        # directories are the kubelet's and not world-writable, so nobody
        # but root can be waiting to race for it.
        os.chmod(self.path, SOCKET_MODE)
        if self._server is not None:
            self._retired.append(self._server)
        self._server = server
        self._identity = socket_identity(self.path)
        self._blocked = False

    async def restore(self) -> bool:
        """Listen again if our file was deleted or replaced; True if it was."""
        if self._server is None or self.listening:
            return False
        try:
            await self.start()
        except OSError as error:
            if not self._blocked:
                _log.warning(
                    "socket-not-restored",
                    extra={"dp_fields": {"path": str(self.path), "error": str(error)}},
                )
            self._blocked = True
            return False
        _log.info("socket-recreated", extra={"dp_fields": {"path": str(self.path)}})
        return True

    async def close(self, timeout: float = 5.0) -> None:
        """Stop listening, wait up to `timeout` for calls to end, remove our file."""
        servers = [*self._retired, *([self._server] if self._server else [])]
        for server in servers:
            server.close()
        for server in servers:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(server.wait_closed(), timeout)
        if self._server is not None and socket_identity(self.path) == self._identity:
            with contextlib.suppress(OSError):
                self.path.unlink()
        self._server = None
        self._retired.clear()
