"""A ResourceClaim as read from the API server, turned into what the core takes.

The kubelet names a claim by namespace, name and UID; the claim read back
must have that UID (one deleted and made again since is another claim) and
an allocation with every result's request, driver, pool and device. What
cannot be prepared is refused here, by `BadClaim`, naming what is wrong.
"""

from __future__ import annotations

from lightkube.resources.resource_v1 import ResourceClaim

from dp_core import AllocatedDevice, ClaimRef

__all__ = ["POD_CLAIM_NAME", "BadClaim", "read_allocation", "show"]

# Set on a claim made from a pod's template (k8s.io/api/resource/v1 annotation).
POD_CLAIM_NAME = "resource.kubernetes.io/pod-claim-name"


class BadClaim(Exception):
    """The claim as read cannot be prepared; the message says why."""


def show(claim: ClaimRef) -> str:
    return f"{claim.namespace}/{claim.name} (UID {claim.uid})"


def read_allocation(
    claim: ClaimRef, obj: ResourceClaim, driver: str
) -> tuple[tuple[AllocatedDevice, ...], str | None]:
    """The claim's allocation results and pod-claim-name, after checking its UID."""
    metadata = obj.metadata
    uid = metadata.uid if metadata is not None else None
    if uid != claim.uid:
        raise BadClaim(
            f"claim {show(claim)} has UID {uid}, not {claim.uid}: "
            "it was deleted and made again since the kubelet asked"
        )
    status = obj.status
    allocation = status.allocation if status is not None else None
    devices = allocation.devices if allocation is not None else None
    if devices is None or not devices.results:
        raise BadClaim(f"claim {show(claim)} has no status.allocation.devices.results")
    results = []
    for index, result in enumerate(devices.results):
        fields = (result.request, result.driver, result.pool, result.device)
        if not all(isinstance(value, str) and value for value in fields):
            raise BadClaim(
                f"claim {show(claim)}: status.allocation.devices.results[{index}] lacks "
                "request, driver, pool or device"
            )
        results.append(AllocatedDevice(*fields))
    if not any(result.driver == driver for result in results):
        raise BadClaim(f"claim {show(claim)} has no device of driver {driver}")
    annotations = (metadata.annotations if metadata is not None else None) or {}
    return tuple(results), annotations.get(POD_CLAIM_NAME) or None
