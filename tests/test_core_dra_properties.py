"""Both front ends on one ledger, driven at random (hypothesis).

Random interleavings of DRA prepare and unprepare, the shell's reports on the
claims' reads (read or not, handed back in any order, another call's claim
prepared meanwhile) and on their files (written or not, removed or not, in
any order), device-plugin
Allocates, PodResources answers that release pods, health changes (a group's
node gone and back) and restarts (a new Node given the checkpoint and what
pods hold) over generated hosts. Invariants: no IOMMU group is ever held by
two holders, every prepared claim holds each of its groups, a released claim
(unprepared, or let go when its fresh files failed) holds none and its
groups are free, every call that waits for a report is answered once after
it and no other is (`Calls`), none is left waiting, a restart rebuilds
the same ledger, and the pool never offers, unmarked, a device the scheduler
could give a second holder of its group, and the pool kept as holders change
is the pool worked out afresh.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import hypothesis
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dp_core import (
    AllocationsObserved,
    Config,
    HostObserved,
    HostSnapshot,
    KubeletStarted,
    Ledger,
    MediatedDevice,
    PciHostDevice,
    PermittedHostDevices,
    Reply,
    StandardNode,
    UsageError,
)
from dp_core.config import Dra
from dp_core.deviceplugin import DevicePluginFrontend
from dp_core.dra import ClaimHold, ClaimRef, DraFrontend, PreparedClaim
from dp_core.dra.effects import (
    ClaimAnswered,
    ClaimPrepared,
    ClaimRefused,
    ClaimsChanged,
    ClaimUnprepared,
    ReadClaim,
)
from dp_core.dra.inputs import (
    AllocatedDevice,
    ClaimFilesRemoved,
    ClaimFilesWritten,
    ClaimPrepareRequested,
    ClaimRead,
    ClaimsRecalled,
    ClaimUnprepareRequested,
    ClaimUnreadable,
)
from dp_core.dra.metadata import prepared_devices
from dp_core.dra.pool import PoolOptions, pool_content

from core_builders import PCI_IDS, Kubelet, effects_of, host_snapshots

DRIVER = "vfio.dp.example.com"
NODE = "worker-1"
CLAIMS = tuple(ClaimRef("vms", f"uid-{i}", f"vm-{i}") for i in range(4))


@st.composite
def split_configs(draw: st.DrawFn) -> Config:
    """Each PCI ID and mdev type on one front end or the other."""
    pci_entries = tuple(
        PciHostDevice(
            pci_id,
            f"example.com/pci-{pci_id.device:04x}",
            frontend=draw(st.sampled_from(["dra", "device-plugin"])),
        )
        for pci_id in PCI_IDS
    )
    mdevs = (
        MediatedDevice(
            "GRID T4-1Q",
            "example.com/mdev-1q",
            frontend=draw(st.sampled_from(["dra", "device-plugin"])),
        ),
        MediatedDevice("GRID T4-2Q", "example.com/mdev-2q", frontend="dra"),
    )
    return Config(PermittedHostDevices(pci_entries, mdevs), shared_devices=(), dra=Dra(DRIVER))


# A Prepare or Unprepare is answered only after the shell's reports: a
# Prepare of a claim not prepared yet waits for its read (`ReadClaim`, closed
# by `ClaimRead` or `ClaimUnreadable`), and `ClaimPrepared` and
# `ClaimUnprepared` each open a wait that `ClaimFilesWritten` or
# `ClaimFilesRemoved` for the same call closes. `Calls` keeps which calls wait
# for which report, checks each input's call effects against it, and knows
# which calls were answered or lost with dp.
CALL_EFFECTS = (ReadClaim, ClaimPrepared, ClaimUnprepared, ClaimAnswered, ClaimRefused)
REPORTS = ("read", "written", "removed")  # what a call may wait for


@attrs.frozen
class Waiting:
    """A call that waits for the shell's report on its claim."""

    claim: ClaimRef
    wait: str  # one of REPORTS
    fresh: bool = False  # the call prepared the claim: a failed write lets it go
    written: str = ""  # the problem its files could not be written for, answered once removed


