"""What can happen to the DRA front end, as frozen inputs (`Node.handle`).

A Prepare comes in two steps of one call: `ClaimPrepareRequested` names the
claim, and unless the claim is prepared already the core asks for it to be
read (`ReadClaim`). The shell reads it (`GET resourceclaims/<ns>/<name>`),
checks its UID and hands over its allocation results as they are, every
driver's (`ClaimRead`), or why it could not (`ClaimUnreadable`); the core
keeps the results of its own driver and judges the rest.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from .claims import ClaimRef
from .prepared import PreparedClaim
from .prepared import request_resources as _request_resources

__all__ = [
    "AllocatedDevice",
    "ClaimFilesRemoved",
    "ClaimFilesWritten",
    "ClaimPrepareRequested",
    "ClaimRead",
    "ClaimUnprepareRequested",
    "ClaimUnreadable",
    "ClaimsRecalled",
    "DraFeaturesObserved",
    "DraInput",
    "HealthWatchEnded",
    "HealthWatchStarted",
]


@attrs.frozen
class AllocatedDevice:
    """One `status.allocation.devices.results[]` entry of a claim."""

    request: str
    driver: str
    pool: str
    device: str


def _results(value: Iterable[AllocatedDevice]) -> tuple[AllocatedDevice, ...]:
    return tuple(value)


@attrs.frozen
class ClaimPrepareRequested:
    """NodePrepareResources for one claim; `call` pairs it with its answer.

    A claim prepared already is answered from what the node holds; any other
    is asked to be read first (`ReadClaim`), and the call goes on with
    `ClaimRead` or `ClaimUnreadable`.
    """

    call: int
    claim: ClaimRef
    now: float


@attrs.frozen
class ClaimRead:
    """The shell carried out `ReadClaim` for call `call`: the claim's
    `status.allocation.devices.results`, its UID checked.

    `pod_claim_name` is the claim's `resource.kubernetes.io/pod-claim-name`
    annotation, when it was made from a template. `extended_resources` is
    set for the claim the scheduler made for a pod's extended resources:
    (request, extended resource name) from the pod's
    `status.extendedResourceClaimStatus.requestMappings` (`extended`).
    """

    call: int
    results: tuple[AllocatedDevice, ...] = attrs.field(converter=_results)
    now: float
    pod_claim_name: str | None = None
    extended_resources: tuple[tuple[str, str], ...] = attrs.field(
        default=(), converter=_request_resources
    )


def _problem(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not value:
        raise ValueError("a claim that could not be read needs the problem it met")


@attrs.frozen
class ClaimUnreadable:
    """The shell could not carry out `ReadClaim` for call `call`: `problem`
    says why, naming the claim (the API server away, the claim gone or made
    again under another UID, its allocation incomplete), and is the refusal's
    message as it stands.

    Its own input rather than a `ClaimRead` with a problem: a read that
    failed has no allocation, and a separate kind keeps a read with both
    from being made at all.
    """

    call: int
    problem: str = attrs.field(validator=_problem)


@attrs.frozen
class ClaimUnprepareRequested:
    """NodeUnprepareResources for one claim, which may be gone from the API by now."""

    call: int
    claim: ClaimRef
    now: float


@attrs.frozen
class ClaimFilesWritten:
    """The shell carried out `ClaimPrepared` for call `call`: `problem` says why
    the claim's files could not be written ("" when they were)."""

    call: int
    problem: str = ""


@attrs.frozen
class ClaimFilesRemoved:
    """The shell carried out `ClaimUnprepared` for call `call`: `problem` says
    why the claim's files could not be removed ("" when they were)."""

    call: int
    problem: str = ""


def _claims(value: Iterable[PreparedClaim]) -> tuple[PreparedClaim, ...]:
    return tuple(value)


@attrs.frozen
class ClaimsRecalled:
    """At start, before any Prepare: the claims an earlier run reported last
    (`ClaimsChanged`), read back from the checkpoint."""

    prepared: tuple[PreparedClaim, ...] = attrs.field(converter=_claims)

    @prepared.validator
    def _once_each(
        self,
        attribute: attrs.Attribute[tuple[PreparedClaim, ...]],
        value: tuple[PreparedClaim, ...],
    ) -> None:
        uids = [p.claim.uid for p in value]
        twice = sorted({uid for uid in uids if uids.count(uid) > 1})
        if twice:
            raise ValueError(f"claim UID recalled twice: {', '.join(twice)}")


@attrs.frozen
class DraFeaturesObserved:
    """What the API server showed of its DRA features.

    An API server without a feature drops its fields on write
    (`dropDisabledFields` in kubernetes' `pkg/registry/resource/resourceslice/
    strategy.go`), on a server-side dry run as on a real write, so the shell
    compares what it sent with what came back: `partitionable` is False when
    `sharedCounters`/`consumesCounters` were sent and dropped, True when they
    were kept, None when none were sent; `device_taints` likewise for
    `devices[].taints`. `unknown` says why the server could not be asked (a
    dry run it refused); each feature not seen yet is then taken as absent.
    """

    partitionable: bool | None = None
    device_taints: bool | None = None
    unknown: str | None = None


@attrs.frozen
class HealthWatchStarted:
    """The kubelet opened the DRA health stream (`NodeWatchResources`) `stream`."""

    stream: int
    now: float


@attrs.frozen
class HealthWatchEnded:
    """Health stream `stream` is gone (the kubelet cancelled it, or its connection closed)."""

    stream: int


DraInput = (
    ClaimPrepareRequested
    | ClaimRead
    | ClaimUnreadable
    | ClaimUnprepareRequested
    | ClaimFilesWritten
    | ClaimFilesRemoved
    | ClaimsRecalled
    | DraFeaturesObserved
    | HealthWatchStarted
    | HealthWatchEnded
)
