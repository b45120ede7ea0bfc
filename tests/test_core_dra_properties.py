"""Both front ends on one ledger, driven at random (hypothesis).

Random interleavings of DRA prepare and unprepare, device-plugin Allocates,
PodResources answers that release pods, health changes (a group's node gone
and back) and restarts (a new StandardNode given the checkpoint and what pods hold)
over generated hosts. Invariants: no IOMMU group is ever held by two holders,
every prepared claim holds its groups, a restart rebuilds the same ledger, and
the pool never offers, unmarked, a device the scheduler could give a second
holder of its group, and the pool kept as holders change is the pool worked
out afresh.
"""

from __future__ import annotations

import attrs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dp_core import (
    AllocationsObserved,
    Config,
    HostObserved,
    HostSnapshot,
    KubeletStarted,
    MediatedDevice,
    PciHostDevice,
    PermittedHostDevices,
    Reply,
    StandardNode,
)
from dp_core.config import Dra
from dp_core.dra.claims import ClaimRef
from dp_core.dra.effects import ClaimPrepared, ClaimRefused, ClaimsChanged
from dp_core.dra.inputs import (
    AllocatedDevice,
    ClaimPrepareRequested,
    ClaimsRecalled,
    ClaimUnprepareRequested,
)
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


def ledger(node: StandardNode) -> dict[int, tuple[str, str]]:
    """Group -> who holds it: ("claim", UID) or ("pod", resource)."""
    found = {}
    for group, holder in node.ledger.held().items():
        claim = getattr(holder, "claim", None)
        found[group] = ("claim", claim.uid) if claim else ("pod", holder.owner)
    return found


def check_one_holder_per_group(node: StandardNode) -> None:
    reserved = node.ledger.held()
    holders = [*node.device_plugin.allocations.all(), *node.dra.holds()]
    seen: dict[int, object] = {}
    for holder in holders:
        for group in holder.groups:
            assert group not in seen, f"group {group} held by {seen[group]} and {holder}"
            seen[group] = holder
            assert reserved[group] is holder, f"group {group}: the index names another holder"
    assert set(seen) == set(reserved)
    prepared = {p.claim.uid: p for p in node.dra.prepared()}
    assert {h.claim.uid for h in node.dra.holds()} == set(prepared)


def check_the_pool_never_offers_a_split(node: StandardNode) -> None:
    """Each device the pool offers without a NoSchedule taint can be allocated
    without splitting a held group, as the scheduler sees it: its group is
    free, or held through it, or held by a claim through a member that
    consumes the same counter (which the scheduler counts)."""
    pool = node.dra.pool
    if pool is None:
        return
    reserved = node.ledger.held()
    groups = {d.name: d.iommu_group for d in node.dra.devices()}
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


def check_the_pool_is_as_worked_out_afresh(node: StandardNode) -> None:
    """The front end works the pool out again only for groups whose holder
    changed; it must be what the whole pool worked out from scratch is."""
    if node.dra.pool is None:
        return
    options = PoolOptions(DRIVER, NODE, node.dra.partitionable, node.dra.device_taints)
    assert node.dra.pool == pool_content(node.dra.devices(), node.ledger.held(), options)


class World:
    """A node, its kubelet for the device plugin, and what pods hold."""

    def __init__(self, config: Config, host: HostSnapshot, partitionable: bool) -> None:
        self.config = config
        self.original = host
        self.host = host
        self.partitionable = partitionable
        self.now = 0.0
        self.call = 0
        self.checkpoint: tuple[object, ...] = ()
        self.start(recall=False)

    def start(self, *, recall: bool) -> None:
        self.node = StandardNode(self.config, node_name=NODE, dra_partitionable=self.partitionable)
        if recall:
            self.node.handle(ClaimsRecalled(self.checkpoint))  # type: ignore[arg-type]
        effects = self.node.handle(HostObserved(self.host, self.now))
        effects += self.node.handle(KubeletStarted(self.now))
        self.kubelet = Kubelet(self.node, self.now)
        self.kubelet.register_all(effects)

    def tick(self, seconds: float = 1.0) -> None:
        self.now += seconds
        self.kubelet.now = self.now

    def feed(self, event: object) -> list[object]:
        effects = self.node.handle(event)  # type: ignore[arg-type]
        for changed in effects_of(effects, ClaimsChanged):
            self.checkpoint = changed.prepared
        return effects  # type: ignore[return-value]

    def held_by_pods(self) -> dict[str, frozenset[str]]:
        held: dict[str, set[str]] = {}
        for allocation in self.node.device_plugin.allocations.all():
            held.setdefault(allocation.resource, set()).update(allocation.device_ids)
        return {name: frozenset(ids) for name, ids in held.items()}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    host=host_snapshots(max_groups=5, min_groups=1),
    config=split_configs(),
    partitionable=st.booleans(),
    data=st.data(),
)
def test_no_group_has_two_holders_and_a_restart_rebuilds_the_ledger(
    host: HostSnapshot, config: Config, partitionable: bool, data: st.DataObject
) -> None:
    world = World(config, host, partitionable)
    actions = data.draw(
        st.lists(
            st.sampled_from(
                [
                    "prepare",
                    "prepare",
                    "unprepare",
                    "allocate",
                    "allocate",
                    "release",
                    "health",
                    "restart",
                ]
            ),
            max_size=25,
        )
    )
    for action in actions:
        world.tick()
        node = world.node
        if action == "prepare":
            claim = data.draw(st.sampled_from(CLAIMS))
            names = [d.name for d in node.dra.devices()] + ["pci-0000-ff-00-0"]
            chosen = data.draw(
                st.lists(st.sampled_from(names), min_size=1, max_size=2, unique=True)
            )
            results = [AllocatedDevice(f"r{i}", DRIVER, NODE, n) for i, n in enumerate(chosen)]
            before = {p.claim.uid: p for p in node.dra.prepared()}
            world.call += 1
            effects = world.feed(ClaimPrepareRequested(world.call, claim, results, world.now))
            answered = effects_of(effects, ClaimPrepared) + effects_of(effects, ClaimRefused)
            assert len(answered) == 1
            if claim.uid in before:  # idempotent: the same answer, whatever it asks now
                assert effects_of(effects, ClaimPrepared)[0].prepared == before[claim.uid]
        elif action == "unprepare":
            world.call += 1
            world.feed(
                ClaimUnprepareRequested(world.call, data.draw(st.sampled_from(CLAIMS)), world.now)
            )
        elif action == "allocate":
            resources = [
                r for r in node.device_plugin.resource_names() if node.device_plugin.advertised(r)
            ]
            if not resources:
                continue
            resource = data.draw(st.sampled_from(resources))
            ids = [d.id for d in node.device_plugin.advertised(resource)]
            chosen = data.draw(st.lists(st.sampled_from(ids), min_size=1, max_size=2, unique=True))
            effects = world.kubelet.allocate(resource, tuple(chosen))
            if effects_of(effects, Reply):
                # A granted Allocate never takes a group a claim holds.
                claimed = {g for h in node.dra.holds() for g in h.groups}
                inventory = {d.id: d for d in node.inventory.resource(resource).devices}  # type: ignore[union-attr]
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
            before = ledger(node)
            prepared = node.dra.prepared()
            pods = world.held_by_pods()
            world.start(recall=True)
            world.feed(AllocationsObserved(pods, world.now))
            assert world.node.dra.prepared() == prepared
            assert ledger(world.node) == before
        check_one_holder_per_group(world.node)
        check_the_pool_never_offers_a_split(world.node)
        check_the_pool_is_as_worked_out_afresh(world.node)
