"""The DRA front end in the running server: claims, their files, the checkpoint, the slices.

`DraRuntime` is the `ClaimPreparer` behind the DRA sockets (`DraEndpoints`).
A Prepare reads the claim from the API server, checks its UID, and hands its
allocation results to the same `Node` the device-plugin front end feeds, on
the same loop; the node judges them against its one ledger. What the node
answers is carried out by the handlers here, which the `EffectRunner` calls
one per kind of effect: a prepared claim's CDI spec and metadata files are
written, an unprepared one's removed, the checkpoint kept (`claims_file`),
and the pool's content handed to the `SlicePublisher`, whose task keeps the
API server's ResourceSlices equal to it and feeds back what the server kept
of them (`DraFeaturesObserved`: a cluster without partitionable devices or
device taints drops their fields). The API server being away never
holds up anything else: the publisher retries on its own, and only a
Prepare of a claim not prepared yet waits for (and fails on) the claim read.

It is also the `HealthWatcher` behind the kubelet's health stream: each
stream the kubelet opens is a `HealthWatchStarted` to the node, and each
`PublishHealth` the node answers is put in that stream's slot as the
kubelet's message, its time on the wall clock.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

from lightkube.resources.resource_v1 import ResourceClaim

from dp_core import (
    ClaimPrepared,
    ClaimPrepareRequested,
    ClaimRefused,
    ClaimsChanged,
    ClaimsRecalled,
    ClaimUnprepared,
    ClaimUnprepareRequested,
    Effect,
    HealthWatchEnded,
    HealthWatchStarted,
    Input,
    MetricFamily,
    Node,
    PoolChanged,
    PublishHealth,
    Sample,
)
from dp_core.cdi import SPEC_PREFIX
from dp_core.claims import ClaimRef
from dp_core.dra_inputs import AllocatedDevice
from dp_core.dra_metadata import prepared_devices
from dp_server.cdi.claim_files import ClaimFiles
from dp_server.dra import (
    DraEndpoints,
    Prepared,
    PrepareFailed,
    PrepareOutcome,
    health_message,
)
from dp_server.dra.api import KubeApi
from dp_server.dra.claim_events import ClaimEvents
from dp_server.dra.slices import SlicePublisher
from dp_server.rpc import StreamSlot
from dp_server.runtime.claims_file import ClaimsStore
from dp_server.runtime.settings import Settings, SettingsError

__all__ = ["POD_CLAIM_NAME", "DraRuntime"]

_log = logging.getLogger("dp.dra")

# Set on a claim made from a pod's template (k8s.io/api/resource/v1 annotation).
POD_CLAIM_NAME = "resource.kubernetes.io/pod-claim-name"
METADATA_DIR = "dra-device-metadata"
_SHUTTING_DOWN = "the DRA driver is shutting down"


class _BadClaim(Exception):
    """The claim as read cannot be prepared; the message says why."""


def connect_api(settings: Settings) -> KubeApi:
    """The API client the flags name; SettingsError when there is none to be had."""
    try:
        if settings.kube_api_server is not None:
            return KubeApi.connect(server=settings.kube_api_server)
        kubeconfig = Path(settings.kubeconfig) if settings.kubeconfig else None
        return KubeApi.connect(kubeconfig=kubeconfig)
    except Exception as error:  # noqa: BLE001 - lightkube's config errors have no common base
        where = (
            f"--kubeconfig {settings.kubeconfig}"
            if settings.kubeconfig
            else ("no --kubeconfig, and the pod's service account")
        )
        raise SettingsError(f"the DRA front end needs the API server: {where}: {error}") from None


class DraRuntime:
    """The DRA front end of one `Runtime`: `driver`'s sockets, API calls and files."""

    def __init__(
        self,
        settings: Settings,
        driver: str,
        node: Node,
        *,
        feed: Callable[[Input], list[Effect]],
        now: Callable[[], float],
        ids: itertools.count[int],
    ) -> None:
        if settings.cdi_spec_dir is None:
            raise SettingsError("the DRA front end needs --cdi-spec-dir (default /var/run/cdi)")
        if settings.state_dir is None:
            raise SettingsError(
                "the DRA front end needs --state-dir: prepared claims are kept there "
                "across restarts (default /run/dp)"
            )
        if driver.startswith(SPEC_PREFIX):
            # The device-plugin front end's spec directory owns every dp-*.json there.
            raise SettingsError(
                f"dra.driverName {driver!r}: a driver name starting with {SPEC_PREFIX!r} would "
                "name claim specs like the device-plugin front end's, which it removes"
            )
        self.driver = driver
        self._node = node
        self._feed = feed
        self._now = now
        self._ids = ids
        self.files = ClaimFiles(
            driver, Path(settings.cdi_spec_dir), Path(settings.plugins_dir) / driver / METADATA_DIR
        )
        self.checkpoint = ClaimsStore(settings.state_dir)
        self.api = connect_api(settings)
        # What a slice write shows of the cluster's DRA features goes to the
        # core, which publishes the pool the cluster can keep (DraFeaturesObserved).
        self.publisher = SlicePublisher(
            self.api, watch_period=settings.slice_watch_period, on_features=feed
        )
        # An Event on each claim dp refuses: its pod stays bound while the kubelet retries.
        self.events = ClaimEvents(self.api, driver, node.dra.node_name)
        self._spawn: Callable[..., object] | None = None
        try:
            self.endpoints = DraEndpoints(
                driver,
                Path(settings.plugins_registry_dir),
                Path(settings.plugins_dir),
                self,
                health=self,
            )
        except ValueError as error:
            raise SettingsError(f"dra.driverName: {error}") from None
        self.file_failures = 0  # claims whose files could not be written or removed
        # Call -> why its claim's files could not be written or removed ("" when they were).
        self._files_done: dict[int, str] = {}
        self._health: dict[int, StreamSlot[Any]] = {}  # health stream -> its next message
        self._closing = False

    # -- life cycle --------------------------------------------------------------------

    def recall(self) -> None:
        """Hold again what the checkpoint says was prepared; before the sockets serve."""
        recalled = self.checkpoint.recall()
        if recalled:
            self._feed(ClaimsRecalled(recalled))

    async def start(self, spawn: Callable[..., object]) -> None:
        try:
            await self.endpoints.start()
        except OSError as error:
            raise SettingsError(f"the DRA sockets: {error}") from error
        self._spawn = spawn
        spawn(self.publisher.run(), essential="dra-slice-publisher")

    async def restore(self) -> None:
        """Listen again on a DRA socket whose file was deleted (the plugin watcher
        registers the new one)."""
        try:
            await self.endpoints.restore()
        except Exception:  # noqa: BLE001 - the next check tries again
            _log.exception("dra-socket-check-failed")

    async def close(self) -> None:
        """Stop listening; the claim files and the checkpoint stay for the next run."""
        self._closing = True
        for slot in self._health.values():
            slot.end(_SHUTTING_DOWN)
        await self.endpoints.close(timeout=2.0)

    async def close_api(self) -> None:
        await self.api.close()

    # -- HealthWatcher -----------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def watch_health(self) -> AsyncIterator[AsyncIterator[Any]]:
        """A health stream for as long as the kubelet keeps it."""
        stream = next(self._ids)
        slot: StreamSlot[Any] = StreamSlot()
        self._health[stream] = slot
        if self._closing:
            slot.end(_SHUTTING_DOWN)
        try:
            self._feed(HealthWatchStarted(stream, self._now()))
            yield slot.updates()
        finally:
            del self._health[stream]
            self._feed(HealthWatchEnded(stream))

    # -- ClaimPreparer -----------------------------------------------------------------

    async def prepare(self, claim: ClaimRef) -> PrepareOutcome:
        known = any(p.claim.uid == claim.uid for p in self._node.dra.prepared())
        results: tuple[AllocatedDevice, ...] = ()
        pod_claim_name = None
        if not known:
            # A claim prepared already is answered from the ledger, API server or not.
            try:
                results, pod_claim_name = await self._read_claim(claim)
            except _BadClaim as error:
                _log.warning(
                    "claim-refused",
                    extra={"dp_fields": {"claim": _show(claim), "reason": str(error)}},
                )
                return PrepareFailed(str(error))
        call = next(self._ids)
        effects = self._feed(
            ClaimPrepareRequested(call, claim, results, self._now(), pod_claim_name)
        )
        for effect in effects:
            if isinstance(effect, ClaimRefused) and effect.call == call:
                self._record(claim, effect)
                return PrepareFailed(effect.error)
            if isinstance(effect, ClaimPrepared) and effect.call == call:
                problem = self._files_done.pop(call, "")
                if problem:
                    if not known:
                        # Nothing may stay held for a claim the kubelet is told failed.
                        release = next(self._ids)
                        self._feed(ClaimUnprepareRequested(release, claim, self._now()))
                        self._files_done.pop(release, None)
                    return PrepareFailed(
                        f"claim {_show(claim)}: its CDI files could not be written: {problem}"
                    )
                return Prepared(prepared_devices(self.driver, effect.prepared))
        return PrepareFailed(f"claim {_show(claim)}: the core gave no answer")  # pragma: no cover

    def _record(self, claim: ClaimRef, refused: ClaimRefused) -> None:
        posting = self.events.refusal(claim, refused.reason, refused.error)
        if posting is None:
            return
        if self._spawn is None:
            posting.close()  # not started: no loop of ours to post it on
            return
        self._spawn(posting)

    async def unprepare(self, claim: ClaimRef) -> str | None:
        call = next(self._ids)
        self._feed(ClaimUnprepareRequested(call, claim, self._now()))
        problem = self._files_done.pop(call, "")
        if problem:
            # The group is free already; the kubelet asks again, and the files go then.
            return f"claim {_show(claim)}: its CDI files could not be removed: {problem}"
        return None

    async def _read_claim(self, claim: ClaimRef) -> tuple[tuple[AllocatedDevice, ...], str | None]:
        try:
            obj = await self.api.get_claim(claim.namespace, claim.name)
        except Exception as error:  # noqa: BLE001 - any failure is this claim's alone
            raise _BadClaim(f"cannot read claim {_show(claim)}: {_describe(error)}") from None
        return _allocation(claim, obj, self.driver)

    # -- effects (EffectRunner) --------------------------------------------------------

    def claim_prepared(self, effect: ClaimPrepared) -> None:
        try:
            self.files.write(effect.prepared)
        except OSError as error:
            self._file_problem(effect.call, effect.prepared.claim, "write", error)
            return
        self._files_done[effect.call] = ""

    def claim_unprepared(self, effect: ClaimUnprepared) -> None:
        try:
            self.files.remove(effect.claim)
        except OSError as error:
            self._file_problem(effect.call, effect.claim, "remove", error)
            return
        self._files_done[effect.call] = ""

    def claims_changed(self, effect: ClaimsChanged) -> None:
        self.checkpoint.keep(effect.prepared)

    def pool_changed(self, effect: PoolChanged) -> None:
        self.publisher.publish(effect.content)

    def publish_health(self, effect: PublishHealth) -> None:
        slot = self._health.get(effect.stream)
        if slot is not None:
            # The core's clock is monotonic; the kubelet wants Unix seconds.
            unix_at = int(time.time() - (self._now() - effect.at))
            slot.publish(health_message(effect, unix_at))

    def _file_problem(self, call: int, claim: ClaimRef, what: str, error: OSError) -> None:
        self.file_failures += 1
        reason = error.strerror or str(error)
        self._files_done[call] = reason
        _log.error(
            "claim-files-not-written" if what == "write" else "claim-files-not-removed",
            extra={"dp_fields": {"claim": _show(claim), "uid": claim.uid, "reason": reason}},
        )

    # -- what monitoring reads ---------------------------------------------------------

    def registration(self) -> tuple[bool, str] | None:
        """What the kubelet last said of our registration: (registered, error), or None."""
        status = self.endpoints.registration_status
        return None if status is None else (status.registered, status.error)

    @property
    def ready(self) -> bool:
        return self.endpoints.ready

    def families(self) -> Iterable[MetricFamily]:
        yield from self.publisher.families()
        yield from self.events.families()
        yield MetricFamily(
            "gauge",
            "dp_dra_registered",
            "1 while the kubelet says it registered the DRA driver on our socket, else 0.",
            (Sample((("driver", self.driver),), 1 if self.ready else 0),),
        )
        yield MetricFamily(
            "gauge",
            "dp_dra_health_streams",
            "Health streams (NodeWatchResources) the kubelet holds open on the DRA socket.",
            (Sample((), len(self._health)),),
        )
        yield MetricFamily(
            "counter",
            "dp_dra_claim_file_failures_total",
            "Claims whose CDI spec or metadata files could not be written or removed.",
            (Sample((), self.file_failures),),
        )
        yield MetricFamily(
            "counter",
            "dp_dra_checkpoint_failures_total",
            "Writes of the prepared claims' checkpoint (claims.json) that failed.",
            (Sample((), self.checkpoint.failures),),
        )


