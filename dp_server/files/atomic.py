"""Replacing a file so that a crash leaves the old one or the new one, never half."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

__all__ = ["sync_directory", "write_atomically"]


def write_atomically(target: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Replace `target` with `data`; raises OSError.

    The data goes to a temporary file in the same directory
    (`.<name>.XXXX.tmp`: hidden, and with a suffix no reader of `*.json`
    takes), which is flushed to disk and renamed over `target`. Call
    `sync_directory` once the renames of a batch are done.
    """
    descriptor, temporary = tempfile.mkstemp(
        dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"
    )
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temporary, mode)  # mkstemp makes it 0600
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def sync_directory(path: Path) -> None:
    """Make the renames in `path` survive a crash of the machine."""
    descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
