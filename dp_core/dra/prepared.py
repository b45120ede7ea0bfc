"""A prepared DRA claim as plain data: what it holds and what its containers get.

A `PreparedClaim` is the whole record of one NodePrepareResources that
succeeded: the claim, each device with its requests, IOMMU group, container
edits and attributes. The answer to the kubelet, the CDI spec, the KEP-5304
metadata and the checkpoint all derive from it, so a claim prepared again,
or recalled after a restart, gets the same answer even if its device has
gone from the host since.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from ..inventory.edits import ContainerAllocation
from .claims import ClaimRef
from .names import Attributes

__all__ = ["ClaimDevice", "PreparedClaim", "request_resources"]


def _names(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


@attrs.frozen
class ClaimDevice:
    """One allocated device of a prepared claim.

    `requests` are the claim's request names it serves (`req` or
    `req/subrequest`); `device_id` is its PCI address or mdev UUID; `edits`
    are what `container_allocation` gives a container for it alone.
    """

    requests: tuple[str, ...] = attrs.field(converter=_names)
    pool: str
    name: str
    device_id: str
    resource: str
    iommu_group: int | None
    edits: ContainerAllocation = ContainerAllocation()
    attributes: Attributes = ()


def _devices(value: Iterable[ClaimDevice]) -> tuple[ClaimDevice, ...]:
    return tuple(value)


def request_resources(value: Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """(request, extended resource) pairs, sorted; a request mapped twice is refused."""
    pairs = tuple(sorted({(str(request), str(resource)) for request, resource in value}))
    requests = [request for request, _ in pairs]
    twice = sorted({r for r in requests if requests.count(r) > 1})
    if twice:
        raise ValueError(f"request {twice[0]!r} is mapped to two extended resources")
    return pairs


@attrs.frozen
class PreparedClaim:
    """A claim NodePrepareResources prepared; `pod_claim_name` is set for a
    claim made from a template (its `resource.kubernetes.io/pod-claim-name`
    annotation), which names its metadata's path in the container.

    `extended_resources` is set for the claim the scheduler made for a pod's
    extended resources (`extended`): (request, the extended resource name
    the pod asked for that request serves), sorted, a request once.
    """

    claim: ClaimRef
    devices: tuple[ClaimDevice, ...] = attrs.field(default=(), converter=_devices)
    pod_claim_name: str | None = None
    extended_resources: tuple[tuple[str, str], ...] = attrs.field(
        default=(), converter=request_resources
    )

    @property
    def groups(self) -> tuple[int, ...]:
        """The IOMMU groups it holds, sorted, each once."""
        return tuple(sorted({d.iommu_group for d in self.devices if d.iommu_group is not None}))

    def describe(self) -> str:
        return f"claim {self.claim.describe()}"
