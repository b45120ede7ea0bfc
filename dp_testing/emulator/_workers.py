"""Daemon threads for the kubelet's per-plugin goroutines, kept between uses.

Each ListAndWatch reader (and each after-reply dial) needs a thread of its
own for as long as it runs. Starting a thread blocks the starter until the new
thread has run, which inside a Register handler is latency on the plugin's
critical path; after a kubelet restart the old readers have all just ended, so
their threads take the new registrations' work instead.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Task:
    """One unit of work running on a worker thread; `join` waits for its end."""

    def __init__(self, target: Callable[[], None], name: str) -> None:
        self.target = target
        self.name = name
        self.thread: threading.Thread | None = None
        self._done = threading.Event()

    def join(self, timeout: float | None = None) -> bool:
        """True once the task has ended; never waits on the calling thread's own task."""
        if self.thread is threading.current_thread():
            return False
        return self._done.wait(timeout)

    def done(self) -> bool:
        return self._done.is_set()

    def _run(self) -> None:
        thread = self.thread = threading.current_thread()
        thread.name = self.name
        try:
            self.target()
        except Exception:  # a background failure must show up, not vanish
            log.exception("kubelet emulator thread %s failed", self.name)
        finally:
            thread.name = "kubelet-idle"


class Workers:
    """As many daemon threads as tasks running at once, no fewer, reused.

    Every submitted task claims a worker before it is queued (an idle one, or
    a new thread), so a task never waits behind long-running ones.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._idle = 0
        self._closed = False

    def submit(self, target: Callable[[], None], name: str) -> Task:
        task = Task(target, name)
        with self._lock:
            if self._closed:
                raise RuntimeError("worker pool is closed")
            claimed = self._idle > 0
            if claimed:
                self._idle -= 1
        self._queue.put(task)
        if not claimed:
            threading.Thread(target=self._work, name="kubelet-idle", daemon=True).start()
        return task

    def close(self) -> None:
        """Let idle workers exit, and busy ones once their task ends."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, 0
        for _ in range(idle):
            self._queue.put(None)

    def _work(self) -> None:
        while True:
            task = self._queue.get()
            if task is None:
                return
            task._run()
            with self._lock:
                closed = self._closed
                if not closed:
                    self._idle += 1
            # Only now: whoever joined the task may submit at once and finds
            # this thread idle rather than starting another.
            task._done.set()
            if closed:
                return


__all__ = ["Task", "Workers"]
