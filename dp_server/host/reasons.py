"""What went wrong reading the host, in the words a scan problem uses."""

from __future__ import annotations

__all__ = ["why"]


def why(exc: BaseException) -> str:
    if isinstance(exc, FileNotFoundError):
        return "missing (or gone during the scan)"
    if isinstance(exc, PermissionError):
        return "permission denied"
    if isinstance(exc, OSError):
        return exc.strerror or type(exc).__name__
    return str(exc)
