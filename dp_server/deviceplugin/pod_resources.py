"""How the server asks the kubelet's PodResources API what is held.

The core decides what a reservation is, when one may be released and when
to ask (`RefreshAllocations`, regular while anything is held: the core's
`HeldPolls`); this module makes the call as soon as it is asked, never two
within the minimum gap.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import cast

from grpclib.client import Channel, UnaryUnaryMethod
from grpclib.exceptions import GRPCError, StreamTerminatedError

from dp_server.deviceplugin import wire
from dp_server.proto import v1 as podresources

__all__ = ["LIST_TIMEOUT", "PodResourcesPoller"]

_log = logging.getLogger("dp.runtime")

LIST_METHOD = "/v1.PodResourcesLister/List"
#: The deadline of one List call: an answer is never older than this when it
#: comes, which `Timing.release_grace` counts on.
LIST_TIMEOUT = 5.0


class PodResourcesPoller:
    def __init__(self, socket: str, min_gap: float) -> None:
        self.socket = socket
        self.min_gap = min_gap
        self.last_poll = -1e9
        self._requested: float | None = None
        self._warned = False

    def request(self, now: float) -> None:
        """Poll as soon as the minimum gap allows (the core sent RefreshAllocations)."""
        self._requested = max(now, self.last_poll + self.min_gap)

    def due_at(self) -> float | None:
        """When to poll next; None while the core has not asked."""
        return self._requested

    def may_poll(self, now: float) -> bool:
        return now - self.last_poll >= self.min_gap

    async def poll(self, now: float) -> Mapping[str, frozenset[str]] | None:
        """The devices each resource has in use, or None (logged once) if unreachable."""
        self.last_poll = now
        self._requested = None
        channel = Channel(path=self.socket, codec=wire.PreEncodedCodec())
        try:
            # The answer is read by wire.held_devices, strictly: it decides
            # which reservations end, and betterproto2 would read garbled
            # bytes as an empty list.
            request = podresources.ListPodResourcesRequest
            call = UnaryUnaryMethod(channel, LIST_METHOD, request, wire.Raw)
            answer = await call(podresources.ListPodResourcesRequest(), timeout=LIST_TIMEOUT)
            data = cast(bytes, answer)  # `Raw` arrives undecoded
            held = wire.held_devices(data)
        except (TimeoutError, GRPCError, OSError, StreamTerminatedError, wire.WireError) as error:
            if not self._warned:
                _log.warning(
                    "pod-resources-unavailable",
                    extra={
                        "dp_fields": {
                            "socket": self.socket,
                            "reason": describe_error(error),
                            "effect": "IOMMU group reservations are kept until it answers",
                        }
                    },
                )
                self._warned = True
            return None
        finally:
            channel.close()
        self._warned = False
        return held


def describe_error(error: BaseException) -> str:
    if isinstance(error, GRPCError):
        return f"{error.status.name}: {error.message}"
    if isinstance(error, asyncio.TimeoutError):
        return "timed out"
    if isinstance(error, wire.WireError):
        return f"malformed answer: {error}"
    return f"{type(error).__name__}: {error}"