def _allocation(
    claim: ClaimRef, obj: ResourceClaim, driver: str
) -> tuple[tuple[AllocatedDevice, ...], str | None]:
    """The claim's allocation results and pod-claim-name, after checking its UID."""
    metadata = obj.metadata
    uid = metadata.uid if metadata is not None else None
    if uid != claim.uid:
        raise _BadClaim(
            f"claim {_show(claim)} has UID {uid}, not {claim.uid}: "
            "it was deleted and made again since the kubelet asked"
        )
    status = obj.status
    allocation = status.allocation if status is not None else None
    devices = allocation.devices if allocation is not None else None
    if devices is None or not devices.results:
        raise _BadClaim(f"claim {_show(claim)} has no status.allocation.devices.results")
    results = []
    for index, result in enumerate(devices.results):
        fields = (result.request, result.driver, result.pool, result.device)
        if not all(isinstance(value, str) and value for value in fields):
            raise _BadClaim(
                f"claim {_show(claim)}: status.allocation.devices.results[{index}] lacks "
                "request, driver, pool or device"
            )
        results.append(AllocatedDevice(*fields))
    if not any(result.driver == driver for result in results):
        raise _BadClaim(f"claim {_show(claim)} has no device of driver {driver}")
    annotations = (metadata.annotations if metadata is not None else None) or {}
    return tuple(results), annotations.get(POD_CLAIM_NAME) or None


def _show(claim: ClaimRef) -> str:
    return f"{claim.namespace}/{claim.name} (UID {claim.uid})"


def _describe(error: BaseException) -> str:
    from dp_server.dra.api import ApiError

    if isinstance(error, ApiError):
        return f"{error.status.code} {error.status.reason}: {error.status.message}"
    return f"{type(error).__name__}: {error}"
