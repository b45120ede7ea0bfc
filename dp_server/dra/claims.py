"""A ResourceClaim as read from the API server, turned into what the core takes.

The kubelet names a claim by namespace, name and UID; the claim read back
must have that UID (one deleted and made again since is another claim) and
an allocation with every result's request, driver, pool and device. What
cannot be prepared is refused here, by `BadClaim`, naming what is wrong.
"""

from __future__ import annotations

from lightkube.resources.core_v1 import Pod
from lightkube.resources.resource_v1 import ResourceClaim

from dp_core import AllocatedDevice, ClaimRef
from dp_core.dra import EXTENDED_RESOURCE_CLAIM_ANNOTATION

__all__ = [
    "POD_CLAIM_NAME",
    "BadClaim",
    "extended_owner",
    "extended_resources",
    "read_allocation",
]

# Set on a claim made from a pod's template (k8s.io/api/resource/v1 annotation).
POD_CLAIM_NAME = "resource.kubernetes.io/pod-claim-name"


class BadClaim(Exception):
    """The claim as read cannot be prepared; the message says why."""


def read_allocation(
    claim: ClaimRef, obj: ResourceClaim, driver: str
) -> tuple[tuple[AllocatedDevice, ...], str | None]:
    """The claim's allocation results and pod-claim-name, after checking its UID."""
    metadata = obj.metadata
    uid = metadata.uid if metadata is not None else None
    if uid != claim.uid:
        raise BadClaim(
            f"claim {claim.describe()} has UID {uid}, not {claim.uid}: "
            "it was deleted and made again since the kubelet asked"
        )
    status = obj.status
    allocation = status.allocation if status is not None else None
    devices = allocation.devices if allocation is not None else None
    if devices is None or not devices.results:
        raise BadClaim(f"claim {claim.describe()} has no status.allocation.devices.results")
    results = []
    for index, result in enumerate(devices.results):
        fields = (result.request, result.driver, result.pool, result.device)
        if not all(isinstance(value, str) and value for value in fields):
            raise BadClaim(
                f"claim {claim.describe()}: status.allocation.devices.results[{index}] lacks "
                "request, driver, pool or device"
            )
        results.append(AllocatedDevice(*fields))
    if not any(result.driver == driver for result in results):
        raise BadClaim(f"claim {claim.describe()} has no device of driver {driver}")
    annotations = (metadata.annotations if metadata is not None else None) or {}
    return tuple(results), annotations.get(POD_CLAIM_NAME) or None


def extended_owner(claim: ClaimRef, obj: ResourceClaim) -> tuple[str, str] | None:
    """The pod (name, UID) a claim made for extended resources belongs to; None
    for any other claim.

    The scheduler makes that claim with the annotation and the pod as its
    controller owner, and finds it again by both
    (`extendeddynamicresources.go` `findExtendedResourceClaim`).
    """
    metadata = obj.metadata
    annotations = (metadata.annotations if metadata is not None else None) or {}
    if annotations.get(EXTENDED_RESOURCE_CLAIM_ANNOTATION) != "true":
        return None
    owners = (metadata.ownerReferences if metadata is not None else None) or []
    for owner in owners:
        if owner.kind == "Pod" and owner.controller:
            return owner.name, owner.uid
    raise BadClaim(
        f"claim {claim.describe()} is annotated {EXTENDED_RESOURCE_CLAIM_ANNOTATION}, but no pod "
        "is its controller owner: the scheduler makes it with its pod as the owner"
    )


def extended_resources(
    claim: ClaimRef, pod: Pod, owner: tuple[str, str]
) -> tuple[tuple[str, str], ...]:
    """(request, extended resource name) for each request of `claim`, from
    the owner pod's `status.extendedResourceClaimStatus.requestMappings`.

    The scheduler writes the mappings before it binds the pod, and the kubelet
    reads them to find this claim and each container's requests
    (`pkg/kubelet/cm/dra/manager.go`): a pod whose status lacks them is not
    prepared at all, so they are there when a driver is asked. The DeviceClass
    of a request is no substitute: a pod may ask by the class's implicit name
    (`deviceclass.resource.kubernetes.io/<class>`), and a class may be changed
    or deleted after the scheduler chose it.
    """
    name, uid = owner
    where = f"pod {claim.namespace}/{name}, owner of claim {claim.describe()}"
    metadata = pod.metadata
    if metadata is None or metadata.uid != uid:
        found = metadata.uid if metadata is not None else None
        raise BadClaim(f"{where}, has UID {found}, not {uid}: it was deleted and made again")
    status = pod.status.extendedResourceClaimStatus if pod.status is not None else None
    if status is None or status.resourceClaimName != claim.name:
        shown = status.resourceClaimName if status is not None else None
        raise BadClaim(
            f"{where}: status.extendedResourceClaimStatus names claim {shown!r}, not {claim.name!r}"
        )
    pairs: dict[str, str] = {}
    for index, mapping in enumerate(status.requestMappings or ()):
        request, resource = mapping.requestName, mapping.resourceName
        if pairs.setdefault(request, resource) != resource:
            raise BadClaim(
                f"{where}: status.extendedResourceClaimStatus.requestMappings[{index}] maps "
                f"request {request!r} to {resource!r}, and another entry to {pairs[request]!r}"
            )
    return tuple(sorted(pairs.items()))