class Calls:
    """Which calls wait for a report, and which are over."""

    def __init__(self, driver: str) -> None:
        self.driver = driver
        self.last = 0
        self.waiting: dict[int, Waiting] = {}
        self.answered: dict[int, str] = {}  # call -> the kind of report it was answered on
        self.refused: set[int] = set()  # answered on their read with ClaimRefused
        self.lost: set[int] = set()  # waiting when dp restarted: the kubelet's calls died with it
        self.opened: set[int] = (
            set()
        )  # every call that got ReadClaim, ClaimPrepared or ClaimUnprepared

    def new(self) -> int:
        self.last += 1
        return self.last

    def restarted(self) -> None:
        self.lost.update(self.waiting)
        self.waiting.clear()

    def strays(self) -> dict[str, list[tuple[int, str]]]:
        """Reports, as (call, kind), that wait for no report of their kind, by
        why: any report for a call answered (the one it was answered on, again,
        or another); another kind of report than a call waits for; any report
        for a call lost with dp or never made."""
        return {
            "answered": [(call, kind) for call in sorted(self.answered) for kind in REPORTS],
            "other kind": sorted(
                (c, kind) for c, w in self.waiting.items() for kind in REPORTS if kind != w.wait
            ),
            "no wait": [
                (call, kind) for call in sorted({*self.lost, self.last + 1}) for kind in REPORTS
            ],
        }

    def check_accounts(self) -> None:
        """Every call that opened a wait is waiting, answered or lost, and only one."""
        waiting, answered = set(self.waiting), set(self.answered)
        assert not waiting & answered and not waiting & self.lost
        assert not answered & self.lost
        assert self.opened == waiting | answered | self.lost
        assert self.refused <= {c for c, kind in self.answered.items() if kind == "read"}

    def observe(
        self,
        event: object,
        effects: Sequence[object],
        before: Mapping[str, PreparedClaim],
        after: Mapping[str, PreparedClaim],
    ) -> None:
        """Check the call effects `event` gave against the model, and follow them.

        `before` and `after` are the prepared claims by UID around the input.
        """
        calls = [e for e in effects if isinstance(e, CALL_EFFECTS)]
        if isinstance(event, ClaimPrepareRequested):
            self._prepare(event, calls, before, after)
        elif isinstance(event, ClaimRead | ClaimUnreadable):
            self._read(event, calls, before, after)
        elif isinstance(event, ClaimUnprepareRequested):
            uid = event.claim.uid
            assert calls == [ClaimUnprepared(event.call, event.claim, before.get(uid))]
            assert uid not in after
            self._open(event.call, Waiting(event.claim, "removed"))
        elif isinstance(event, ClaimFilesWritten):
            self._written(event, calls, before, after)
        elif isinstance(event, ClaimFilesRemoved):
            waiting = self._close(event.call, "removed")
            claim = waiting.claim
            assert len(calls) == 1, calls
            (answer,) = calls
            assert isinstance(answer, ClaimAnswered) and answer.call == event.call, calls
            assert (answer.claim, answer.devices) == (claim, ())
            why = "after a failed write" if waiting.written else "unprepared"
            hypothesis.event(f"removed: {why}")
            if waiting.written:  # the write's problem, whatever the removal's
                assert "could not be written" in answer.error and waiting.written in answer.error
            elif event.problem:
                assert "could not be removed" in answer.error and event.problem in answer.error
            else:
                assert answer.error == ""
            assert after == before  # it was let go when its files were asked to go
            self.answered[event.call] = "removed"
        else:
            assert calls == [], f"{type(event).__name__} answered calls: {calls}"

    def _prepare(
        self,
        event: ClaimPrepareRequested,
        calls: list[object],
        before: Mapping[str, PreparedClaim],
        after: Mapping[str, PreparedClaim],
    ) -> None:
        """A claim prepared already goes to its files; any other is read first."""
        uid = event.claim.uid
        assert after == before  # nothing is held before the claim is read
        if uid in before:  # idempotent: the same answer, and no read
            assert calls == [ClaimPrepared(event.call, before[uid])], calls
            hypothesis.event("prepare: again, unread")
            self._open(event.call, Waiting(event.claim, "written"))
            return
        assert calls == [ReadClaim(event.call, event.claim)], calls
        self._open(event.call, Waiting(event.claim, "read"))

    def _read(
        self,
        event: ClaimRead | ClaimUnreadable,
        calls: list[object],
        before: Mapping[str, PreparedClaim],
        after: Mapping[str, PreparedClaim],
    ) -> None:
        waiting = self._close(event.call, "read")
        claim, uid = waiting.claim, waiting.claim.uid
        read = "read" if isinstance(event, ClaimRead) else "unreadable"
        assert len(calls) == 1, calls
        (effect,) = calls
        if isinstance(effect, ClaimRefused):
            assert (effect.call, effect.claim) == (event.call, claim)
            if isinstance(event, ClaimUnreadable):  # the shell's reason, as it stands
                assert (effect.error, effect.reason) == (event.problem, "ClaimUnreadable")
            assert uid not in before and after == before  # nothing held is released
            hypothesis.event(f"{read}: refused")
            self.answered[event.call] = "read"
            self.refused.add(event.call)
            return
        assert isinstance(effect, ClaimPrepared) and effect.call == event.call, calls
        assert effect.prepared.claim == claim and after.get(uid) == effect.prepared
        if uid in before:  # prepared by another call while read: what is held, read or not
            assert effect.prepared == before[uid] and after == before
        else:
            assert isinstance(event, ClaimRead), "an unread claim is never prepared"
        hypothesis.event(f"{read}: {'prepared meanwhile' if uid in before else 'fresh'}")
        self.waiting[event.call] = Waiting(claim, "written", fresh=uid not in before)

    def _written(
        self,
        event: ClaimFilesWritten,
        calls: list[object],
        before: Mapping[str, PreparedClaim],
        after: Mapping[str, PreparedClaim],
    ) -> None:
        waiting = self._close(event.call, "written")
        claim, uid = waiting.claim, waiting.claim.uid
        how = "fresh" if waiting.fresh else "again"
        hypothesis.event(f"written: {'failed' if event.problem else 'ok'}, {how}")
        if event.problem and waiting.fresh:
            # Nothing stays held for a claim the kubelet is told failed.
            assert calls == [ClaimUnprepared(event.call, claim, before.get(uid))], calls
            assert uid not in after
            self.waiting[event.call] = Waiting(claim, "removed", written=event.problem)
            return
        assert len(calls) == 1, calls
        (answer,) = calls
        assert isinstance(answer, ClaimAnswered), calls
        assert (answer.call, answer.claim) == (event.call, claim)
        if event.problem:  # prepared by another call: it stays so
            assert answer.devices == ()
            assert "could not be written" in answer.error and event.problem in answer.error
        elif uid not in before:  # unprepared while its files were written
            assert answer.devices == ()
            assert "was unprepared while its files were written" in answer.error
        else:
            assert answer == ClaimAnswered(
                event.call, claim, prepared_devices(self.driver, after[uid])
            )
        assert after == before
        self.answered[event.call] = "written"

    def _open(self, call: int, waiting: Waiting) -> None:
        assert call not in self.opened, f"call {call} made twice"
        self.opened.add(call)
        self.waiting[call] = waiting

    def _close(self, call: int, wait: str) -> Waiting:
        waiting = self.waiting.pop(call)  # the machine reports only a call that waits
        assert waiting.wait == wait
        assert call not in self.answered, f"call {call} answered twice"
        return waiting


