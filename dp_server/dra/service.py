"""The kubelet's DRA plugin service, `NodePrepareResources` and `NodeUnprepareResources`.

One handler per RPC serves both API versions, `k8s.io.kubelet.pkg.apis.dra.v1`
and `.v1beta1`: their messages are the same field for field, so a handler is
given the version's message classes and nothing else differs. The claims
are passed to the `ClaimPreparer` together and each is answered under its
UID; one claim's failure is that claim's `error`, never the call's. A request the
reply cannot answer claim by claim (a claim without a UID, two claims with
one UID) is refused whole with INVALID_ARGUMENT, naming the claims.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import grpclib.const
import grpclib.server
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError

from dp_core.dra import ClaimAnswered, ClaimRef, PreparedDevice
from dp_server.dra.preparer import ClaimPreparer, refused
from dp_server.proto.k8s.io.kubelet.pkg.apis.dra import v1 as pb_v1
from dp_server.proto.k8s.io.kubelet.pkg.apis.dra import v1beta1 as pb_v1beta1
from dp_server.rpc import read_request

__all__ = ["SERVICES", "SUPPORTED_VERSIONS", "DraPluginService"]

_log = logging.getLogger("dp")

#: Fully qualified service name -> that version's generated messages.
SERVICES: dict[str, ModuleType] = {
    "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin": pb_v1,
    "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin": pb_v1beta1,
}
#: What registration advertises, newest first: the kubelet takes the first it knows.
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")


class DraPluginService:
    """Both versions of `DRAPlugin`, answered through one `ClaimPreparer`."""

    def __init__(self, preparer: ClaimPreparer) -> None:
        self._preparer = preparer

    async def node_prepare_resources(
        self, pb: ModuleType, stream: grpclib.server.Stream[Any, Any]
    ) -> None:
        claims = _claims(await read_request(stream))
        asked = [claim for claim, problem in claims if problem is None]
        try:
            outcomes = dict(zip(asked, await self._preparer.prepare(asked), strict=True))
        except Exception as exc:  # the preparer's bug: every claim is told, the call answered
            _log.exception("dra-prepare-crashed", extra={"dp_fields": {"claims": len(asked)}})
            error = f"internal error preparing claims: {exc}"
            outcomes = {claim: refused(claim, error, "InternalError") for claim in asked}
        replies = {}
        for claim, problem in claims:
            outcome = outcomes.get(claim)
            if isinstance(outcome, Exception):  # one claim's bug must not fail the others
                _log.error("dra-prepare-crashed", exc_info=outcome, extra=_fields(claim))
                error = f"internal error preparing claim {_name(claim)}: {outcome}"
                outcome = refused(claim, error, "InternalError")
            error = problem or (outcome.error if outcome is not None else "")
            devices: Sequence[PreparedDevice] = (
                outcome.devices if isinstance(outcome, ClaimAnswered) else ()
            )
            # The core logs the outcome (claim-prepared, claim-refused); this is the call's trace.
            _log.debug("dra-prepare", extra=_fields(claim, error=error, devices=len(devices)))
            replies[claim.uid] = pb.NodePrepareResourceResponse(
                devices=[_device(pb, device) for device in devices] if not error else [],
                error=error,
            )
        await stream.send_message(pb.NodePrepareResourcesResponse(claims=replies))

    async def node_unprepare_resources(
        self, pb: ModuleType, stream: grpclib.server.Stream[Any, Any]
    ) -> None:
        claims = _claims(await read_request(stream))
        replies = {}
        for claim, problem in claims:
            error = problem
            if error is None:
                try:
                    error = await self._preparer.unprepare(claim)
                except Exception as exc:
                    _log.exception("dra-unprepare-crashed", extra=_fields(claim))
                    error = f"internal error unpreparing claim {_name(claim)}: {exc}"
            _log.debug("dra-unprepare", extra=_fields(claim, error=error or ""))
            replies[claim.uid] = pb.NodeUnprepareResourceResponse(error=error or "")
        await stream.send_message(pb.NodeUnprepareResourcesResponse(claims=replies))

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        unary = Cardinality.UNARY_UNARY
        mapping = {}
        for service, pb in SERVICES.items():
            mapping[f"/{service}/NodePrepareResources"] = grpclib.const.Handler(
                functools.partial(self.node_prepare_resources, pb),
                unary,
                pb.NodePrepareResourcesRequest,
                pb.NodePrepareResourcesResponse,
            )
            mapping[f"/{service}/NodeUnprepareResources"] = grpclib.const.Handler(
                functools.partial(self.node_unprepare_resources, pb),
                unary,
                pb.NodeUnprepareResourcesRequest,
                pb.NodeUnprepareResourcesResponse,
            )
        return mapping


def _claims(request: Any) -> list[tuple[ClaimRef, str | None]]:
    """Each claim with what is wrong with it (None: nothing), or the whole call refused.

    A claim lacking its namespace or name still has a UID to be answered
    under, so that is its own error; a claim without a UID, or a UID listed
    twice, cannot be told apart in the reply's map, so the call is refused.
    """
    claims = [ClaimRef(c.namespace, c.uid, c.name) for c in request.claims]
    problems = []
    first: dict[str, int] = {}
    for index, claim in enumerate(claims):
        if not claim.uid:
            problems.append(f"claims[{index}] ({_name(claim)}) has no uid")
        elif claim.uid in first:
            problems.append(
                f"claims[{first[claim.uid]}] and claims[{index}] have the same uid {claim.uid!r}"
            )
        else:
            first[claim.uid] = index
    if problems:
        raise GRPCError(Status.INVALID_ARGUMENT, "; ".join(problems))
    return [(claim, _missing(claim)) for claim in claims]


def _missing(claim: ClaimRef) -> str | None:
    absent = [field for field in ("namespace", "name") if not getattr(claim, field)]
    if not absent:
        return None
    return f"claim {claim.uid} has no {' and no '.join(absent)}"


def _name(claim: ClaimRef) -> str:
    return f"{claim.namespace or '<no namespace>'}/{claim.name or '<no name>'}"


def _device(pb: ModuleType, device: PreparedDevice) -> Any:
    return pb.Device(
        request_names=list(device.request_names),
        pool_name=device.pool_name,
        device_name=device.device_name,
        cdi_device_ids=list(device.cdi_device_ids),
    )


def _fields(claim: ClaimRef, **more: object) -> dict[str, Any]:
    return {
        "dp_fields": {"claim": _name(claim), "uid": claim.uid, **more},
    }
