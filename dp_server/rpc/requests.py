"""A handler's request: read once, and refused clearly when it is not there."""

from __future__ import annotations

from typing import Any

import grpclib.server
from grpclib.const import Status
from grpclib.exceptions import GRPCError

__all__ = ["read_request"]


async def read_request(stream: grpclib.server.Stream[Any, Any]) -> Any:
    """The call's one request message; INVALID_ARGUMENT if it is malformed or absent."""
    try:
        request = await stream.recv_message()
    except (ValueError, UnicodeDecodeError, IndexError) as error:
        raise GRPCError(Status.INVALID_ARGUMENT, f"malformed request: {error}") from None
    if request is None:
        raise GRPCError(Status.INVALID_ARGUMENT, "the call carried no request message")
    return request