def make_node(config: Config, partitionable: bool) -> StandardNode:
    return StandardNode(config, node_name=NODE, dra_partitionable=partitionable)


def parts(node: StandardNode) -> tuple[DraFrontend, DevicePluginFrontend, Ledger]:
    """The node's DRA front end, its device-plugin front end and its ledger: the
    one place that knows how a node hands them out."""
    return node.dra, node.device_plugin, node.ledger


def ledger_by_group(ledger: Ledger) -> dict[int, tuple[str, str]]:
    """Group -> who holds it: ("claim", UID) or ("pod", resource)."""
    found = {}
    for group, holder in ledger.held().items():
        claim = getattr(holder, "claim", None)
        found[group] = ("claim", claim.uid) if claim else ("pod", holder.owner)
    return found


def check_one_holder_per_group(
    dra: DraFrontend, device_plugin: DevicePluginFrontend, ledger: Ledger
) -> None:
    reserved = ledger.held()
    holders = [*device_plugin.allocations.all(), *dra.holds()]
    seen: dict[int, object] = {}
    for holder in holders:
        for group in holder.groups:
            assert group not in seen, f"group {group} held by {seen[group]} and {holder}"
            seen[group] = holder
            assert reserved[group] is holder, f"group {group}: the index names another holder"
    assert set(seen) == set(reserved)
    prepared = {p.claim.uid: p for p in dra.prepared()}
    assert {h.claim.uid for h in dra.holds()} == set(prepared)


