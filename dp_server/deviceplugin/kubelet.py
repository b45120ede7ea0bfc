"""Following the kubelet: its socket, our plugin sockets, and its connections to them.

A restarting kubelet deletes every socket in the device-plugin directory and
makes kubelet.sock again; until every resource is registered again, pods that
hold devices fail admission. So kubelet.sock is looked at often right after a
connection closes, and the core hears `KubeletStarted` or `KubeletStopped` as
soon as its identity changes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from dp_core import (
    ConnectionClosed,
    ConnectionOpened,
    Input,
    KubeletCheckpoint,
    KubeletStarted,
    KubeletStopped,
)
from dp_server.files.sockets import socket_identity
from dp_server.loop.memory import CollectionPolicy

__all__ = ["KubeletFollower"]

_log = logging.getLogger("dp.runtime")

# After a kubelet connection closes, kubelet.sock is looked at every 5 ms for a
# second, then every 50 ms for half a minute: a restarted kubelet's new socket
# is seen within milliseconds if it comes back at once, within 50 ms if it takes
# its time (the file watcher alone reports up to a few hundred ms late). That
# is a few thousand stat calls per lost connection.
_FOLLOW_FAST = (0.005, 1.0)  # (step, for how long)
_FOLLOW_SLOW = (0.05, 30.0)
_LOOK_WHILE_ABSENT = 1.0  # seconds between looks at kubelet.sock while there is none
_SAY_WHILE_ABSENT = 60.0  # seconds between log lines saying dp still waits for it


class KubeletFollower:
    """Tells the core when the kubelet comes and goes, and when its connections do.

    It is the `ConnectionEvents` of every plugin socket. `retire` is called
    when kubelet.sock is another one than before (or gone): the channel to
    the old one must not carry the next Register. `checkpoint` reads the
    kubelet's device-manager checkpoint, which a new kubelet has just read
    back (`dp_core.deviceplugin.sync`).
    """

    def __init__(
        self,
        kubelet_socket: Path,
        *,
        retire: Callable[[], None],
        checkpoint: Callable[[], KubeletCheckpoint],
        ids: itertools.count[int],
        feed: Callable[[Input], object],
        now: Callable[[], float],
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
        memory: CollectionPolicy,
        stopping: Callable[[], bool],
    ) -> None:
        self.kubelet_socket = kubelet_socket
        self._retire = retire
        self._checkpoint = checkpoint
        self._ids = ids
        self._feed = feed
        self._now = now
        self._spawn = spawn
        self._memory = memory
        self._stopping = stopping
        self._connections: set[int] = set()  # the plugin connections open now
        self._identity: tuple[int, int] | None = None
        self._follower: asyncio.Task[None] | None = None
        self._since = 0.0
        self._said_waiting: float | None = None  # when dp last said it waits for kubelet.sock

    @property
    def connections(self) -> int:
        """How many plugin connections are open."""
        return len(self._connections)

    @property
    def present(self) -> bool:
        """Whether kubelet.sock was there when last looked at."""
        return self._identity is not None

    # -- ConnectionEvents ------------------------------------------------------------

    def opened(self, listener: str | None) -> int:
        connection = next(self._ids)
        self._connections.add(connection)
        self._feed(ConnectionOpened(connection, self._now(), listener))
        return connection

    def closed(self, connection: int) -> None:
        self._connections.discard(connection)
        if self._stopping():  # at shutdown every connection closes; nothing to redo
            return
        if not self._connections:
            self._memory.after_kubelet_left()
        # A kubelet restart drops every connection at once. Look at kubelet.sock
        # before re-registering this resource, so that a restart already visible
        # registers everything once rather than this resource twice; then keep
        # looking for a moment, because the watcher groups file events for up to
        # a few hundred milliseconds before it reports them.
        self.probe()
        self._feed(ConnectionClosed(connection, self._now()))
        self.follow()

    # -- kubelet.sock ------------------------------------------------------------------

    def probe(self) -> None:
        """Look at kubelet.sock once; tell the core if it is another one than before."""
        identity = socket_identity(self.kubelet_socket)
        if identity == self._identity:
            return
        self._identity = identity
        self._retire()
        if identity is None:
            self._feed(KubeletStopped(self._now()))
            self._said_waiting = self._now()
            self.follow(fast=False)
        else:
            self._said_waiting = None
            self._feed(KubeletStarted(self._now(), self._checkpoint()))

    def say_waiting(self) -> None:
        """Log what dp waits for while there is no kubelet.sock (at start, then each minute)."""
        self._said_waiting = self._now()
        directory = self.kubelet_socket.parent
        if directory.is_dir():
            why = "no kubelet is listening: is the kubelet running on this node?"
        else:
            why = (
                f"{directory} does not exist: the kubelet makes it at start "
                "(is --device-plugin-dir the kubelet's directory?)"
            )
        _log.warning(
            "waiting-for-kubelet",
            extra={"dp_fields": {"socket": str(self.kubelet_socket), "reason": why}},
        )

    def follow(self, *, fast: bool = True) -> None:
        """Look at kubelet.sock often for a while (`fast`), or, while there is
        none, once a second until there is."""
        idle = self._follower is None or self._follower.done()
        if fast:
            self._since = self._now()
            if not idle:  # it may be in a slow step: start looking often now
                assert self._follower is not None
                self._follower.cancel()
                idle = True
        elif idle:
            self._since = self._now() - _FOLLOW_SLOW[1]
        if idle:
            self._follower = self._spawn(self._look())

    async def _look(self) -> None:
        while not self._stopping():
            elapsed = self._now() - self._since
            if elapsed < _FOLLOW_FAST[1]:
                step = _FOLLOW_FAST[0]
            elif elapsed < _FOLLOW_SLOW[1]:
                step = _FOLLOW_SLOW[0]
            elif self._identity is None:
                # Still no kubelet: keep a slow look besides the watcher, which
                # misses a socket made before its watch was in place.
                step = _LOOK_WHILE_ABSENT
                said = self._said_waiting
                if said is None or self._now() - said >= _SAY_WHILE_ABSENT:
                    self.say_waiting()
            else:
                return
            await asyncio.sleep(step)
            # kubelet.sock alone: each Register re-creates its own listening
            # socket if the kubelet deleted it, so 64 of them are not re-created
            # (or looked at) before the first Register goes out.
            self.probe()
