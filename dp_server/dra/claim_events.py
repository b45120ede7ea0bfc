"""Kubernetes Events on the claims the DRA front end refuses to prepare.

A claim the scheduler allocated stays allocated and its pod stays bound when
NodePrepareResources fails: the kubelet retries Prepare (and records
`FailedPrepareDynamicResources` on the pod, with dp's message), until the
holder of the group lets go or someone deletes the pod. So that the claim
says it too (`kubectl describe resourceclaim`), dp records an
`events.k8s.io/v1` Event about it: type Warning, `reason` the refusal's
(`IOMMUGroupHeld`, `DeviceUnhealthy`, ...), `note` dp's message, action
`NodePrepareResources`, reported by the driver on this node. The kubelet
retries every few seconds: one Event per claim and reason every `every`
seconds is enough, and keeps the API server's event store small. Posting
never holds up the answer to the kubelet, and a failure to post is logged
and counted, nothing more.

The claim's `status.devices` conditions were the other place: writing them
takes `update` on `resourceclaims/status` and, from 1.36 (the
`DRAResourceClaimGranularStatusAuthorization` gate, beta), `associated-node:
update` on `resourceclaims/driver`, which only a token bound to the node
passes; an Event takes `create` on `events`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Coroutine, Iterable
from datetime import UTC, datetime
from typing import Any

from lightkube.models.core_v1 import ObjectReference
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.events_v1 import Event

from dp_core import MetricFamily, Sample
from dp_core.dra import ClaimRef
from dp_server.dra.api import KubeApi

__all__ = ["ClaimEvents"]

_log = logging.getLogger("dp.dra")

_ACTION = "NodePrepareResources"
_FIELD_MAX = 128  # reportingController, reportingInstance, action, reason
_NOTE_MAX = 1024  # bytes


class ClaimEvents:
    """Records an Event on a refused claim, at most once per claim and reason every `every` s."""

    def __init__(
        self,
        api: KubeApi,
        driver: str,
        node: str,
        *,
        every: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api = api
        self.driver = driver
        self.instance = f"{driver}-{node}"[:_FIELD_MAX]
        self.every = every
        self._clock = clock
        self._last: dict[tuple[str, str], float] = {}  # (claim UID, reason) -> when
        self.posted = 0
        self.failed = 0
        self.refused: dict[str, int] = {}  # reason -> claims refused

    def refusal(
        self, claim: ClaimRef, reason: str, message: str
    ) -> Coroutine[Any, Any, None] | None:
        """The posting of an Event for this refusal, to run as a task; None when one
        was posted for this claim and reason within `every` seconds."""
        self.refused[reason] = self.refused.get(reason, 0) + 1
        now = self._clock()
        self._last = {k: t for k, t in self._last.items() if now - t < self.every}
        if (claim.uid, reason) in self._last:
            return None
        self._last[(claim.uid, reason)] = now
        return self._post(self._event(claim, reason, message))

    def _event(self, claim: ClaimRef, reason: str, message: str) -> Event:
        stamp = datetime.now(UTC)
        # metav1.MicroTime is read with exactly six fractional digits, which
        # the encoder leaves out when they are all zero.
        stamp = stamp.replace(microsecond=stamp.microsecond or 1)
        note = message.encode()[:_NOTE_MAX].decode(errors="ignore")
        return Event(
            apiVersion="events.k8s.io/v1",
            kind="Event",
            metadata=ObjectMeta(
                # client-go's recorder names an Event after its object and a
                # timestamp; the random part keeps two nodes' apart.
                name=f"{claim.name}.{time.time_ns():x}{os.urandom(2).hex()}"[:253],
                namespace=claim.namespace,
            ),
            eventTime=stamp,
            type="Warning",
            reason=reason[:_FIELD_MAX],
            action=_ACTION,
            note=note,
            reportingController=self.driver[:_FIELD_MAX],
            reportingInstance=self.instance,
            regarding=ObjectReference(
                apiVersion="resource.k8s.io/v1",
                kind="ResourceClaim",
                name=claim.name,
                namespace=claim.namespace,
                uid=claim.uid,
            ),
        )

    async def _post(self, event: Event) -> None:
        try:
            await self.api.create_event(event)
        except Exception as error:  # noqa: BLE001 - an Event is best-effort
            self.failed += 1
            assert event.regarding is not None
            _log.warning(
                "claim-event-failed",
                extra={
                    "dp_fields": {
                        "claim": f"{event.regarding.namespace}/{event.regarding.name}",
                        "reason": event.reason,
                        "error": f"{type(error).__name__}: {error}",
                    }
                },
            )
            return
        self.posted += 1

    def families(self) -> Iterable[MetricFamily]:
        yield MetricFamily(
            "counter",
            "dp_dra_claims_refused_total",
            "NodePrepareResources answers that refused a claim, by reason.",
            tuple(Sample((("reason", r),), n) for r, n in sorted(self.refused.items())),
        )
        yield MetricFamily(
            "counter",
            "dp_dra_claim_events_total",
            "Events recorded on refused claims (posted), and the ones the API server "
            "did not take (failed).",
            (
                Sample((("result", "posted"),), self.posted),
                Sample((("result", "failed"),), self.failed),
            ),
        )
