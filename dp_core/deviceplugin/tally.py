"""The device-plugin front end's counters over what it was asked and answered.

The front end counts each outcome where it decides it (an Allocate answered
or rejected, and with which status), not attempts the shell made, and never
by looking through the effects afterwards for an answer. It holds numbers
only; the names and help texts operators see are `metrics`'.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from .effects import HealthChanged
from .inputs import (
    AllocateRequested,
    OptionsRequested,
    PreferredAllocationRequested,
    PreStartRequested,
    WatchStarted,
)

#: The kubelet's unary calls: each is answered with a `Reply` or a `Reject`.
UnaryInput = OptionsRequested | PreferredAllocationRequested | AllocateRequested | PreStartRequested
#: Every call of the kubelet's the front end counts (ListAndWatch is a stream).
RpcInput = UnaryInput | WatchStarted

__all__ = ["OK", "RPC_METHODS", "RpcInput", "RpcTally", "UnaryInput"]

#: The status of an RPC that was answered; a rejected one counts under its code's name.
OK = "OK"

#: The kubelet's name for the RPC each input stands for.
RPC_METHODS: dict[type, str] = {
    OptionsRequested: "GetDevicePluginOptions",
    WatchStarted: "ListAndWatch",
    PreferredAllocationRequested: "GetPreferredAllocation",
    AllocateRequested: "Allocate",
    PreStartRequested: "PreStartContainer",
}


class RpcTally:
    """Monotonic counters, keyed by the labels they are reported with; the
    front end counts each outcome where it decides it."""

    def __init__(self) -> None:
        self.rpcs: Counter[tuple[str, str, str]] = Counter()  # (method, resource, code)
        self.allocated_devices: Counter[str] = Counter()  # resource -> devices handed out
        self.registrations: Counter[tuple[str, bool]] = Counter()  # (resource, succeeded)
        self.health_changes: Counter[tuple[str, bool]] = Counter()  # (resource, now healthy)
        self.kubelet_starts = 0

    def answered(self, event: RpcInput, resource: str | None, code: str = OK) -> None:
        """`event`'s call answered with `code`, for `resource` ("" if its
        connection could not be attributed)."""
        self.rpcs[RPC_METHODS[type(event)], resource or "", code] += 1
        if code == OK and isinstance(event, AllocateRequested) and resource:
            self.allocated_devices[resource] += sum(map(len, event.containers))

    def registration_ended(self, resource: str, succeeded: bool) -> None:
        self.registrations[resource, succeeded] += 1

    def kubelet_started(self) -> None:
        self.kubelet_starts += 1

    def published(self, effects: Iterable[object]) -> None:
        """Count the health changes among `effects` it is about to return."""
        for effect in effects:
            if isinstance(effect, HealthChanged):
                self.health_changes[effect.resource, effect.healthy] += 1
