"""Directory changes, from watchfiles, delivered to the event loop.

watchfiles' blocking watcher runs in a thread of our own rather than through
`awatch`: awatch needs anyio's asyncio backend, which insists on loading ssl
(5 MB the server does without, see `dp_server.__main__`).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from watchfiles import watch

__all__ = ["DirectoryWatcher", "FileVersion"]


class FileVersion:
    """Tells whether a file, followed through any symlinks, changed since last asked.

    Watching a config file's name is not enough: a ConfigMap update swaps the
    `..data` link it goes through, and a file may be a link to a sibling or
    through a directory link that a deploy tool swaps. What the path resolves
    to, and that file's size and times, change in every such case; a stat is
    cheap enough to take on any event in the directory and on every rescan.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen = self._version()

    def _version(self) -> tuple[int, int, int, int, int] | None:
        try:
            info = os.stat(self.path)
        except OSError:
            return None  # gone (or unreadable): coming back is a change too
        return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)

    def changed(self) -> bool:
        version = self._version()
        if version == self._seen:
            return False
        self._seen = version
        return True


class DirectoryWatcher:
    """Reports which entries of `directories` were added, removed or changed.

    Not recursive. The thread looks at its stop flag every `step` ms (the
    cost of an idle server: 0.1 % of a core at 50 ms) and groups changes over
    up to `debounce` ms.
    """

    def __init__(
        self, directories: Sequence[Path], *, step_ms: int = 50, debounce_ms: int = 200
    ) -> None:
        self.directories = list(directories)
        self._step_ms = step_ms
        self._debounce_ms = debounce_ms
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    async def changes(self) -> AsyncIterator[set[Path]]:
        """Each batch of changes, as the set of paths that changed."""
        batches: asyncio.Queue[set[Path]] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def run() -> None:
            for found in watch(
                *self.directories,
                stop_event=self._stop,
                debounce=self._debounce_ms,
                step=self._step_ms,
                recursive=False,
                raise_interrupt=False,
            ):
                changed = {Path(path) for _, path in found}
                loop.call_soon_threadsafe(batches.put_nowait, changed)

        self._thread = threading.Thread(target=run, name="dp-watch", daemon=True)
        self._thread.start()
        while True:
            yield await batches.get()

    def stop(self, timeout: float = 1.0) -> None:
        """Stop the thread; it notices within one step."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
