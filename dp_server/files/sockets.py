"""Unix socket files: whether one is still the one made, and whether anyone listens."""

from __future__ import annotations

import socket
import stat
from pathlib import Path

__all__ = ["SOCKET_PATH_MAX", "listened_on", "socket_identity"]

# A unix socket address holds at most 108 bytes with its terminating NUL.
SOCKET_PATH_MAX = 107


def socket_identity(path: Path) -> tuple[int, int] | None:
    """Inode and modification time of a socket file: a file created again differs.

    The inode alone is not enough, since a deleted socket's inode is often
    reused at once by the next one; a new socket file has a new mtime. Not the
    change time: chmod, chown, a hard link or an SELinux relabel of the same
    file change that, and must not read as the file having been replaced.
    None when there is no socket at `path` itself (nothing, or something else,
    a link included).
    """
    try:
        info = path.lstat()
    except OSError:
        return None
    return (info.st_ino, info.st_mtime_ns) if stat.S_ISSOCK(info.st_mode) else None


def listened_on(path: Path) -> bool:
    """Whether a process accepts connections on the socket at `path`."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True
