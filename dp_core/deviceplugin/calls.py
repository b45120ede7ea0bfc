"""What the device-plugin front end answers to the kubelet's calls.

`answer` finds the resource a call's connection is attributed to
(`Registrar.attribute`) and has the call's work decide the answer: these
functions decide it from what was published and what the ledger holds, or
raise `Rejection` with the status and the message the kubelet gets, which
`answer` turns into a `Reject` and a log line.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import attrs

from ..cdi.resources import CdiKeeper
from ..errors import StatusCode
from ..inventory.advertised import AdvertisedDevice
from ..inventory.edits import ContainerAllocation, container_allocation
from ..inventory.resources import Resource
from ..log import Log
from .allocations import AllocationBook, allocation_log
from .answers import AllocateAnswer, Answer, PreferredAnswer
from .effects import AttributeConnection, RefreshAllocations, Reject, Reply
from .inputs import (
    ContainerPreference,
)
from .preferred import preferred_devices
from .registration import Registrar
from .tally import OK, UnaryInput

Effect = Log | RefreshAllocations

__all__ = [
    "Rejection",
    "UnaryInput",
    "allocate",
    "answer",
    "lookup",
    "preferred",
    "rejected",
    "resource_for",
]

Answered = Reply | Reject | AttributeConnection | Effect

_SHOWN_ID_LENGTH = 64


class Rejection(Exception):
    """A call the node refuses: `status` and `message` go to the caller;
    `effects` go out all the same."""

    def __init__(self, status: StatusCode, message: str, effects: Sequence[Effect] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.effects = tuple(effects)


def _show(device_id: str) -> str:
    if len(device_id) <= _SHOWN_ID_LENGTH:
        return repr(device_id)
    return f"{device_id[:_SHOWN_ID_LENGTH]!r}... ({len(device_id)} characters)"


def lookup(
    published: Mapping[str, AdvertisedDevice], resource: str, device_ids: Sequence[str]
) -> list[AdvertisedDevice]:
    """The devices `device_ids` name among those last published for `resource`."""
    found = []
    for device_id in device_ids:
        device = published.get(device_id)
        if device is None:
            raise Rejection(
                StatusCode.INVALID_ARGUMENT,
                f"unknown device ID {_show(device_id)} for resource {resource}",
            )
        found.append(device)
    if len(set(device_ids)) != len(device_ids):
        duplicates = sorted(d for d, n in Counter(device_ids).items() if n > 1)
        raise Rejection(
            StatusCode.INVALID_ARGUMENT,
            f"device ID {_show(duplicates[0])} is requested twice for resource {resource}",
        )
    return found


def preferred(
    published: Mapping[str, AdvertisedDevice],
    resource: str,
    containers: Sequence[ContainerPreference],
) -> PreferredAnswer:
    answers = []
    for container in containers:
        available = lookup(published, resource, container.available)
        must = lookup(published, resource, container.must_include)
        answers.append(preferred_devices(available, must, container.size))
    return PreferredAnswer(tuple(answers))


@attrs.frozen
class Allocated:
    """An Allocate's answer, the log lines and refreshes that go with it, and
    the IOMMU groups whose holders changed."""

    answer: AllocateAnswer
    effects: tuple[Effect, ...]
    touched: frozenset[int]


def allocate(
    resource: Resource | None,
    name: str,
    containers: Sequence[Sequence[str]],
    *,
    published: Mapping[str, AdvertisedDevice],
    inventory: Mapping[str, AdvertisedDevice],
    allocations: AllocationBook,
    cdi: CdiKeeper | None,
    now: float,
) -> Allocated:
    """Allocate `containers`' devices of resource `name`, or raise Rejection.

    Nothing is recorded unless every container can have its devices: a
    device Unhealthy in the inventory, a group another holder has, or a group
    two containers of this call ask for refuses the whole call. A refused
    split asks PodResources at once (the holder may be gone): the
    rejection's `effects`.
    """
    if resource is None:
        raise Rejection(
            StatusCode.FAILED_PRECONDITION,
            f"resource {name} has no devices on this node any more",
        )
    planned = []
    groups_in_call: dict[int, str] = {}  # group -> a device of an earlier container
    for container in containers:
        devices = lookup(published, name, container)
        # Health before reservations: a reserved group is judged by conflict().
        inventory_devices = [inventory.get(d.id, d) for d in devices]
        for device in inventory_devices:
            if not device.healthy:
                raise Rejection(
                    StatusCode.FAILED_PRECONDITION,
                    f"device {device.id} of {name} is Unhealthy: {device.reason}",
                )
        conflict = allocations.conflict(name, inventory_devices)
        if conflict is not None:
            raise Rejection(
                StatusCode.FAILED_PRECONDITION, conflict, (RefreshAllocations(conflict),)
            )
        groups = {d.iommu_group: d.id for d in inventory_devices if d.iommu_group is not None}
        for group, device_id in groups.items():
            if group in groups_in_call:
                raise Rejection(
                    StatusCode.FAILED_PRECONDITION,
                    f"IOMMU group {group} of device {device_id} is also requested by "
                    f"another container ({groups_in_call[group]}) in this Allocate; "
                    "VFIO cannot split a group between containers",
                )
        groups_in_call.update(groups)
        planned.append(inventory_devices)
    answers: list[ContainerAllocation] = []
    logs: list[Effect] = []
    touched: set[int] = set()
    for devices in planned:
        allocation, replaced = allocations.record(name, devices, now)
        touched.update(allocation.groups)
        for gone in replaced:
            touched.update(gone.groups)
        answer = container_allocation(resource, devices)
        if cdi is not None:
            answer = attrs.evolve(answer, cdi_devices=cdi.names(name, devices))
        answers.append(answer)
        logs.append(allocation_log("allocated", allocation))
    return Allocated(AllocateAnswer(tuple(answers)), tuple(logs), frozenset(touched))


def resource_for(
    registrar: Registrar, connection: int, rpc: str, now: float
) -> tuple[str, list[AttributeConnection]]:
    """The resource an RPC on `connection` serves (and `AttributeConnection`
    if this call attributed it), or Rejection."""
    known = registrar.owner(connection) is not None
    resource = registrar.attribute(connection, now, rpc=rpc)
    if resource is not None:
        return resource, [] if known else [AttributeConnection(connection, resource)]
    why = registrar.why_unattributed(connection, rpc)
    requeued = registrar.orphan_seen(now)
    raise Rejection(
        StatusCode.UNAVAILABLE,
        f"connection {connection} is not attributed to any resource ({why}); re-registering "
        f"{', '.join(requeued) if requeued else 'nothing: every resource has a connection'}",
    )


def rejected(registrar: Registrar, rpc: str, connection: int, rejection: Rejection) -> Log:
    owner = registrar.owner(connection) or ""
    status, reason = rejection.status.name, rejection.message
    return Log.warning("rejected", rpc=rpc, resource=owner, status=status, reason=reason)


def answer(
    registrar: Registrar,
    rpc: str,
    call: int,
    connection: int,
    now: float,
    work: Callable[[str], Answer],
) -> tuple[list[Answered], str]:
    """Call `call`'s answer (`Reply`), or its `Reject` with what goes with it;
    and the status it was answered with (`OK`, or the rejection's code)."""
    try:
        resource, attributed = resource_for(registrar, connection, rpc, now)
        reply = Reply(call, work(resource))
    except Rejection as rejection:
        reject = Reject(call, rejection.status, rejection.message)
        refused: list[Answered] = [reject, rejected(registrar, rpc, connection, rejection)]
        refused += rejection.effects
        return refused, rejection.status.name
    return [*attributed, reply], OK
