"""Carrying out the core's `BindDevice` and `UnbindDevice` effects, one at a time.

Off the event loop: a GPU driver can take seconds to let go, and Allocate
must not wait for it. When an effect's turn comes the core is asked whether
it still goes (`WriteDue`: a config change or a rescan may have withdrawn it
meanwhile, and then the core withdraws it itself); the core always hears
back, and after the last of a batch the host is scanned again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import TypeVar

from dp_core import (
    BindDevice,
    BindingFinished,
    Input,
    UnbindDevice,
    UnbindingFinished,
    WriteDecided,
    WriteDue,
)
from dp_server.binding.binder import Binder

__all__ = ["BindQueue", "writes_running"]

# How long a stopping dp waits for the write under way to end, so that what it
# did is known (a move is kept in the moves file); SIGTERM must exit within 5 s.
STOP_WAIT = 2.0

_T = TypeVar("_T")

# Feeds the input a call number makes and returns the core's answer (`Loop.call`).
Ask = Callable[[Callable[[int], Input]], object]

_WRITE_THREAD = "dp-sysfs-write"


def writes_running() -> bool:
    """Whether a sysfs write thread is still running (one the stop gave up on)."""
    return any(t.name == _WRITE_THREAD and t.is_alive() for t in threading.enumerate())


def _in_a_daemon_thread(call: Callable[[], _T]) -> concurrent.futures.Future[_T]:
    """Run `call` in a thread of its own that nothing waits for at exit.

    A sysfs write can hang in the kernel (vfio-pci's unbind waits for the
    device's user to let go). asyncio.run and the interpreter wait for the
    default executor's threads before exiting, so a write stuck there would
    keep a stopped dp alive; a daemon thread is left to the kernel instead.
    """
    future: concurrent.futures.Future[_T] = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(call())
        except BaseException as error:  # noqa: BLE001 - handed to the awaiting task
            future.set_exception(error)

    threading.Thread(target=run, name=_WRITE_THREAD, daemon=True).start()
    return future


class BindQueue:
    def __init__(
        self,
        binder: Binder,
        ask: Ask,
        feed: Callable[[Input], object],
        now: Callable[[], float],
        stopping: Callable[[], bool],
        after_batch: Callable[[], object],
    ) -> None:
        self.binder = binder
        self._ask = ask
        self._feed = feed
        self._now = now
        self._stopping = stopping  # once stopping, results are no longer reported
        self._after_batch = after_batch
        self._turn = asyncio.Lock()
        self.pending = 0

    def submit(self, effect: BindDevice | UnbindDevice) -> Coroutine[None, None, None]:
        """Queue `effect`; the caller runs the returned coroutine as a task."""
        self.pending += 1
        return self._run(effect)

    async def _run(self, effect: BindDevice | UnbindDevice) -> None:
        error: str | None = "it was not carried out"
        withdrawn = pinned = started = False
        report = True  # False: nothing to tell the core, or what the write did is unknown
        try:
            async with self._turn:
                # Stopping: nothing more is written (a new dp may be starting);
                # not going: the core has withdrawn it itself.
                if self._stopping() or not self._goes(effect):
                    report = False
                else:
                    started = True
                    result = await self._carried_out(effect)
                    if result is None:
                        report = False
                    else:
                        error, withdrawn, pinned = result
        finally:  # the core must hear back, or the function stays "in flight" for good
            self.pending -= 1
            # A write that started is reported even while stopping: what it did
            # to the host must reach the moves file.
            if report and (started or not self._stopping()):
                now = self._now()
                self._feed(
                    UnbindingFinished(effect.address, error, now, withdrawn=withdrawn)
                    if isinstance(effect, UnbindDevice)
                    else BindingFinished(
                        effect.address, error, now, withdrawn=withdrawn, pinned=pinned
                    )
                )
        if not self.pending and not self._stopping():  # one look at the host after a batch
            self._after_batch()

    async def _carried_out(
        self, effect: BindDevice | UnbindDevice
    ) -> tuple[str | None, bool, bool] | None:
        """The write's result; None when dp stopped before it ended (unknown)."""
        work = asyncio.wrap_future(_in_a_daemon_thread(lambda: self.carry_out(effect)))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            # dp is stopping, and its thread finishes the write regardless.
            try:
                return await asyncio.wait_for(work, STOP_WAIT)
            except TimeoutError:
                # Unknown: reporting a failure would make the core forget a
                # move whose give-back may not happen; keep the file as it is.
                return None

    def _goes(self, effect: BindDevice | UnbindDevice) -> bool:
        answer = self._ask(lambda call: WriteDue(call, effect, self._now()))
        if not isinstance(answer, WriteDecided):  # pragma: no cover - the core always answers
            raise RuntimeError(f"WriteDue for {effect.address}: the core gave no answer")
        return answer.carry_out

    def carry_out(self, effect: BindDevice | UnbindDevice) -> tuple[str | None, bool, bool]:
        """(error, withdrawn, pinned), off the loop.

        A bind finds the function on vfio-pci already when its plan came from
        a scan older than an earlier bind, or when something else (libvirt,
        driverctl) put it there: nothing to write, and not dp's move to record.
        """
        if isinstance(effect, UnbindDevice):
            error = self.binder.unbind(effect.address, effect.driver, pinned=effect.pinned)
            return error, False, False
        if self.binder.on_vfio(effect.address):
            return None, True, False
        error, pinned = self.binder.move(effect.address, effect.driver)
        return error, False, pinned
