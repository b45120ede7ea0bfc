"""The device-plugin front end's counters over what it was asked and answered.

It sees every input the node handled together with the effects it returned,
so it counts outcomes (an Allocate answered or rejected, and with which
status) rather than attempts the shell made. It holds numbers only; the
names and help texts operators see are `metrics`'.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from .effects import EndStream, HealthChanged, Publish, Reject, Reply
from .inputs import (
    AllocateRequested,
    KubeletStarted,
    OptionsRequested,
    PreferredAllocationRequested,
    PreStartRequested,
    RegistrationFailed,
    RegistrationSucceeded,
    WatchStarted,
)

RpcInput = (
    OptionsRequested
    | WatchStarted
    | PreferredAllocationRequested
    | AllocateRequested
    | PreStartRequested
)

__all__ = ["OK", "RPC_METHODS", "RpcInput", "RpcTally"]

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
    """Monotonic counters, keyed by the labels they are reported with."""

    def __init__(self) -> None:
        self.rpcs: Counter[tuple[str, str, str]] = Counter()  # (method, resource, code)
        self.allocated_devices: Counter[str] = Counter()  # resource -> devices handed out
        self.registrations: Counter[tuple[str, bool]] = Counter()  # (resource, succeeded)
        self.health_changes: Counter[tuple[str, bool]] = Counter()  # (resource, now healthy)
        self.kubelet_starts = 0

    def observe(
        self, event: object, effects: Sequence[object], owner: Callable[[int], str | None]
    ) -> None:
        """Count `event` and its `effects`; `owner` names a connection's resource."""
        if isinstance(event, RpcInput):
            self._rpc(event, effects, owner)
        elif isinstance(event, RegistrationSucceeded | RegistrationFailed):
            self.registrations[event.resource, isinstance(event, RegistrationSucceeded)] += 1
        elif isinstance(event, KubeletStarted):
            self.kubelet_starts += 1
        for effect in effects:
            if isinstance(effect, HealthChanged):
                self.health_changes[effect.resource, effect.healthy] += 1

    def _rpc(
        self, event: RpcInput, effects: Sequence[object], owner: Callable[[int], str | None]
    ) -> None:
        # The core's answer has attributed the connection by now, when it could be.
        resource = owner(event.connection) or ""
        code = OK
        if isinstance(event, WatchStarted):
            for effect in effects:
                if isinstance(effect, EndStream) and effect.stream == event.stream:
                    code = "UNAVAILABLE"  # how the shell ends a stream it may not serve
                    break
                if isinstance(effect, Publish) and effect.stream == event.stream:
                    break
        else:
            for effect in effects:
                if isinstance(effect, Reject) and effect.call == event.call:
                    code = effect.status.name
                    break
                if isinstance(effect, Reply) and effect.call == event.call:
                    if isinstance(event, AllocateRequested):
                        self.allocated_devices[resource] += sum(map(len, event.containers))
                    break
        self.rpcs[RPC_METHODS[type(event)], resource, code] += 1