def check_every_prepared_claim_holds_its_groups(dra: DraFrontend, ledger: Ledger) -> None:
    for prepared in dra.prepared():
        for group in prepared.groups:
            holder = ledger.holder(group)
            assert isinstance(holder, ClaimHold) and holder.claim == prepared.claim, (
                f"{prepared.describe()}: group {group} is held by "
                f"{holder.describe() if holder else 'nobody'}"
            )


def check_released(unprepared: ClaimUnprepared, dra: DraFrontend, ledger: Ledger) -> None:
    """A claim let go (unprepared, or its fresh files failed) is not prepared,
    holds nothing, and the groups it held are free."""
    claim = unprepared.claim
    assert claim not in [p.claim for p in dra.prepared()]
    assert all(getattr(h, "claim", None) != claim for h in ledger.held().values())
    if unprepared.prepared is not None:
        for group in unprepared.prepared.groups:
            holder = ledger.holder(group)
            assert holder is None, f"group {group} of released {claim} held by {holder}"


def check_the_pool_never_offers_a_split(dra: DraFrontend, ledger: Ledger) -> None:
    """Each device the pool offers without a NoSchedule taint can be allocated
    without splitting a held group, as the scheduler sees it: its group is
    free, or held through it, or held by a claim through a member that
    consumes the same counter (which the scheduler counts)."""
    pool = dra.pool
    if pool is None:
        return
    reserved = ledger.held()
    groups = {d.name: d.iommu_group for d in dra.devices()}
    for device in pool.devices:
        if any(t.effect == "NoSchedule" for t in device.taints):
            continue
        group = groups[device.name]
        holder = reserved.get(group) if group is not None else None
        claim = getattr(holder, "claim", None)
        if holder is None or (claim is not None and device.name in holder.device_ids):
            continue
        assert claim is not None, f"{device.name}: group {group} held by a pod, unmarked"
        sets = {c.counter_set for c in device.consumes_counters}
        consumed = {
            c.counter_set
            for name in holder.device_ids
            if (held := pool.device(name)) is not None
            for c in held.consumes_counters
        }
        assert sets & consumed, f"{device.name}: group {group} held by a claim, unmarked"


def check_the_pool_is_as_worked_out_afresh(dra: DraFrontend, ledger: Ledger) -> None:
    """The front end works the pool out again only for groups whose holder
    changed; it must be what the whole pool worked out from scratch is."""
    if dra.pool is None:
        return
    options = PoolOptions(DRIVER, NODE, dra.partitionable, dra.device_taints)
    assert dra.pool == pool_content(dra.devices(), ledger.held(), options)


PROBLEMS = st.sampled_from(["", "No space left on device"])


