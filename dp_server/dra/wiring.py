"""The DRA front end in the running server: claims, their files, the checkpoint, the slices.

`DraRuntime` is the front end's `FrontendRuntime`: it makes the core's
`DraFrontend` with the node's ledger, and is the `ClaimPreparer` behind the
DRA sockets (`DraEndpoints`).
A Prepare asks the same `Node` the device-plugin front end feeds, on the
same loop, for each claim; the node answers a claim it prepared already, and
asks for any other to be read (`ReadClaim`). The claims asked for are read
from the API server at once (`claims`: its UID checked, its allocation
results taken), and each read is handed back, in the kubelet's order, as
the input that continues its call (`ClaimRead`, or `ClaimUnreadable` with
why); the node judges them against its one ledger. A call that ends while
its claims are read (the kubelet cancels it) still ends the node's waits.
The effects the node answers with are carried out by the handlers this
registers on the loop: a prepared claim's CDI spec and metadata files are
written (and the core told, `ClaimFilesWritten`), an unprepared one's removed
(`ClaimFilesRemoved`), the checkpoint kept (`checkpoint`), and the pool's
content handed to the `SlicePublisher`, whose task keeps the API server's
ResourceSlices equal to it and feeds back what the server kept of them
(`DraFeaturesObserved`: a cluster without partitionable devices or device
taints drops their fields). The core answers each claim once its files are
in place (`ClaimAnswered`), and the loop hands that answer to the Prepare
that waits for it. The API server being away never holds up anything else:
the publisher retries on its own, and only a Prepare of a claim not prepared
yet waits for (and fails on) the claim read.

It is also the `HealthWatcher` behind the kubelet's health stream: each
stream the kubelet opens is a `HealthWatchStarted` to the node, and each
`PublishHealth` the node answers is put in that stream's slot as a
`HealthReport`, its time on the wall clock, which the stream's version
(v1 or v1alpha1) turns into its message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dp_core import (
    DRA,
    AllocatedDevice,
    ClaimAnswered,
    ClaimFilesRemoved,
    ClaimFilesWritten,
    ClaimPrepared,
    ClaimPrepareRequested,
    ClaimRead,
    ClaimRef,
    ClaimRefused,
    ClaimsChanged,
    ClaimsRecalled,
    ClaimUnprepared,
    ClaimUnprepareRequested,
    ClaimUnreadable,
    Config,
    DraFrontend,
    HealthWatchEnded,
    HealthWatchStarted,
    Ledger,
    MetricFamily,
    PoolChanged,
    PublishHealth,
    ReadClaim,
)
from dp_core.cdi import SPEC_PREFIX
from dp_server.cdi.claim_files import ClaimFiles
from dp_server.config.settings import Settings, SettingsError
from dp_server.dra.api import KubeApi, describe
from dp_server.dra.claim_events import ClaimEvents
from dp_server.dra.claims import (
    BadClaim,
    extended_owner,
    extended_resources,
    read_allocation,
)
from dp_server.dra.claims_store import ClaimsStore
from dp_server.dra.endpoints import DraEndpoints
from dp_server.dra.health import HealthReport
from dp_server.dra.metrics import wiring_families
from dp_server.dra.preparer import PrepareOutcome, refused
from dp_server.dra.slices import SlicePublisher
from dp_server.loop import Loop, Readiness, Services, Spawn, Timer
from dp_server.rpc import StreamSlot

__all__ = ["DraRuntime"]

_log = logging.getLogger("dp.dra")

# A claim as read: its allocation results, its pod-claim-name, and for a claim
# made for extended resources, (request, extended resource name) pairs.
_Read = tuple[tuple[AllocatedDevice, ...], str | None, tuple[tuple[str, str], ...]]

METADATA_DIR = "dra-device-metadata"
_SHUTTING_DOWN = "the DRA driver is shutting down"


def _answered(
    outcome: PrepareOutcome | ReadClaim | Exception,
) -> PrepareOutcome | Exception:
    if isinstance(outcome, ReadClaim):  # pragma: no cover - every ask is continued or ended
        return RuntimeError(f"claim {outcome.claim.describe()}: its read was never handed back")
    return outcome


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
    """The DRA front end of one `Runtime`, with the config's `dra`: the driver's
    sockets, API calls and files (`FrontendRuntime`)."""

    def __init__(self, settings: Settings, config: Config, ledger: Ledger) -> None:
        if config.dra is None:
            raise SettingsError("the DRA front end needs the config's dra section")
        driver = config.dra.driver_name
        if not settings.node_name:
            raise SettingsError(
                "the config's dra section turns the DRA front end on, which needs this "
                "node's name: --node-name or the NODE_NAME environment variable"
            )
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
        self.frontend = DraFrontend(
            ledger, settings.node_name, health_resend=settings.timing.health_resend
        )
        self.files = ClaimFiles(
            driver, Path(settings.cdi_spec_dir), Path(settings.plugins_dir) / driver / METADATA_DIR
        )
        self.checkpoint = ClaimsStore(settings.state_dir)
        self.api = connect_api(settings)
        self._watch_period = settings.slice_watch_period
        # An Event on each claim dp refuses: its pod stays bound while the kubelet retries.
        self.events = ClaimEvents(self.api, driver, settings.node_name)
        self._spawn: Spawn | None = None
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
        self._health: dict[int, StreamSlot[Any]] = {}  # health stream -> its next message
        self._closing = False

    # -- as a front end's wiring (FrontendRuntime) ----------------------------------

    @property
    def name(self) -> str:
        return DRA

    @property
    def core(self) -> DraFrontend:
        return self.frontend

    def attach(self, loop: Loop, services: Services) -> None:
        self._loop = loop
        self._services = services
        # What a slice write shows of the cluster's DRA features goes to the
        # core, which publishes the pool the cluster can keep (DraFeaturesObserved).
        self.publisher = SlicePublisher(
            self.api, watch_period=self._watch_period, on_features=loop.feed
        )
        loop.on(ClaimPrepared, self._write_files)
        loop.on(ClaimUnprepared, self._remove_files)
        loop.on(ClaimsChanged, self._keep_claims)
        loop.on(PoolChanged, self._publish_pool)
        loop.on(PublishHealth, self._publish_health)
        loop.answers(ReadClaim, ClaimRefused, ClaimAnswered)

    # -- life cycle --------------------------------------------------------------------

    def recall(self) -> None:
        """Hold again what the checkpoint says was prepared; before the sockets serve."""
        recalled = self.checkpoint.recall()
        if recalled:
            self._loop.feed(ClaimsRecalled(recalled))

    def timers(self) -> Sequence[Timer]:
        return ()

    def watched(self) -> Sequence[Path]:
        """The sockets' directories: the plugin watcher registers a new socket."""
        endpoints = self.endpoints
        return tuple(
            p.parent.absolute()
            for p in (endpoints.registration_socket_path, endpoints.dra_socket_path)
        )

    async def start(self) -> None:
        try:
            await self.endpoints.start()
        except OSError as error:
            raise SettingsError(f"the DRA sockets: {error}") from error
        self._spawn = spawn = self._services.spawn
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

    async def closed(self) -> None:
        await self.api.close()

    # -- HealthWatcher -----------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def watch_health(self) -> AsyncIterator[AsyncIterator[Any]]:
        """A health stream for as long as the kubelet keeps it."""
        stream = next(self._loop.ids)
        slot: StreamSlot[Any] = StreamSlot()
        self._health[stream] = slot
        if self._closing:
            slot.end(_SHUTTING_DOWN)
        try:
            self._loop.feed(HealthWatchStarted(stream, self._loop.now()))
            yield slot.updates()
        finally:
            del self._health[stream]
            self._loop.feed(HealthWatchEnded(stream))

    # -- ClaimPreparer -----------------------------------------------------------------

    async def prepare(self, claims: Sequence[ClaimRef]) -> list[PrepareOutcome | Exception]:
        """Each claim is asked for in the kubelet's order; those the core wants
        read are read from the API server at once, and each read is handed
        back to the core in that order again, continuing its call."""
        outcomes = [self._ask(claim) for claim in claims]
        asked = {index: ask for index, ask in enumerate(outcomes) if isinstance(ask, ReadClaim)}
        waiting = dict(asked)  # the core waits for each of these until it is fed its read
        try:
            reads = await asyncio.gather(
                *(self._read_claim(ask.claim) for ask in asked.values()), return_exceptions=True
            )
            for (index, ask), read in zip(asked.items(), reads, strict=True):
                if not isinstance(read, Exception) and isinstance(read, BaseException):
                    raise read  # cancelled: the call is over
                if isinstance(read, Exception) and not isinstance(read, BadClaim):
                    outcomes[index] = read  # a bug: the service says so in the claim's entry
                    continue
                del waiting[index]
                outcomes[index] = self._continue(ask, read)
        finally:
            # Whatever ends the call early (cancelled, a bug in a read) ends the
            # core's waits too: nothing else would ever feed them.
            for index, ask in waiting.items():
                failed = outcomes[index]
                why = (
                    f"internal error: {failed}"
                    if isinstance(failed, Exception)
                    else "the call was cancelled while it was read"
                )
                problem = f"cannot read claim {ask.claim.describe()}: {why}"
                self._loop.feed(ClaimUnreadable(ask.call, problem))
        return [_answered(outcome) for outcome in outcomes]

    def _ask(self, claim: ClaimRef) -> PrepareOutcome | ReadClaim | Exception:
        """The core's answer to the claim's Prepare, or its ask for the claim's read."""
        try:
            answer = self._loop.call(
                lambda call: ClaimPrepareRequested(call, claim, self._loop.now())
            )
        except Exception as error:  # noqa: BLE001 - one claim's bug is its own
            return error
        return answer if isinstance(answer, ReadClaim) else self._outcome(claim, answer)

    def _continue(self, ask: ReadClaim, read: _Read | BadClaim) -> PrepareOutcome | Exception:
        """Hand the claim's read to the core, continuing the call that asked for it."""
        if isinstance(read, BadClaim):
            event: ClaimRead | ClaimUnreadable = ClaimUnreadable(ask.call, str(read))
        else:
            results, pod_claim_name, extended = read
            event = ClaimRead(ask.call, results, self._loop.now(), pod_claim_name, extended)
        try:
            answer = self._loop.resume(ask.call, event)
        except Exception as error:  # noqa: BLE001 - one claim's bug is its own
            return error
        outcome = self._outcome(ask.claim, answer)
        if isinstance(outcome, ClaimRefused) and isinstance(event, ClaimRead):
            # Only a claim that was read gets an Event: one that could not be
            # read is often gone, or made again under another UID.
            self._record(ask.claim, outcome)
        return outcome

    def _outcome(self, claim: ClaimRef, answer: object) -> PrepareOutcome:
        if not isinstance(answer, ClaimRefused | ClaimAnswered):  # pragma: no cover - it answers
            return refused(claim, f"claim {claim.describe()}: the core gave no answer", "NoAnswer")
        return answer

    def _record(self, claim: ClaimRef, refused: ClaimRefused) -> None:
        posting = self.events.refusal(claim, refused.reason, refused.error)
        if posting is None:
            return
        if self._spawn is None:
            posting.close()  # not started: no loop of ours to post it on
            return
        self._spawn(posting)

    async def unprepare(self, claim: ClaimRef) -> str | None:
        answer = self._loop.call(
            lambda call: ClaimUnprepareRequested(call, claim, self._loop.now())
        )
        return answer.error or None if isinstance(answer, ClaimAnswered) else None

    async def _read_claim(self, claim: ClaimRef) -> _Read:
        try:
            obj = await self.api.get_claim(claim.namespace, claim.name)
        except Exception as error:  # noqa: BLE001 - any failure is this claim's alone
            raise BadClaim(f"cannot read claim {claim.describe()}: {describe(error)}") from None
        results, pod_claim_name = read_allocation(claim, obj, self.driver)
        owner = extended_owner(claim, obj)
        if owner is None:
            return results, pod_claim_name, ()
        try:
            pod = await self.api.get_pod(claim.namespace, owner[0])
        except Exception as error:  # noqa: BLE001 - any failure is this claim's alone
            raise BadClaim(
                f"cannot read pod {claim.namespace}/{owner[0]}, owner of claim {claim.describe()}: "
                f"{describe(error)}"
            ) from None
        return results, pod_claim_name, extended_resources(claim, pod, owner)

    # -- effects (registered on the loop) ----------------------------------------------

    def _write_files(self, effect: ClaimPrepared) -> None:
        problem = ""
        try:
            self.files.write(effect.prepared)
        except OSError as error:
            problem = self._file_problem(effect.prepared.claim, "write", error)
        self._loop.feed(ClaimFilesWritten(effect.call, problem))

    def _remove_files(self, effect: ClaimUnprepared) -> None:
        problem = ""
        try:
            self.files.remove(effect.claim)
        except OSError as error:
            problem = self._file_problem(effect.claim, "remove", error)
        self._loop.feed(ClaimFilesRemoved(effect.call, problem))

    def _keep_claims(self, effect: ClaimsChanged) -> None:
        self.checkpoint.keep(effect.prepared)

    def _publish_pool(self, effect: PoolChanged) -> None:
        self.publisher.publish(effect.content)

    def _publish_health(self, effect: PublishHealth) -> None:
        slot = self._health.get(effect.stream)
        if slot is not None:
            # The core's clock is monotonic; the kubelet wants Unix seconds.
            unix_at = int(time.time() - (self._loop.now() - effect.at))
            slot.publish(HealthReport(effect, unix_at))

    def _file_problem(self, claim: ClaimRef, what: str, error: OSError) -> str:
        self.file_failures += 1
        reason = error.strerror or str(error)
        _log.error(
            "claim-files-not-written" if what == "write" else "claim-files-not-removed",
            extra={"dp_fields": {"claim": claim.describe(), "uid": claim.uid, "reason": reason}},
        )
        return reason

    # -- what monitoring reads ---------------------------------------------------------

    def registration(self) -> tuple[bool, str] | None:
        """What the kubelet last said of our registration: (registered, error), or None."""
        status = self.endpoints.registration_status
        return None if status is None else (status.registered, status.error)

    @property
    def ready(self) -> bool:
        return self.endpoints.ready

    def readiness(self) -> Readiness:
        if self.ready:
            return Readiness(True, f"DRA driver {self.driver}")
        said = self.registration()
        why = (
            "the kubelet has not said it registered it"
            if said is None
            else (
                f"the kubelet said: {said[1]}" if not said[0] else "its sockets are not listening"
            )
        )
        return Readiness(False, f"DRA driver {self.driver} not registered: {why}")

    def remarks(self) -> Sequence[str]:
        return ()

    def serving(self) -> Mapping[str, object]:
        return {"dra_driver": self.driver}

    def families(self) -> Iterable[MetricFamily]:
        yield from self.publisher.families()
        yield from self.events.families()
        yield from wiring_families(
            self.driver,
            registered=self.ready,
            health_streams=len(self._health),
            file_failures=self.file_failures,
            checkpoint_failures=self.checkpoint.failures,
        )
