"""When the server runs Python's garbage collector: the whole policy, in one place.

Two things make the defaults a poor fit:

- The host model is thousands of long-lived objects. Left to the cyclic
  collector, each full collection walks them all, in the middle of some
  Allocate. The model a rescan replaced is collected a second after it,
  off the path of what the rescan changed, and what survives is kept out of
  later collections (`gc.freeze`).
- Dropped kubelet connections stay in reference cycles (grpclib keeps a
  stream's error, whose traceback holds the stream) that only a full
  collection frees, and nothing else triggers one on a quiet server.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Callable, Iterator

__all__ = ["CollectionPolicy", "Schedule"]

# Runs a callback so many seconds later: the running loop's `call_later` unless
# told otherwise (a test records the decisions instead of waiting for them).
Schedule = Callable[[float, Callable[[], object]], object]

_AFTER_REGISTRATIONS = 1.0  # seconds
_AFTER_RESCAN = 1.0  # seconds


def _call_later(delay: float, callback: Callable[[], object]) -> object:
    return asyncio.get_running_loop().call_later(delay, callback)


class CollectionPolicy:
    def __init__(self, schedule: Schedule = _call_later) -> None:
        self._schedule = schedule
        self._scanned = False
        self._collection_pending = False  # the one after a rescan

    def registrations_settled(self) -> None:
        """Every resource is registered again, after some were not (the core's
        `RegistrationsSettled`: once per storm of Registers, after a closed
        connection, failed Registers or a kubelet restart).

        Collect what the lost connections left, a second later: off the path
        of the last registrations, once the storm is over.
        """
        self._schedule(_AFTER_REGISTRATIONS, gc.collect)

    @contextlib.contextmanager
    def scanning(self) -> Iterator[None]:
        """Around a host scan: no automatic collections.

        A scan builds tens of thousands of objects, none in a reference cycle,
        so the collections their allocation would trigger (a full one, on a
        large host) find nothing to free and only walk the heap.
        """
        collecting = gc.isenabled()
        gc.disable()
        try:
            yield
        finally:
            if collecting:
                gc.enable()

    def after_rescan(self) -> None:
        """A new host model replaced the last one.

        The old one is collected a second later, not now: what the rescan
        changed (a device's health on its way to the kubelet and the API
        server) goes out first, and a full collection takes 30-40 ms on
        4,096 functions. Unfreeze first, so that a cycle that died since the
        last rescan is still collected, and freeze what survives. At start
        only freeze: a full collection would free little (0.3 MB on 4,096
        functions) before the first Register.
        """
        if not self._scanned:
            self._scanned = True
            gc.freeze()
            return
        if not self._collection_pending:
            self._collection_pending = True
            self._schedule(_AFTER_RESCAN, self._collect_after_rescan)

    def _collect_after_rescan(self) -> None:
        self._collection_pending = False
        gc.unfreeze()
        gc.collect()
        gc.freeze()

    def after_kubelet_left(self) -> None:
        """Every plugin connection is gone: the kubelet is restarting, most likely.

        Free their garbage before it is back, so that its new connections
        reuse that memory instead of adding to the high-water mark: a few
        milliseconds for 64 connections, while the kubelet is still starting.
        """
        self._schedule(0, gc.collect)