class World:
    """A node, its kubelet for the device plugin, what pods hold, and its calls."""

    def __init__(self, config: Config, host: HostSnapshot, partitionable: bool) -> None:
        self.config = config
        self.original = host
        self.host = host
        self.partitionable = partitionable
        self.now = 0.0
        self.calls = Calls(DRIVER)
        self.checkpoint: tuple[PreparedClaim, ...] = ()
        self.start(recall=False)

    def start(self, *, recall: bool) -> None:
        self.node = make_node(self.config, self.partitionable)
        self.dra, self.device_plugin, self.ledger = parts(self.node)
        self.calls.restarted()
        if recall:
            self.node.handle(ClaimsRecalled(self.checkpoint))
        effects = self.node.handle(HostObserved(self.host, self.now))
        effects += self.node.handle(KubeletStarted(self.now))
        self.kubelet = Kubelet(self.node, self.now)
        self.kubelet.register_all(effects)

    def tick(self, seconds: float = 1.0) -> None:
        self.now += seconds
        self.kubelet.now = self.now

    def prepared(self) -> dict[str, PreparedClaim]:
        return {p.claim.uid: p for p in self.dra.prepared()}

    def feed(self, event: object) -> list[object]:
        before = self.prepared()
        effects: list[object] = self.node.handle(event)  # type: ignore[arg-type]
        self.calls.observe(event, effects, before, self.prepared())
        for changed in effects_of(effects, ClaimsChanged):
            self.checkpoint = changed.prepared
        for unprepared in effects_of(effects, ClaimUnprepared):
            check_released(unprepared, self.dra, self.ledger)
        return effects

    def report(self, call: int, data: st.DataObject) -> None:
        """The shell's report on call `call`'s claim: its read, or its files."""
        wait = self.calls.waiting[call].wait
        if wait == "read":
            self.read(call, data)
        elif wait == "removed":
            self.feed(ClaimFilesRemoved(call, data.draw(PROBLEMS)))
        else:
            self.feed(ClaimFilesWritten(call, data.draw(PROBLEMS)))

    def read(self, call: int, data: st.DataObject) -> None:
        """Hand the claim of call `call` back as read: mostly healthy devices,
        so that most claims get prepared; now and then any device, or one not
        offered, to be refused; now and then a claim that cannot be read."""
        reads = sorted(c for c, w in self.calls.waiting.items() if w.wait == "read")
        hypothesis.event(f"read: {'in' if call == reads[0] else 'out of'} the order asked")
        if data.draw(st.integers(0, 4)) == 0:
            self.feed(ClaimUnreadable(call, f"cannot read claim {call}: the API server is away"))
            return
        names = [d.name for d in self.dra.devices() if d.advertised.healthy]
        if not names or data.draw(st.integers(0, 3)) == 0:
            names = [d.name for d in self.dra.devices()] + ["pci-0000-ff-00-0"]
        chosen = data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True))
        results = [AllocatedDevice(f"r{i}", DRIVER, NODE, n) for i, n in enumerate(chosen)]
        self.feed(ClaimRead(call, results, self.now))

    def drain(self, data: st.DataObject) -> None:
        """Report every call's read and files, in any order, until none waits."""
        while self.calls.waiting:
            call = data.draw(st.sampled_from(sorted(self.calls.waiting)))
            self.report(call, data)
            self.check()
        assert self.calls.opened == set(self.calls.answered) | self.calls.lost

    def check(self) -> None:
        self.calls.check_accounts()
        check_one_holder_per_group(self.dra, self.device_plugin, self.ledger)
        check_every_prepared_claim_holds_its_groups(self.dra, self.ledger)
        check_the_pool_never_offers_a_split(self.dra, self.ledger)
        check_the_pool_is_as_worked_out_afresh(self.dra, self.ledger)

    def held_by_pods(self) -> dict[str, frozenset[str]]:
        held: dict[str, set[str]] = {}
        for allocation in self.device_plugin.allocations.all():
            held.setdefault(allocation.resource, set()).update(allocation.device_ids)
        return {name: frozenset(ids) for name, ids in held.items()}


