"""The device-plugin server as one sans-IO state machine.

`Node.handle(input)` takes one input and returns the effects to carry out, in
order. It owns the inventory (what each resource advertises), registration
and connection attribution (`Registrar`), allocations (`AllocationBook`) and
the ListAndWatch streams; its binding steps are in `node_binding`. The shell
feeds it and executes what it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import attrs

from . import node_calls
from .advertised import AdvertisedDevice
from .allocation import (
    Allocation,
    AllocationBook,
    as_advertised,
)
from .answers import (
    Answer,
    PluginOptions,
    PreStartAnswer,
)
from .bind_plan import BindDecision
from .binding import BindingBook
from .cdi import CdiSpecsWritten
from .config import Config
from .dra_frontend import DraFrontend
from .dra_inputs import (
    ClaimPrepareRequested,
    ClaimsRecalled,
    ClaimUnprepareRequested,
    DraFeaturesObserved,
    HealthWatchEnded,
    HealthWatchStarted,
)
from .dra_pool import dra_config
from .effects import (
    AttributeConnection,
    Effect,
    EndStream,
    Log,
    MovesChanged,
    Publish,
    RefreshAllocations,
    Register,
    Reject,
    Reply,
)
from .errors import StatusCode, UsageError
from .health import health_changes
from .host import HostSnapshot
from .inputs import (
    AllocateRequested,
    AllocationsObserved,
    BindingFinished,
    ConfigApplied,
    ConnectionClosed,
    ConnectionOpened,
    HostObserved,
    Input,
    KubeletCheckpointObserved,
    KubeletStarted,
    KubeletStopped,
    MovesRecalled,
    OptionsRequested,
    PreferredAllocationRequested,
    PreStartRequested,
    RegistrationFailed,
    RegistrationSucceeded,
    Tick,
    UnbindingFinished,
    WatchEnded,
    WatchStarted,
)
from .inventory import (
    DeviceKind,
    Inventory,
    Resource,
    build_inventory,
    shared_groups,
)
from .kubelet_sync import KubeletSync
from .names import NAME_MAX, check_endpoint_room, endpoint_name
from .node_binding import Binder
from .node_cdi import CdiKeeper
from .pci import PciAddress, PciId
from .registration import Registrar, SocketMode
from .tally import Tally
from .timing import Timing

__all__ = ["Node"]

_BINDS_WAIT = (
    "moves to vfio-pci wait until the kubelet's PodResources API can be trusted to say "
    "which IOMMU groups pods hold"
)


class Node:
    """One node's device-plugin server state. Not thread-safe; one caller at a time."""

    def __init__(
        self,
        config: Config,
        *,
        socket_mode: SocketMode = SocketMode.SINGLE,
        endpoint_prefix: str = "dp",
        endpoint_max_length: int = NAME_MAX,
        timing: Timing | None = None,
        pci_names: Mapping[PciId, str] | None = None,
        cdi: bool = False,
        node_name: str | None = None,
        dra_partitionable: bool = True,
        dra_device_taints: bool = True,
    ) -> None:
        check_endpoint_room(endpoint_prefix, endpoint_max_length)
        self.timing = timing or Timing()
        self.socket_mode = socket_mode
        self.endpoint_prefix = endpoint_prefix
        self.endpoint_max_length = endpoint_max_length
        self.config = config
        self.pci_names: Mapping[PciId, str] = pci_names or {}
        self.snapshot = HostSnapshot()
        self.inventory = build_inventory(self.snapshot, config, self.pci_names)
        self._waiting_logged = self._scanned = False
        self.registrar = Registrar(
            socket_mode,
            dial_wait=self.timing.dial_wait,
            held_client_wait=self.timing.held_client_wait,
            late_dial_wait=self.timing.late_dial_wait,
            backoff=self.timing.backoff,
        )
        self.allocations = AllocationBook(self.timing.release_grace)
        # Whether PodResources can be trusted yet (a kubelet that has just
        # started lists no pods); binds wait for it too: until then a group a
        # running VM uses (dp restarted under it) would look free.
        self.sync = KubeletSync(
            self.allocations,
            self.timing,
            lambda resource, device_id: self._inventory_ids.get(resource, {}).get(device_id),
            lambda: self._group_members.keys(),
        )
        self.binder = Binder(self.allocations)
        self.tally = Tally()
        # With `cdi`, the node keeps a CDI spec per resource (node_cdi).
        self.cdi = CdiKeeper() if cdi else None
        # The DRA front end (config `dra`) shares the allocation ledger: one
        # IOMMU group, one holder, whichever front end it came through. The
        # dra_* flags are what the config's "auto" assumes until the API server
        # shows whether it has those features (DraFeaturesObserved).
        self.dra = DraFrontend(
            self.allocations,
            node_name or "",
            partitionable=dra_partitionable,
            device_taints=dra_device_taints,
            health_resend=self.timing.health_resend,
        )
        self._streams: dict[int, tuple[int, str]] = {}  # stream -> (connection, resource)
        self._published: dict[str, tuple[AdvertisedDevice, ...]] = {}
        self._published_ids: dict[str, dict[str, AdvertisedDevice]] = {}
        self._by_name: dict[str, Resource] = {}
        self._inventory_ids: dict[str, dict[str, AdvertisedDevice]] = {}
        # IOMMU group -> (resource, position in its device list) of every member,
        # for groups of two or more members only: an allocation can change how
        # a device is advertised only through a sibling holding its group.
        self._group_members: dict[int, list[tuple[str, int]]] = {}
        self._now = 0.0
        self._handlers: dict[type[Any], Callable[[Any], list[Effect]]] = {
            HostObserved: self._host_observed,
            ConfigApplied: self._config_applied,
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
            BindingFinished: self._binding_finished,
            UnbindingFinished: self._unbinding_finished,
            MovesRecalled: self._moves_recalled,
            CdiSpecsWritten: self._cdi_written,
            ClaimPrepareRequested: self._claim_prepare,
            ClaimUnprepareRequested: self._claim_unprepare,
            ClaimsRecalled: self._claims_recalled,
            DraFeaturesObserved: self._dra_features_observed,
            HealthWatchStarted: self._health_watch_started,
            HealthWatchEnded: self._health_watch_ended,
            Tick: self._tick,
        }

    # -- public API ----------------------------------------------------------

    def handle(self, event: Input) -> list[Effect]:
        handler = self._handlers.get(type(event))
        if handler is None:
            raise UsageError(f"{type(event).__name__} is not a dp_core input")
        now = getattr(event, "now", None)
        if now is not None:
            if now < self._now:
                raise UsageError(f"time went backwards: {now} after {self._now}")
            self._now = now
        moves_version = self.bind_book.moves_version
        effects = handler(event)
        if self.bind_book.moves_version != moves_version:
            effects.append(MovesChanged(self.bind_book.moves()))
        effects.extend(self.sync.poll_due(self._now))
        effects.extend(self._start_due_registrations())
        self.tally.observe(event, effects, self.registrar.owner)
        return effects

    def next_deadline(self) -> float | None:
        """When the shell should send a Tick if nothing else happens first."""
        deadlines = [
            self.registrar.next_deadline(),
            self.dra.health.next_deadline(),
            self.sync.next_poll,
        ]
        return min((d for d in deadlines if d is not None), default=None)

    @property
    def wants_kubelet_checkpoint(self) -> bool:
        """Whether the shell should read the kubelet's checkpoint again when
        it changes (`KubeletCheckpointObserved`): while the kubelet syncs and
        something it wrote could matter (`KubeletSync.wants_checkpoint`)."""
        return self.sync.wants_checkpoint

    def advertised(self, resource: str) -> tuple[AdvertisedDevice, ...]:
        """The device list (health included) last published for `resource`."""
        return self._published.get(resource, ())

    def resource_names(self) -> tuple[str, ...]:
        return tuple(sorted(self._published))

    def streams(self, resource: str) -> list[int]:
        return [stream for stream, (_, name) in self._streams.items() if name == resource]

    @property
    def bind_book(self) -> BindingBook:
        return self.binder.book

    @property
    def bindings(self) -> dict[PciAddress, BindDecision]:
        """The binding plan, by function."""
        return self.binder.plan

    def bind_planned(self, address: PciAddress, driver: str | None) -> bool:
        """Whether a queued `BindDevice` should still be carried out (`Binder.bind_planned`)."""
        return self.binder.bind_planned(address, driver)

    def give_back_planned(self, address: PciAddress) -> bool:
        """Whether a queued `UnbindDevice` should still be carried out, now its turn has come."""
        return self.binder.give_back_planned(address)

    # -- host and config -------------------------------------------------------

    def _host_observed(self, event: HostObserved) -> list[Effect]:
        self.snapshot = event.snapshot
        self._scanned = True
        self.bind_book.observed(event.snapshot)
        effects = self._rebuild()
        if not self.sync.rules.binds and any(d.binds for d in self.bindings.values()):
            effects.append(RefreshAllocations("binds wait to learn which IOMMU groups pods hold"))
            if not self._waiting_logged:  # once: the wait shows, should PodResources not answer
                self._waiting_logged = True
                effects.append(Log.info("binds-waiting", reason=_BINDS_WAIT))
        return effects

    def _config_applied(self, event: ConfigApplied) -> list[Effect]:
        self.config = event.config
        self.pci_names = event.pci_names
        self.bind_book.retry_all(self.snapshot, self.config)
        return self._rebuild()

    def _rebuild(self) -> list[Effect]:
        effects = self.binder.replan(self.snapshot, self.config, start=self.sync.rules.binds)
        effects += self.binder.give_back_stranded()
        effects += self._rebuild_inventory()
        return effects

    def _rebuild_inventory(self) -> list[Effect]:
        """The inventory again from the snapshot, plan and give-backs held now."""
        effects: list[Effect] = []
        self.inventory = build_inventory(
            self.snapshot,
            self.config,
            self.pci_names,
            self.bindings,
            self.bind_book.leaving,
            self.bind_book.moving_groups,
        )
        self._by_name = {r.name: r for r in self.inventory.resources}
        self._inventory_ids = {
            r.name: {d.id: d for d in r.devices} for r in self.inventory.resources
        }
        effects.extend(self._refresh())
        if self.cdi is not None:
            effects.extend(self.cdi.refresh(self.inventory, self.snapshot))
        effects.extend(self._rebuild_dra())
        dra_groups = {d.iommu_group for d in self.dra.devices() if d.iommu_group is not None}
        self._group_members = shared_groups(self.inventory.resources, also=dra_groups)
        if self.sync.rules.holds_unlisted:  # which devices share a group may have changed
            effects.extend(self._settle_sync())
        return effects

    def _settle_sync(self) -> list[Effect]:
        """Hold and free the groups the kubelet's sync leaves in doubt (`KubeletSync.settle`)."""
        settled = self.sync.settle(self._now)
        return list(settled.effects) + self._refresh_holders(settled.touched)

    def _refresh_holders(self, touched: Collection[int]) -> list[Effect]:
        """What the node and the DRA pool publish again when these groups' holders changed."""
        if not touched:
            return []
        return self._refresh_groups(touched) + self.dra.refresh()

    def _rebuild_dra(self) -> list[Effect]:
        view = dra_config(self.config)
        if view is None:
            return self.dra.rebuild(None, Inventory(), self.snapshot, now=self._now)
        if not self.dra.node_name:
            raise UsageError("the config turns DRA on, but the Node was made without node_name")
        inventory = build_inventory(
            self.snapshot,
            view,
            self.pci_names,
            self.bindings,
            self.bind_book.leaving,
            self.bind_book.moving_groups,
        )
        dra = self.config.dra
        driver = dra.driver_name if dra else None
        return self.dra.rebuild(driver, inventory, self.snapshot, dra, now=self._now)

    def _effective(
        self, resource: Resource, reserved: Mapping[int, Allocation]
    ) -> tuple[AdvertisedDevice, ...]:
        if not reserved or resource.kind is DeviceKind.SHARED:
            return resource.devices
        return tuple(as_advertised(resource.name, device, reserved) for device in resource.devices)

    def _refresh_groups(self, groups: Iterable[int]) -> list[Effect]:
        """`_refresh` for an allocation change: only groups it touched can change
        status, so look at their members alone and republish resources where
        one did (an Allocate must not cost a walk of every device it shares a
        resource with)."""
        reserved = self.allocations.reserved_groups()
        changed = set()
        for group in groups:
            for name, index in self._group_members.get(group, ()):
                published = self._published.get(name, ())
                device = self._by_name[name].devices[index]
                if index >= len(published) or published[index] != as_advertised(
                    name, device, reserved
                ):
                    changed.add(name)
        return self._refresh(changed) if changed else []

    def _refresh(self, only: Iterable[str] | None = None) -> list[Effect]:
        """Publish every resource whose advertised list changed, and only those.

        `only` limits the work to resources an allocation change can touch;
        without it every resource is recomputed (after a scan or a config).
        """
        effects: list[Effect] = []
        reserved = self.allocations.reserved_groups()
        names = self._by_name if only is None else [n for n in only if n in self._by_name]
        current = {name: self._effective(self._by_name[name], reserved) for name in names}
        if only is None:
            # A resource whose devices all vanished stays registered with an
            # empty list: the kubelet has no way to unregister one.
            for name in self._published:
                current.setdefault(name, ())
            added = self.registrar.track(sorted(current), self._now)
            for name in added:
                effects.append(Log.info("resource-discovered", resource=name))
        for name, devices in sorted(current.items()):
            previous = self._published.get(name)
            if previous == devices:
                continue
            effects.extend(health_changes(name, previous or (), devices))
            self._published[name] = devices
            self._published_ids[name] = {device.id: device for device in devices}
            for stream in self.streams(name):
                effects.append(Publish(stream, name, devices))
        return effects

    # -- registration and connections -----------------------------------------

    def _options_for(self, resource: str) -> PluginOptions:
        found = self._by_name.get(resource)
        preferred = found is not None and found.kind is not DeviceKind.SHARED
        return PluginOptions(pre_start_required=False, get_preferred_allocation_available=preferred)

    def _start_due_registrations(self) -> list[Effect]:
        effects: list[Effect] = []
        expired = self.registrar.expire(self._now)
        for name in expired:
            effects.append(
                Log.warning(
                    "registration-unattributed",
                    resource=name,
                    reason="the kubelet did not dial in time after Register",
                )
            )
        per_resource = self.socket_mode is SocketMode.PER_RESOURCE
        for reg in self.registrar.due(self._now):
            # A stream of an earlier registration that ends after the new one
            # would make the kubelet mark the new endpoint unhealthy.
            for stream in self.streams(reg.name):
                del self._streams[stream]
                effects.append(EndStream(stream, "the resource is registering again"))
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

    def _kubelet_started(self, event: KubeletStarted) -> list[Effect]:
        self.registrar.kubelet_started(event.now)
        self.sync.started(event.checkpoint, event.now)
        effects: list[Effect] = [
            Log.info(
                "kubelet-started",
                resources=len(self._published),
                checkpoint_entries=len(event.checkpoint.entries),
            ),
            # Pods may hold devices this node has no allocation for (dp started
            # after them): their groups are reserved once PodResources says so.
            RefreshAllocations("the kubelet started: which pods hold devices"),
        ]
        return effects + self._settle_sync()

    def _kubelet_checkpoint_observed(self, event: KubeletCheckpointObserved) -> list[Effect]:
        self.sync.read(event.checkpoint)
        return self._settle_sync()

    def _kubelet_stopped(self, event: KubeletStopped) -> list[Effect]:
        self.registrar.kubelet_stopped()
        return [Log.warning("kubelet-stopped")]

    def _registration_succeeded(self, event: RegistrationSucceeded) -> list[Effect]:
        if not self.registrar.succeeded(event.resource, event.attempt, event.now):
            return []
        phase = self.registrar.get(event.resource).phase
        return [Log.info("registered", resource=event.resource, phase=phase.value)]

    def _registration_failed(self, event: RegistrationFailed) -> list[Effect]:
        if not self.registrar.failed(
            event.resource, event.attempt, event.now, unanswered=event.unanswered
        ):
            return []
        reg = self.registrar.get(event.resource)
        return [
            Log.warning(
                "registration-failed",
                resource=event.resource,
                reason=event.reason,
                retry_in=round(max(reg.next_attempt_at, self.registrar.quiet_until) - event.now, 3),
            )
        ]

    def _connection_opened(self, event: ConnectionOpened) -> list[Effect]:
        if event.listener is not None and event.listener not in self._published:
            raise UsageError(f"connection on a socket for unknown resource {event.listener!r}")
        self.registrar.opened(event.connection, event.listener, event.now)
        if event.listener is None:
            return []
        return [AttributeConnection(event.connection, event.listener)]

    def _connection_closed(self, event: ConnectionClosed) -> list[Effect]:
        for stream, (connection, _) in list(self._streams.items()):
            if connection == event.connection:
                del self._streams[stream]
        lost = self.registrar.closed(event.connection, event.now)
        if lost is None:
            return []
        reg = self.registrar.get(lost)
        return [
            Log.warning(
                "connection-lost",
                resource=lost,
                reregister_in=round(reg.next_attempt_at - event.now, 3),
            )
        ]

    def _resource_for(self, connection: int, rpc: str) -> tuple[str, list[Effect]]:
        """The resource an RPC on `connection` serves, or a node_calls.Rejection."""
        registrar = self.registrar
        known = registrar.owner(connection) is not None
        resource = registrar.attribute(connection, self._now, rpc=rpc)
        if resource is not None:
            bind: list[Effect] = [] if known else [AttributeConnection(connection, resource)]
            return resource, bind
        why = registrar.why_unattributed(connection, rpc)
        requeued = registrar.orphan_seen(self._now)
        raise node_calls.Rejection(
            StatusCode.UNAVAILABLE,
            f"connection {connection} is not attributed to any resource ({why}); re-registering "
            f"{', '.join(requeued) if requeued else 'nothing: every resource has a connection'}",
        )

    def _answer(
        self, rpc: str, call: int, connection: int, work: Callable[[str], Answer]
    ) -> list[Effect]:
        try:
            resource, effects = self._resource_for(connection, rpc)
            answer = work(resource)
        except node_calls.Rejection as rejection:
            reject = Reject(call, rejection.status, rejection.message)
            return [reject, self._rejected(rpc, connection, rejection)]
        effects.append(Reply(call, answer))
        return effects

    def _rejected(self, rpc: str, connection: int, rejection: node_calls.Rejection) -> Log:
        owner = self.registrar.owner(connection) or ""
        status, reason = rejection.status.name, rejection.message
        return Log.warning("rejected", rpc=rpc, resource=owner, status=status, reason=reason)

    def _options_requested(self, event: OptionsRequested) -> list[Effect]:
        return self._answer(
            "GetDevicePluginOptions", event.call, event.connection, self._options_for
        )

    def _watch_started(self, event: WatchStarted) -> list[Effect]:
        try:
            resource, effects = self._resource_for(event.connection, "ListAndWatch")
        except node_calls.Rejection as rejection:
            end = EndStream(event.stream, rejection.message)
            return [end, self._rejected("ListAndWatch", event.connection, rejection)]
        self._streams[event.stream] = (event.connection, resource)
        effects.append(Publish(event.stream, resource, self._published.get(resource, ())))
        return effects

    def _watch_ended(self, event: WatchEnded) -> list[Effect]:
        self._streams.pop(event.stream, None)
        return []

    # -- allocation -------------------------------------------------------------

    def _lookup(self, resource: str, device_ids: Sequence[str]) -> list[AdvertisedDevice]:
        return node_calls.lookup(self._published_ids.get(resource, {}), resource, device_ids)

    def _preferred_requested(self, event: PreferredAllocationRequested) -> list[Effect]:
        def work(resource: str) -> Answer:
            published = self._published_ids.get(resource, {})
            return node_calls.preferred(published, resource, event.containers)

        return self._answer("GetPreferredAllocation", event.call, event.connection, work)

    def _allocate_requested(self, event: AllocateRequested) -> list[Effect]:
        logs: list[Effect] = []
        touched: set[int] = set()

        def work(name: str) -> Answer:
            allocated = node_calls.allocate(
                self._by_name.get(name),
                name,
                event.containers,
                published=self._published_ids.get(name, {}),
                inventory=self._inventory_ids.get(name, {}),
                allocations=self.allocations,
                cdi=self.cdi,
                now=event.now,
                effects=logs,
            )
            logs.extend(allocated.effects)
            touched.update(allocated.touched)
            return allocated.answer

        effects = self._answer("Allocate", event.call, event.connection, work)
        effects.extend(logs)
        if any(isinstance(e, Reply) for e in effects):
            effects.extend(self._refresh_holders(touched))
        return effects

    def _prestart_requested(self, event: PreStartRequested) -> list[Effect]:
        def work(resource: str) -> Answer:
            self._lookup(resource, event.device_ids)
            return PreStartAnswer()

        return self._answer("PreStartContainer", event.call, event.connection, work)

    def _allocations_observed(self, event: AllocationsObserved) -> list[Effect]:
        binds_before = self.sync.rules.binds
        answered = self.sync.answered(event.held, event.now)
        effects = list(answered.effects) + self._refresh_holders(answered.touched)
        first = self.sync.rules.binds and not binds_before
        if (answered.released or first) and self.config.binding is not None:
            # Binds waiting for a trusted answer, and binds and give-backs put
            # off while an allocation held the group, can go now.
            effects += self._rebuild()
        effects.extend(self._nudge())
        return effects

    def _nudge(self) -> list[Effect]:
        """While a device the kubelet's checkpoint names is neither listed nor
        dropped, send a device list again (the one last sent): the kubelet
        writes its checkpoint at every list it gets (kubelet_sync)."""
        resource = self.sync.nudge_resource
        if resource is None:
            return []
        streams = sorted(self._streams.items(), key=lambda item: item[1][1] != resource)
        for stream, (_, name) in streams:
            return [Publish(stream, name, self._published.get(name, ()))]
        return []

    def _binding_finished(self, event: BindingFinished) -> list[Effect]:
        effects, rebuild = self.binder.finished(event, self.snapshot, self.config)
        return effects + self._rebuild_inventory() if rebuild else effects

    def _unbinding_finished(self, event: UnbindingFinished) -> list[Effect]:
        return self.binder.unbound(event) + self._rebuild_inventory()

    def _moves_recalled(self, event: MovesRecalled) -> list[Effect]:
        return self.binder.recalled(event, scanned=self._scanned)

    def _cdi_written(self, event: CdiSpecsWritten) -> list[Effect]:
        if self.cdi is None:
            raise UsageError("CdiSpecsWritten for a node made without cdi=True")
        return self.cdi.written(event)

    def _claim_prepare(self, event: ClaimPrepareRequested) -> list[Effect]:
        effects, touched = self.dra.prepare(event)
        return effects + self._refresh_groups(touched)

    def _claim_unprepare(self, event: ClaimUnprepareRequested) -> list[Effect]:
        effects, touched = self.dra.unprepare(event)
        effects += self._refresh_groups(touched)
        if touched and self.config.binding is not None:
            effects += self._rebuild()  # binds put off while the claim held a group
        return effects

    def _claims_recalled(self, event: ClaimsRecalled) -> list[Effect]:
        effects, touched = self.dra.recalled(event, self._now)
        return effects + self._refresh_groups(touched)

    def _dra_features_observed(self, event: DraFeaturesObserved) -> list[Effect]:
        return self.dra.features_observed(event)

    def _health_watch_started(self, event: HealthWatchStarted) -> list[Effect]:
        return list(self.dra.health.started(event))

    def _health_watch_ended(self, event: HealthWatchEnded) -> list[Effect]:
        return list(self.dra.health.ended(event))

    def _tick(self, event: Tick) -> list[Effect]:
        return list(self.dra.health.tick(event.now))

    def describe(self) -> Inventory:
        """The inventory with reservations applied, as last published."""
        return Inventory(
            tuple(
                attrs.evolve(r, devices=self._published.get(r.name, r.devices))
                for r in self.inventory.resources
            ),
            self.inventory.skipped,
        )
