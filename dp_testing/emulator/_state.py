"""What the emulated kubelet knows: resources, devices, pods and its event log.

The public snapshot types (`ResourceState`, `DeviceState`, ...) are what the
emulator's queries return; `_Resource` and `KubeletState` are the mutable
state behind them, shared by the registration machinery and the pod side and
guarded by one condition variable.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol

from dp_testing.emulator._rpc import HEALTHY, UNHEALTHY


class _Endpoint(Protocol):
    """What the state reads of a registration's client (`_registration._Endpoint`)."""

    endpoint: str
    options: PluginOptions


class KubeletError(Exception):
    """An error the kubelet itself raises (not a gRPC status from the plugin)."""


class AdmissionError(KubeletError):
    """A pod the kubelet would refuse to admit (UnexpectedAdmissionError and kin)."""


class Event(NamedTuple):
    """One thing the emulated kubelet did or saw, for ordering and timing asserts.

    Kinds: "register" (request received), "rejected" (validation failed),
    "refused" (the `refuse` hook said no), "dial", "dial-failed", "options",
    "registered" (endpoint stored), "replied" (Register RPC finished server
    side), "replaced" (a re-registration retired the old endpoint), "list",
    "stream-ended", "stale-stream-ended" (stream of a retired endpoint),
    "preferred", "allocate", "pre-start", "admit", "remove-pod", "restart",
    "stop".
    """

    time: float
    kind: str
    resource: str
    detail: str


@dataclass(frozen=True)
class DeviceState:
    """A device as the kubelet knows it: the last reported state, or Unhealthy."""

    id: str
    health: str
    numa_nodes: tuple[int, ...] = ()

    @property
    def healthy(self) -> bool:
        # The kubelet treats anything but exactly "Healthy" as unhealthy.
        return self.health == HEALTHY


@dataclass(frozen=True)
class PluginOptions:
    """The options the kubelet holds for a registration."""

    pre_start_required: bool = False
    get_preferred_allocation_available: bool = False


@dataclass(frozen=True)
class ResourceState:
    """Snapshot of one extended resource as the emulated kubelet sees it."""

    name: str
    devices: Mapping[str, DeviceState]
    #: True while a registration with a live ListAndWatch client exists.
    registered: bool
    #: Endpoint (socket name) of the current or last registration.
    endpoint: str | None
    options: PluginOptions | None
    #: Successful registrations of this resource since the emulator was created.
    registrations: int
    #: ListAndWatch responses received for this resource, over all endpoints.
    lists: int
    #: time.monotonic() of the current registration, None when not registered.
    registered_at: float | None

    @property
    def capacity(self) -> int:
        return len(self.devices)

    @property
    def allocatable(self) -> int:
        return sum(1 for d in self.devices.values() if d.healthy)


@dataclass(frozen=True)
class ContainerAllocation:
    """Devices one container holds, per resource, with their NUMA nodes then,
    and the plugin's Allocate answer for each resource (serialized), which the
    kubelet keeps in its checkpoint."""

    devices: Mapping[str, tuple[DeviceState, ...]]
    responses: Mapping[str, bytes] = field(default_factory=dict)


@dataclass
class Pod:
    """The emulator's pod model: just enough for allocations and PodResources."""

    name: str
    namespace: str
    containers: dict[str, ContainerAllocation] = field(default_factory=dict)
    uid: str = ""


class _Resource:
    """One resource's mutable state; every change goes through a method here.

    Snapshots are cached until the next change: waiters re-read every resource
    on each event (64 resources, several events per registration), and
    rebuilding them all each time was most of the emulator's CPU during a
    burst of registrations. The device dict is replaced, never mutated, so a
    snapshot can share it.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.devices: dict[str, DeviceState] = {}
        self.endpoint: _Endpoint | None = None
        self.last_endpoint: str | None = None
        self.last_options: PluginOptions | None = None
        self.registrations = 0
        self.lists = 0
        self.registered_at: float | None = None
        #: A ListAndWatch response arrived since the current registration.
        self.listed = False
        self._snapshot: ResourceState | None = None

    def attach(self, ep: _Endpoint, now: float) -> _Endpoint | None:
        """Store a new registration's endpoint; returns the one it replaces."""
        old = self.endpoint
        self.endpoint = ep
        self.last_endpoint = ep.endpoint
        self.last_options = ep.options
        self.registrations += 1
        self.registered_at = now
        self.listed = False
        self._snapshot = None
        return old

    def replace_devices(self, devices: dict[str, DeviceState]) -> None:
        """A ListAndWatch response: `devices` is the whole new list."""
        self.devices = devices
        self.lists += 1
        self.listed = True
        self._snapshot = None

    def detach(self) -> None:
        """The client is gone: devices turn unhealthy, capacity stays."""
        self.endpoint = None
        self.registered_at = None
        self.devices = {i: DeviceState(i, UNHEALTHY, d.numa_nodes) for i, d in self.devices.items()}
        self._snapshot = None

    def snapshot(self) -> ResourceState:
        snap = self._snapshot
        if snap is None:
            ep = self.endpoint
            snap = self._snapshot = ResourceState(
                name=self.name,
                devices=MappingProxyType(self.devices),
                registered=ep is not None,
                endpoint=ep.endpoint if ep else self.last_endpoint,
                options=ep.options if ep else self.last_options,
                registrations=self.registrations,
                lists=self.lists,
                registered_at=self.registered_at,
            )
        return snap


class KubeletState:
    """The kubelet's memory, and the condition every change is announced on.

    Every mutation happens with `cond` held and ends in `notify_all`, which is
    what lets `KubeletEmulator.wait_for` re-check its predicate on each change.
    """

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.RLock())
        self.resources: dict[str, _Resource] = {}
        # The pods the API server has bound to this node (they outlive a
        # restart), with the devices the device manager gave them.
        self.pods: dict[str, Pod] = {}
        self.events: list[Event] = []
        # The device manager's entries of pods that are not active (removed,
        # or read back from the checkpoint for a pod the API server no longer
        # has): their devices stay allocated until it drops them, which it
        # does only once it has synced (`KubeletEmulator.synced_at`).
        self.lingering: list[Any] = []  # _checkpoint.PodDevicesEntry
        # time.monotonic() from which PodResources lists the pods (see Startup).
        self.synced_at = 0.0

    def event_locked(self, kind: str, resource: str, detail: str) -> None:
        self.events.append(Event(time.monotonic(), kind, resource, detail))
        self.cond.notify_all()

    def event(self, kind: str, resource: str, detail: str) -> None:
        with self.cond:
            self.event_locked(kind, resource, detail)


__all__ = [
    "AdmissionError",
    "ContainerAllocation",
    "DeviceState",
    "Event",
    "KubeletError",
    "KubeletState",
    "PluginOptions",
    "Pod",
    "ResourceState",
]
