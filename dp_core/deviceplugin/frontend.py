"""The device-plugin front end: the kubelet's device-plugin API for every
resource of the inventory labelled `device-plugin`.

It holds what that API needs: registration and connection attribution
(`Registrar`), each resource's list (`DeviceLists`), the ListAndWatch
streams (`Watches`), the answers to the kubelet's calls (`calls`), its holds
on the ledger (`AllocationBook`) and the PodResources asks while it has any
(`HeldPolls`), whether PodResources can be trusted yet (`KubeletSync`), and,
with `cdi`, a CDI spec per resource (`CdiKeeper`). What its handlers change
in the ledger they return (`Outcome.held`); the node tells every front end.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

from ..cdi.resources import CdiKeeper
from ..cdi.spec import CdiSpecsChanged, CdiSpecsWritten
from ..config.config import DEVICE_PLUGIN, FrontendName
from ..errors import UsageError
from ..frontend import Clock, Handler, Outcome, World
from ..inventory.advertised import AdvertisedDevice
from ..inventory.resources import Inventory
from ..ledger import Ledger
from ..log import Log
from ..metric import MetricFamily
from ..timing import Timing
from . import calls
from .allocations import AllocationBook
from .answers import Answer, PluginOptions, PreStartAnswer
from .effects import (
    AttributeConnection,
    DevicePluginEffect,
    EndStream,
    Publish,
    RefreshAllocations,
    Register,
)
from .endpoints import NAME_MAX, check_endpoint_room, endpoint_name
from .inputs import (
    AllocateRequested,
    AllocationsObserved,
    ConnectionClosed,
    ConnectionOpened,
    KubeletCheckpointObserved,
    KubeletStarted,
    KubeletStopped,
    OptionsRequested,
    PreferredAllocationRequested,
    PreStartRequested,
    RegistrationFailed,
    RegistrationSucceeded,
    WatchEnded,
    WatchStarted,
)
from .lists import Change, DeviceLists
from .metrics import families
from .notices import Notices
from .polls import HeldPolls
from .registration import Registrar, SocketMode
from .sync import KubeletSync
from .tally import RPC_METHODS, RpcTally
from .view import DevicePluginView
from .watches import Watches

__all__ = ["DevicePluginFrontend", "DevicePluginEffects"]

#: What the device-plugin front end asks of the shell.
DevicePluginEffects = DevicePluginEffect | CdiSpecsChanged | Log
Effects = list[DevicePluginEffects]
Done = Outcome[DevicePluginEffects]

_BINDS_WAIT = (
    "moves to vfio-pci wait until the kubelet's PodResources API can be trusted to say "
    "which IOMMU groups pods hold"
)


class DevicePluginFrontend:
    """One node's device-plugin front end. Not thread-safe; one caller at a time."""

    def __init__(
        self,
        ledger: Ledger,
        timing: Timing | None = None,
        *,
        socket_mode: SocketMode = SocketMode.SINGLE,
        endpoint_prefix: str = "dp",
        endpoint_max_length: int = NAME_MAX,
        cdi: bool = False,
        pod_resources_interval: float = 2.0,
    ) -> None:
        check_endpoint_room(endpoint_prefix, endpoint_max_length)
        timing = timing or Timing()
        self._clock = Clock()  # the node's, at the step being handled
        self.lists = DeviceLists(ledger.held())
        self.socket_mode = socket_mode
        self.endpoint_prefix = endpoint_prefix
        self.endpoint_max_length = endpoint_max_length
        self._waiting_logged = False
        self.registrar = Registrar(
            socket_mode,
            dial_wait=timing.dial_wait,
            held_client_wait=timing.held_client_wait,
            late_dial_wait=timing.late_dial_wait,
            backoff=timing.backoff,
        )
        self.allocations = AllocationBook(ledger, timing.release_grace)
        self.polls = HeldPolls(self.allocations, pod_resources_interval)
        # Whether PodResources can be trusted yet (a kubelet that has just
        # started lists no pods); binds wait for it too: until then a group a
        # running VM uses (dp restarted under it) would look free.
        self.sync = KubeletSync(
            self.allocations,
            ledger,
            timing,
            lambda resource, device_id: self.lists.inventory_ids(resource).get(device_id),
            self.lists.shared_groups,
        )
        # With `cdi`, a CDI spec per resource (`cdi.resources`).
        self.cdi = CdiKeeper() if cdi else None
        self.tally = RpcTally()
        self.watches = Watches()  # the ListAndWatch streams
        self._notices = Notices()  # what the shell hears of its state, by change

    # -- as a front end ----------------------------------------------------------

    @property
    def name(self) -> FrontendName:
        return DEVICE_PLUGIN

    @property
    def holders_known(self) -> bool:
        return self.sync.rules.binds

    def handlers(self) -> Mapping[type, Handler[DevicePluginEffects]]:
        steps: dict[type, Callable[[Any], Done]] = {
            KubeletStarted: self._kubelet_started,
            KubeletCheckpointObserved: self._kubelet_checkpoint_observed,
            KubeletStopped: self._kubelet_stopped,
            RegistrationSucceeded: self._registration_succeeded,
            RegistrationFailed: self._registration_failed,
            ConnectionOpened: self._connection_opened,
            ConnectionClosed: self._connection_closed,
            OptionsRequested: self._options_requested,
            WatchStarted: self._watch_started,
            WatchEnded: self._watch_ended,
            PreferredAllocationRequested: self._preferred_requested,
            AllocateRequested: self._allocate_requested,
            PreStartRequested: self._prestart_requested,
            AllocationsObserved: self._allocations_observed,
            CdiSpecsWritten: self._cdi_written,
        }
        return self._clock.handlers(steps)

    def world_changed(self, world: World) -> Done:
        """Take its resources from the inventory again (after a scan, a config, a move)."""
        self._clock.now = world.now
        self.lists.take(world.inventory)
        effects = self._refresh()
        if self.cdi is not None:
            effects.extend(self.cdi.refresh(self.lists.offered, world.snapshot))
        if not self.sync.rules.holds_unlisted:
            return Outcome(tuple(effects))
        settled = self._settle_sync()  # which devices share a group may have changed
        return Outcome((*effects, *settled.effects), settled.held)

    def holders_changed(self, groups: Collection[int]) -> Sequence[DevicePluginEffects]:
        return self._publish(self.lists.refresh_groups(groups))

    def holders_wanted(self) -> Effects:
        effects: Effects = [RefreshAllocations("binds wait to learn which IOMMU groups pods hold")]
        if not self._waiting_logged:  # once: the wait shows, should PodResources not answer
            self._waiting_logged = True
            effects.append(Log.info("binds-waiting", reason=_BINDS_WAIT))
        return effects

    def due(self, now: float) -> Effects:
        effects: Effects = [*self.sync.poll_due(now), *self.polls.due(now)]
        effects.extend(self._start_due_registrations(now))
        settled, wanted = self.registrar.settled(), self.sync.wants_checkpoint
        return effects + self._notices.changed(settled=settled, checkpoint_wanted=wanted)

    def next_deadline(self) -> float | None:
        deadlines = (self.registrar.next_deadline(), self.sync.next_poll, self.polls.next_at())
        return min((d for d in deadlines if d is not None), default=None)

    def metrics(self) -> Sequence[MetricFamily]:
        return families(self)

    # -- what it exposes ---------------------------------------------------------

    def view(self) -> DevicePluginView:
        """What monitoring reads of it, as a value that does not change under it."""
        phases = sorted(self.registrar.phases().items())
        problem = self.cdi.problem if self.cdi is not None else ""
        return DevicePluginView(phases, self.resource_names(), problem)

    @property
    def offered(self) -> Inventory:
        """Its part of the inventory, as the node last told it (before reservations)."""
        return self.lists.offered

    def advertised(self, resource: str) -> tuple[AdvertisedDevice, ...]:
        """The device list (health included) last published for `resource`."""
        return self.lists.advertised(resource)

    def resource_names(self) -> tuple[str, ...]:
        return tuple(sorted(self.lists.published()))

    def streams(self, resource: str) -> list[int]:
        return self.watches.of(resource)

    def describe(self) -> Inventory:
        """Its part of the inventory with reservations applied, as last published."""
        return self.lists.describe()

    # -- what it publishes ---------------------------------------------------------

    def _settle_sync(self) -> Done:
        """Hold and free the groups the kubelet's sync leaves in doubt (`KubeletSync.settle`)."""
        settled = self.sync.settle(self._clock.now)
        return Outcome(tuple(settled.effects), settled.touched)

    def _refresh(self) -> Effects:
        """Publish every resource whose advertised list changed (after a scan,
        a config or a move), and only those."""
        effects: Effects = []
        for name in self.registrar.track(self.lists.names(), self._clock.now):
            effects.append(Log.info("resource-discovered", resource=name))
        return effects + self._publish(self.lists.refresh())

    def _publish(self, changes: Iterable[Change]) -> Effects:
        published: Effects = [*self.watches.publish(changes)]
        self.tally.published(published)
        return published

    # -- registration and connections -----------------------------------------

    def _options_for(self, resource: str) -> PluginOptions:
        found = self.lists.resource(resource)
        preferred = found is not None and found.device_class.preferred_allocation
        return PluginOptions(pre_start_required=False, get_preferred_allocation_available=preferred)

    def _start_due_registrations(self, now: float) -> Effects:
        effects: Effects = []
        expired = self.registrar.expire(now)
        for name in expired:
            effects.append(
                Log.warning(
                    "registration-unattributed",
                    resource=name,
                    reason="the kubelet did not dial in time after Register",
                )
            )
        per_resource = self.socket_mode is SocketMode.PER_RESOURCE
        for reg in self.registrar.due(now):
            effects.extend(self.watches.end(reg.name, "the resource is registering again"))
            attempt = self.registrar.start(reg)
            endpoint = endpoint_name(
                self.endpoint_prefix,
                reg.name if per_resource else None,
                self.endpoint_max_length,
            )
            effects.append(
                Register(reg.name, endpoint, self._options_for(reg.name), attempt, per_resource)
            )
        return effects

    def _kubelet_started(self, event: KubeletStarted) -> Done:
        self.tally.kubelet_started()
        self.registrar.kubelet_started(event.now)
        self.sync.started(event.checkpoint, event.now)
        effects: Effects = [
            Log.info(
                "kubelet-started",
                resources=len(self.lists.published()),
                checkpoint_entries=len(event.checkpoint.entries),
            ),
            # Pods may hold devices this node has no allocation for (dp started
            # after them): their groups are reserved once PodResources says so.
            RefreshAllocations("the kubelet started: which pods hold devices"),
        ]
        settled = self._settle_sync()
        return Outcome((*effects, *settled.effects), settled.held)

    def _kubelet_checkpoint_observed(self, event: KubeletCheckpointObserved) -> Done:
        self.sync.read(event.checkpoint)
        return self._settle_sync()

    def _kubelet_stopped(self, event: KubeletStopped) -> Done:
        self.registrar.kubelet_stopped()
        return Outcome((Log.warning("kubelet-stopped"),))

    def _registration_succeeded(self, event: RegistrationSucceeded) -> Done:
        self.tally.registration_ended(event.resource, succeeded=True)
        if not self.registrar.succeeded(event.resource, event.attempt, event.now):
            return Outcome()
        phase = self.registrar.get(event.resource).phase
        return Outcome((Log.info("registered", resource=event.resource, phase=phase.value),))

    def _registration_failed(self, event: RegistrationFailed) -> Done:
        self.tally.registration_ended(event.resource, succeeded=False)
        if not self.registrar.failed(
            event.resource, event.attempt, event.now, unanswered=event.unanswered
        ):
            return Outcome()
        reg = self.registrar.get(event.resource)
        return Outcome.of(
            [
                Log.warning(
                    "registration-failed",
                    resource=event.resource,
                    reason=event.reason,
                    retry_in=round(
                        max(reg.next_attempt_at, self.registrar.quiet_until) - event.now, 3
                    ),
                )
            ]
        )

    def _connection_opened(self, event: ConnectionOpened) -> Done:
        if event.listener is not None and event.listener not in self.lists.published():
            raise UsageError(f"connection on a socket for unknown resource {event.listener!r}")
        self.registrar.opened(event.connection, event.listener, event.now)
        if event.listener is None:
            return Outcome()
        return Outcome((AttributeConnection(event.connection, event.listener),))

    def _connection_closed(self, event: ConnectionClosed) -> Done:
        self.watches.connection_closed(event.connection)
        lost = self.registrar.closed(event.connection, event.now)
        if lost is None:
            return Outcome()
        reg = self.registrar.get(lost)
        return Outcome.of(
            [
                Log.warning(
                    "connection-lost",
                    resource=lost,
                    reregister_in=round(reg.next_attempt_at - event.now, 3),
                )
            ]
        )

    def _answer(self, event: calls.UnaryInput, work: Callable[[str], Answer]) -> Effects:
        """`event`'s call answered by `work` (given its resource), and counted."""
        connection = event.connection
        rpc = RPC_METHODS[type(event)]
        effects, code = calls.answer(
            self.registrar, rpc, event.call, connection, self._clock.now, work
        )
        # By now the call has attributed its connection, when it could be.
        self.tally.answered(event, self.registrar.owner(connection), code)
        return list(effects)

    def _answered(self, event: calls.UnaryInput, work: Callable[[str], Answer]) -> Done:
        return Outcome(tuple(self._answer(event, work)))

    def _options_requested(self, event: OptionsRequested) -> Done:
        return self._answered(event, self._options_for)

    def _watch_started(self, event: WatchStarted) -> Done:
        rpc, connection = "ListAndWatch", event.connection
        try:
            resource, attributed = calls.resource_for(
                self.registrar, connection, rpc, self._clock.now
            )
        except calls.Rejection as rejection:
            # How the shell ends a stream it may not serve; counted as UNAVAILABLE.
            self.tally.answered(event, self.registrar.owner(connection), rejection.status.name)
            end = EndStream(event.stream, rejection.message)
            return Outcome((end, calls.rejected(self.registrar, rpc, connection, rejection)))
        self.tally.answered(event, resource)
        self.watches.opened(event.stream, event.connection, resource)
        publish = Publish(event.stream, resource, self.lists.advertised(resource))
        return Outcome((*attributed, publish))

    def _watch_ended(self, event: WatchEnded) -> Done:
        self.watches.ended(event.stream)
        return Outcome()

    # -- allocation -------------------------------------------------------------

    def _lookup(self, resource: str, device_ids: Sequence[str]) -> list[AdvertisedDevice]:
        return calls.lookup(self.lists.published_ids(resource), resource, device_ids)

    def _preferred_requested(self, event: PreferredAllocationRequested) -> Done:
        def work(resource: str) -> Answer:
            published = self.lists.published_ids(resource)
            return calls.preferred(published, resource, event.containers)

        return self._answered(event, work)

    def _allocate_requested(self, event: AllocateRequested) -> Done:
        done: list[calls.Allocated] = []

        def work(name: str) -> Answer:
            allocated = calls.allocate(
                self.lists.resource(name),
                name,
                event.containers,
                published=self.lists.published_ids(name),
                inventory=self.lists.inventory_ids(name),
                allocations=self.allocations,
                cdi=self.cdi,
                now=event.now,
            )
            done.append(allocated)
            return allocated.answer

        effects = self._answer(event, work)
        for allocated in done:
            return Outcome((*effects, *allocated.effects), allocated.touched)
        return Outcome(tuple(effects))

    def _prestart_requested(self, event: PreStartRequested) -> Done:
        def work(resource: str) -> Answer:
            self._lookup(resource, event.device_ids)
            return PreStartAnswer()

        return self._answered(event, work)

    def _allocations_observed(self, event: AllocationsObserved) -> Done:
        binds_before = self.sync.rules.binds
        self.polls.answered(event.now)
        answered = self.sync.answered(event.held, event.now)
        first = self.sync.rules.binds and not binds_before
        return Outcome(
            (*answered.effects, *self._nudge()),
            answered.touched,
            # Binds waiting for a trusted answer, and binds and give-backs put
            # off while an allocation held the group, can go now.
            released=bool(answered.released) or first,
        )

    def _nudge(self) -> Effects:
        """While a device the kubelet's checkpoint names is neither listed nor
        dropped, send a device list again (the one last sent): the kubelet
        writes its checkpoint at every list it gets (`sync`)."""
        resource = self.sync.nudge_resource
        if resource is None:
            return []
        return list(self.watches.resend(resource, self.lists.advertised))

    def _cdi_written(self, event: CdiSpecsWritten) -> Done:
        if self.cdi is None:
            raise UsageError("CdiSpecsWritten for a node made without cdi=True")
        return Outcome(tuple(self.cdi.written(event)))