ACTIONS = [
    "prepare",
    "prepare",
    "read",
    "read",
    "written",
    "written",
    "written",
    "removed",
    "removed",
    "unprepare",
    "stray-report",
    "stray-report",
    "allocate",
    "allocate",
    "release",
    "health",
    "restart",
]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    host=host_snapshots(max_groups=5, min_groups=1),
    config=split_configs(),
    partitionable=st.booleans(),
    data=st.data(),
)
def test_no_group_has_two_holders_no_call_is_left_waiting_and_a_restart_rebuilds_the_ledger(
    host: HostSnapshot, config: Config, partitionable: bool, data: st.DataObject
) -> None:
    if data.draw(st.integers(0, 3)):
        # Most hosts have VFIO loaded and every group's node, so that claims
        # get prepared; devices stay unhealthy for their drivers and groups.
        nodes = {"/dev/vfio/vfio", *(f"/dev/vfio/{g.number}" for g in host.iommu_groups)}
        host = attrs.evolve(host, dev_nodes=host.dev_nodes | nodes)
    world = World(config, host, partitionable)
    calls = world.calls
    actions = data.draw(st.lists(st.sampled_from(ACTIONS), min_size=10, max_size=40))
    for action in actions:
        world.tick()
        dra = world.dra
        if action == "prepare":
            # Now and then a claim prepared or being read already: the kubelet
            # asks again (a retry, a second pod), and reads overlap.
            busy = sorted(
                {p.claim for p in dra.prepared()} | {w.claim for w in calls.waiting.values()},
                key=lambda c: c.uid,
            )
            claims = busy if busy and data.draw(st.booleans()) else CLAIMS
            claim = data.draw(st.sampled_from(claims))
            world.feed(ClaimPrepareRequested(calls.new(), claim, world.now))
        elif action in ("read", "written", "removed"):
            # Any call that waits, not the one asked first: the shell reads
            # claims at once and each read may come back in any order.
            waiting = [c for c, w in calls.waiting.items() if w.wait == action]
            if not waiting:
                continue
            world.report(data.draw(st.sampled_from(waiting)), data)
        elif action == "unprepare":
            claim = data.draw(st.sampled_from(CLAIMS))
            world.feed(ClaimUnprepareRequested(calls.new(), claim, world.now))
        elif action == "stray-report":
            # A report for a call that waits for none of its kind is refused,
            # and changes nothing: a call answered is never answered again.
            strays = {why: pairs for why, pairs in calls.strays().items() if pairs}
            why = data.draw(st.sampled_from(sorted(strays)))
            call, kind = data.draw(st.sampled_from(strays[why]))
            hypothesis.event(f"stray report: {why}, {kind}")
            report: object = ClaimFilesRemoved(call)
            if kind == "read":
                read = ClaimRead(call, (), world.now)
                report = data.draw(st.sampled_from([read, ClaimUnreadable(call, "cannot read")]))
            elif kind == "written":
                report = ClaimFilesWritten(call)
            before = (dra.prepared(), dict(world.ledger.held()))
            with pytest.raises(UsageError, match=f"call {call}, which waits for no such report"):
                world.node.handle(report)
            assert (dra.prepared(), dict(world.ledger.held())) == before
        elif action == "allocate":
            device_plugin = world.device_plugin
            resources = [r for r in device_plugin.resource_names() if device_plugin.advertised(r)]
            if not resources:
                continue
            resource = data.draw(st.sampled_from(resources))
            ids = [d.id for d in device_plugin.advertised(resource)]
            chosen = data.draw(st.lists(st.sampled_from(ids), min_size=1, max_size=2, unique=True))
            effects = world.kubelet.allocate(resource, tuple(chosen))
            assert not [e for e in effects if isinstance(e, CALL_EFFECTS)]
            if effects_of(effects, Reply):
                # A granted Allocate never takes a group a claim holds.
                claimed = {g for h in dra.holds() for g in h.groups}
                inventory = {d.id: d for d in world.node.inventory.resource(resource).devices}  # type: ignore[union-attr]
                assert not {inventory[i].iommu_group for i in chosen} & claimed
        elif action == "release":
            held = world.held_by_pods()
            keep = {
                name: frozenset(i for i in ids if data.draw(st.booleans()))
                for name, ids in held.items()
            }
            world.tick(60.0)
            world.feed(AllocationsObserved(keep, world.now))
        elif action == "health":
            groups = sorted({g.number for g in world.original.iommu_groups})
            if groups and data.draw(st.booleans()):
                gone = f"/dev/vfio/{data.draw(st.sampled_from(groups))}"
                world.host = attrs.evolve(
                    world.original, dev_nodes=world.original.dev_nodes - {gone}
                )
            else:
                world.host = world.original
            world.feed(HostObserved(world.host, world.now))
        elif action == "restart":
            before = ledger_by_group(world.ledger)
            prepared = dra.prepared()
            pods = world.held_by_pods()
            world.start(recall=True)  # the calls waiting die with dp
            world.feed(AllocationsObserved(pods, world.now))
            assert world.dra.prepared() == prepared
            assert ledger_by_group(world.ledger) == before
        world.check()
    world.drain(data)
