"""The two kinds of failure the core knows, kept apart.

A `UsageError` is the caller's bug (the shell or a plugin author fed the core
something impossible) and is raised. A peer's bad request (an unknown device
ID from the kubelet, an RPC on a connection nobody owns) is not an exception:
it becomes a `Reject` effect carrying a `StatusCode` and a message.
"""

from __future__ import annotations

import enum

__all__ = ["StatusCode", "UsageError"]


class UsageError(Exception):
    """The core was driven in a way its contract forbids."""


class StatusCode(enum.Enum):
    """gRPC status codes the core answers with; the shell maps them 1:1."""

    INVALID_ARGUMENT = 3
    NOT_FOUND = 5
    FAILED_PRECONDITION = 9
    UNAVAILABLE = 14
