"""Small hand-made hosts for core tests, independent of the fixture tree."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

import attrs
from hypothesis import strategies as st

from dp_core import (
    AllocatedDevice,
    AllocateRequested,
    AllocationsObserved,
    ClaimPrepareRequested,
    ClaimRead,
    ClaimRef,
    Config,
    ConnectionClosed,
    ConnectionOpened,
    ContainerPreference,
    Effect,
    EndStream,
    HostObserved,
    HostSnapshot,
    Input,
    IommuGroup,
    KubeletStarted,
    KubeletStopped,
    Log,
    MdevDevice,
    MdevType,
    MediatedDevice,
    Naming,
    OptionsRequested,
    PciAddress,
    PciDevice,
    PciHostDevice,
    PciId,
    PermittedHostDevices,
    PreferredAllocationRequested,
    PreStartRequested,
    ReadClaim,
    Register,
    RegistrationFailed,
    RegistrationSucceeded,
    SharedDevice,
    SocketMode,
    StandardNode,
    Tick,
    Timing,
    WatchEnded,
    WatchStarted,
)

E = TypeVar("E")
T = TypeVar("T")

GPU = PciId(0x10DE, 0x1EB8)
AUDIO = PciId(0x10DE, 0x10F8)
VF = PciId(0x8086, 0x4941)
GPU_RESOURCE = "nvidia.com/T4"
VF_RESOURCE = "intel.com/qat_vf"


def pci(
    address: str,
    pci_id: PciId,
    group: int | None,
    driver: str | None = "vfio-pci",
    numa: int | None = 0,
    class_code: int = 0x030200,
) -> PciDevice:
    return PciDevice(
        address=PciAddress.parse(address),
        vendor=pci_id.vendor,
        device=pci_id.device,
        class_code=class_code,
        driver=driver,
        iommu_group=group,
        numa_node=numa,
    )


def snapshot(
    devices: list[PciDevice],
    *,
    mdev_types: tuple[MdevType, ...] = (),
    mdevs: tuple[MdevDevice, ...] = (),
    missing_nodes: tuple[str, ...] = (),
    extra_nodes: tuple[str, ...] = ("/dev/kvm", "/dev/net/tun", "/dev/vhost-net"),
) -> HostSnapshot:
    groups: dict[int, list[PciDevice]] = {}
    for device in devices:
        if device.iommu_group is not None:
            groups.setdefault(device.iommu_group, []).append(device)
    for mdev in mdevs:
        if mdev.iommu_group is not None:
            groups.setdefault(mdev.iommu_group, [])
    nodes = {"/dev/vfio/vfio", *extra_nodes}
    nodes |= {f"/dev/vfio/{number}" for number in groups}
    nodes -= set(missing_nodes)
    return HostSnapshot(
        pci_devices=devices,
        iommu_groups=[IommuGroup(n, members) for n, members in sorted(groups.items()) if members],
        mdev_types=mdev_types,
        mdevs=mdevs,
        dev_nodes=frozenset(nodes),
    )


def gpu_config(**kwargs: object) -> Config:
    return Config(
        permitted_host_devices=PermittedHostDevices(
            pci_host_devices=(
                PciHostDevice(GPU, GPU_RESOURCE),
                PciHostDevice(VF, VF_RESOURCE),
            )
        ),
        **kwargs,  # type: ignore[arg-type]
    )


def two_gpus_and_vfs() -> HostSnapshot:
    """Two T4s each grouped with an audio function, and four QAT VFs (NUMA 0 and 1)."""
    return snapshot(
        [
            pci("0000:3b:00.0", GPU, 10, numa=0),
            pci("0000:3b:00.1", AUDIO, 10, numa=0, class_code=0x040300),
            pci("0000:af:00.0", GPU, 20, numa=1),
            pci("0000:af:00.1", AUDIO, 20, numa=1, class_code=0x040300),
            pci("0000:3d:01.0", VF, 30, numa=0, class_code=0x0B4000),
            pci("0000:3d:01.1", VF, 31, numa=0, class_code=0x0B4000),
            pci("0000:3d:01.2", VF, 32, numa=1, class_code=0x0B4000),
            pci("0000:3d:01.3", VF, 33, numa=1, class_code=0x0B4000),
        ]
    )


# ---------------------------------------------------------------------------
# More hand-made hosts

QAT_GROUPED = PciId(0x8086, 0x37C9)
QAT_RESOURCE = "intel.com/qat"
NVME = PciId(0x144D, 0xA808)
BRIDGE_CLASS = 0x060400


def shared_group_host() -> HostSnapshot:
    """Two QAT VFs in one IOMMU group (40) and one alone (41), all on vfio-pci."""
    return snapshot(
        [
            pci("0000:3f:01.0", QAT_GROUPED, 40, numa=0, class_code=0x0B4000),
            pci("0000:3f:01.1", QAT_GROUPED, 40, numa=0, class_code=0x0B4000),
            pci("0000:3f:01.2", QAT_GROUPED, 41, numa=0, class_code=0x0B4000),
        ]
    )


def qat_config(**kwargs: object) -> Config:
    return Config(
        permitted_host_devices=PermittedHostDevices(
            pci_host_devices=(PciHostDevice(QAT_GROUPED, QAT_RESOURCE),)
        ),
        **kwargs,  # type: ignore[arg-type]
    )


# ---------------------------------------------------------------------------
# Driving a StandardNode


def effects_of(effects: Iterable[Effect], kind: type[E]) -> list[E]:
    return [effect for effect in effects if isinstance(effect, kind)]


def one(effects: Iterable[Effect], kind: type[E]) -> E:
    found = effects_of(effects, kind)
    assert len(found) == 1, f"expected one {kind.__name__}, got {found}"
    return found[0]


def without_logs(effects: Iterable[Effect]) -> list[Effect]:
    return [effect for effect in effects if not isinstance(effect, Log)]


def prepare_claim(
    node: StandardNode,
    call: int,
    claim: ClaimRef,
    results: Iterable[AllocatedDevice],
    now: float,
    *,
    pod_claim_name: str | None = None,
    extended_resources: Iterable[tuple[str, str]] = (),
) -> list[Effect]:
    """NodePrepareResources for `claim`, its read (`results`) fed when the node
    asks for it: the effects of both inputs, in order."""
    effects = node.handle(ClaimPrepareRequested(call, claim, now))
    if effects_of(effects, ReadClaim) == [ReadClaim(call, claim)]:
        read = ClaimRead(call, results, now, pod_claim_name, extended_resources)  # type: ignore[arg-type]
        effects += node.handle(read)
    return effects


def started_node(
    config: Config | None = None,
    host: HostSnapshot | None = None,
    *,
    mode: SocketMode = SocketMode.SINGLE,
    timing: Timing | None = None,
    now: float = 0.0,
    synced: bool = True,
) -> tuple[StandardNode, list[Effect]]:
    """A StandardNode that has seen the host and a running kubelet; returns its first effects.

    `synced`: the kubelet had been up long enough that its first PodResources
    answer (no pod holds anything) is trusted, as when dp starts under it.
    """
    node = StandardNode(
        config if config is not None else gpu_config(shared_devices=()),
        socket_mode=mode,
        timing=timing,
    )
    effects = node.handle(HostObserved(host if host is not None else two_gpus_and_vfs(), now))
    effects += node.handle(KubeletStarted(now))
    if synced:
        effects += node.handle(AllocationsObserved({}, now))
    return node, effects


class Kubelet:
    """A scripted modern kubelet: dials and asks for options inside Register.

    It is only a convenience for tests that need live resources; it numbers
    connections, calls and streams itself so the tests stay readable.
    """

    def __init__(self, node: StandardNode, now: float = 0.0) -> None:
        self.node = node
        self.now = now
        self.next_id = 1000
        self.connection_of: dict[str, int] = {}
        self.stream_of: dict[str, int] = {}

    def fresh(self) -> int:
        self.next_id += 1
        return self.next_id

    def feed(self, event: Input) -> list[Effect]:
        return self.node.handle(event)

    def register_all(self, effects: list[Effect]) -> list[Effect]:
        """Answer every Register (and the ones that follow) like a modern kubelet."""
        out: list[Effect] = []
        pending = effects_of(effects, Register)
        while pending:
            register = pending.pop(0)
            connection = self.fresh()
            produced = self.feed(
                ConnectionOpened(
                    connection, self.now, register.resource if register.own_socket else None
                )
            )
            produced += self.feed(OptionsRequested(connection, self.fresh(), self.now))
            produced += self.feed(
                RegistrationSucceeded(register.resource, register.attempt, self.now)
            )
            stream = self.fresh()
            produced += self.feed(WatchStarted(connection, stream, self.now))
            self.connection_of[register.resource] = connection
            self.stream_of[register.resource] = stream
            out += produced
            pending += effects_of(produced, Register)
        return out

    def allocate(self, resource: str, *containers: tuple[str, ...]) -> list[Effect]:
        return self.feed(
            AllocateRequested(self.connection_of[resource], self.fresh(), containers, self.now)
        )


def live_node(
    config: Config | None = None,
    host: HostSnapshot | None = None,
    *,
    mode: SocketMode = SocketMode.SINGLE,
    timing: Timing | None = None,
    synced: bool = True,
) -> tuple[StandardNode, Kubelet]:
    """A StandardNode whose resources are all registered, bound and watched."""
    node, effects = started_node(config, host, mode=mode, timing=timing, synced=synced)
    kubelet = Kubelet(node)
    kubelet.register_all(effects)
    return node, kubelet


# ---------------------------------------------------------------------------
# Hypothesis: small generated hosts and configs

PCI_IDS = (GPU, AUDIO, VF, QAT_GROUPED, NVME)
PCI_NAMES = {GPU: "TU104GL [Tesla T4]", VF: "C62x Chipset QuickAssist Technology VF"}
MDEV_TYPE_NAMES = ("GRID T4-1Q", "GRID T4-2Q")
SHARED_CHOICES = (
    ("devices.kubevirt.io/kvm", "/dev/kvm"),
    ("devices.kubevirt.io/tun", "/dev/net/tun"),
    ("example.org/" + "s" * 63, "/dev/vhost-net"),
)
_DRIVERS = ["vfio-pci"] * 6 + [None, "nvidia", "snd_hda_intel"]
_CLASS_OF = {GPU: 0x030200, AUDIO: 0x040300, VF: 0x0B4000, QAT_GROUPED: 0x0B4000, NVME: 0x010802}


@st.composite
def host_snapshots(draw: st.DrawFn, max_groups: int = 5, min_groups: int = 0) -> HostSnapshot:
    """A small host: a few IOMMU groups of 1-3 functions, maybe mdevs, maybe missing nodes."""
    devices: list[PciDevice] = []
    group_numbers: list[int] = []
    for index in range(draw(st.integers(min_groups, max_groups))):
        group = None if draw(st.integers(0, 9)) == 0 else 10 + index
        if group is not None:
            group_numbers.append(group)
        members = draw(st.sampled_from([1, 2, 2, 3]))
        bridged = members > 1 and draw(st.integers(0, 3)) == 0
        # Half the groups are like SR-IOV VFs or multi-port cards: one ID throughout.
        same_id = draw(st.sampled_from(PCI_IDS)) if draw(st.booleans()) else None
        for function in range(members):
            pci_id = same_id or draw(st.sampled_from(PCI_IDS))
            is_bridge = bridged and function == 0
            devices.append(
                pci(
                    f"0000:{index + 1:02x}:00.{function}",
                    pci_id,
                    group,
                    driver=draw(st.sampled_from(_DRIVERS)),
                    numa=draw(st.sampled_from([None, 0, 1])),
                    class_code=BRIDGE_CLASS if is_bridge else _CLASS_OF[pci_id],
                )
            )
    parent = PciAddress.parse("0000:3b:00.0")
    mdev_types = tuple(MdevType(parent, f"nvidia-{i}", n) for i, n in enumerate(MDEV_TYPE_NAMES))
    mdevs = []
    for index in range(draw(st.integers(0, 3))):
        group = None if draw(st.integers(0, 9)) == 0 else 100 + index
        if group is not None:
            group_numbers.append(group)
        mdevs.append(
            MdevDevice(
                f"00000000-0000-4000-8000-{index:012d}",
                parent,
                f"nvidia-{draw(st.integers(0, len(MDEV_TYPE_NAMES) - 1))}",
                group,
            )
        )
    candidates = ["/dev/vfio/vfio", "/dev/kvm", "/dev/net/tun"]
    candidates += [f"/dev/vfio/{g}" for g in group_numbers]
    missing = [path for path in candidates if draw(st.integers(0, 15)) == 0]
    return snapshot(
        devices, mdev_types=mdev_types, mdevs=tuple(mdevs), missing_nodes=tuple(missing)
    )


@st.composite
def configs(draw: st.DrawFn) -> Config:
    shared = tuple(
        SharedDevice(name, path, draw(st.integers(1, 4)), enabled=draw(st.booleans()))
        for name, path in SHARED_CHOICES
        if draw(st.booleans())
    )
    naming = Naming(source=draw(st.sampled_from(["vendor-device", "pci-ids"])))
    if draw(st.booleans()):
        return Config(None, shared, naming)
    pci_entries = tuple(
        PciHostDevice(
            pci_id,
            draw(st.sampled_from([None, "example.com/pci-a", "example.com/pci-b"])),
            # Absent or true: dp's; false (one in six): virt-handler's.
            external_resource_provider=draw(st.sampled_from([None, None, None, None, True, False])),
        )
        for pci_id in PCI_IDS
        if draw(st.integers(0, 3))
    )
    mdev_entries = tuple(
        MediatedDevice(name, draw(st.sampled_from([None, "example.com/mdev"])))
        for name in MDEV_TYPE_NAMES
        if draw(st.booleans())
    )
    return Config(PermittedHostDevices(pci_entries, mdev_entries), shared, naming)


# ---------------------------------------------------------------------------
# Hypothesis: a kubelet (and host) doing random things to a StandardNode

RPC_INPUTS = (
    OptionsRequested,
    AllocateRequested,
    PreferredAllocationRequested,
    PreStartRequested,
)
ACTIONS = (
    "dial",
    "dial",
    "open",
    "succeed",
    "succeed",
    "fail",
    "stale",
    "close",
    "options",
    "watch",
    "watch_end",
    "allocate",
    "allocate",
    "allocate",
    "preferred",
    "prestart",
    "observe",
    "tick",
    "restart",
    "stop",
    "rescan",
)


class RandomKubelet:
    """Feeds a StandardNode inputs chosen from its current state, recording them.

    Time only moves forward. `containers` is the largest number of container
    requests one Allocate carries (the kubelet sends one).
    """

    def __init__(
        self,
        node: StandardNode,
        host: HostSnapshot,
        data: st.DataObject,
        *,
        containers: int = 1,
    ) -> None:
        self.node = node
        self.host = host
        self.data = data
        self.containers = containers
        self.now = 0.0
        self.next_id = 0
        self.inputs: list[Input] = []
        self.outstanding: list[Register] = []
        self.answered: list[Register] = []
        self.connections: list[int] = []
        self.streams: list[int] = []
        self.kubelet_up = True

    def draw(self, strategy: st.SearchStrategy[T]) -> T:
        return self.data.draw(strategy)

    def fresh(self) -> int:
        self.next_id += 1
        return self.next_id

    def feed(self, event: Input) -> list[Effect]:
        self.inputs.append(event)
        effects = self.node.handle(event)
        self.outstanding += effects_of(effects, Register)
        for end in effects_of(effects, EndStream):
            if end.stream in self.streams:
                self.streams.remove(end.stream)
        return effects

    def start(self) -> Iterator[tuple[Input, list[Effect]]]:
        for event in (HostObserved(self.host, 0.0), KubeletStarted(0.0)):
            yield event, self.feed(event)

    def step(self) -> Iterator[tuple[Input, list[Effect]]]:
        """Do one random thing; yields each input fed with its effects, the
        next fed only once the caller has had it (and could check the node)."""
        self.now += self.draw(st.sampled_from([0.0, 0.0, 0.05, 0.5, 3.0, 11.0, 31.0]))
        action = self.draw(st.sampled_from(ACTIONS))
        for event in self._events(action):
            yield event, self.feed(event)

    def _events(self, action: str) -> list[Input]:
        now = self.now
        names = list(self.node.device_plugin.resource_names())
        if action in ("succeed", "fail") and self.outstanding:
            register = self.outstanding.pop(self.draw(st.integers(0, len(self.outstanding) - 1)))
            self.answered.append(register)
            if action == "succeed":
                return [RegistrationSucceeded(register.resource, register.attempt, now)]
            return [RegistrationFailed(register.resource, register.attempt, "refused", now)]
        if action == "stale" and self.answered:
            register = self.draw(st.sampled_from(self.answered))
            return [RegistrationSucceeded(register.resource, register.attempt, now)]
        if action in ("dial", "open"):
            connection = self.fresh()
            self.connections.append(connection)
            listener = None
            if self.node.device_plugin.socket_mode is SocketMode.PER_RESOURCE and names:
                pending = [r.resource for r in self.outstanding] or names
                listener = self.draw(st.sampled_from(pending))
            events: list[Input] = [ConnectionOpened(connection, now, listener)]
            if action == "dial":
                events.append(OptionsRequested(connection, self.fresh(), now))
            return events
        if action == "close" and self.connections:
            connection = self.connections.pop(self.draw(st.integers(0, len(self.connections) - 1)))
            return [ConnectionClosed(connection, now)]
        if action == "watch_end" and self.streams:
            return [WatchEnded(self.streams.pop())]
        if action == "observe":
            held = {}
            for allocation in self.node.device_plugin.allocations.all():
                kept = [i for i in allocation.device_ids if self.draw(st.booleans())]
                held.setdefault(allocation.resource, set()).update(kept)
            return [AllocationsObserved({k: frozenset(v) for k, v in held.items()}, now)]
        if action == "tick":
            return [Tick(now)]
        if action == "restart":
            # Register calls in flight still end, one way or the other, as a
            # real shell reports every call it made.
            return [KubeletStopped(now), KubeletStarted(now)]
        if action == "stop":
            return [KubeletStopped(now)]
        if action == "rescan":
            nodes = sorted(self.host.dev_nodes)
            dropped = {path for path in nodes if self.draw(st.integers(0, 5)) == 0}
            return [HostObserved(attrs.evolve(self.host, dev_nodes=set(nodes) - dropped), now)]
        if action in ("options", "watch", "allocate", "preferred", "prestart"):
            return [self._rpc(action, now)]
        return [Tick(now)]

    def _rpc(self, action: str, now: float) -> Input:
        # Mostly a connection that serves a resource; now and then any other.
        owned = [
            c for c in self.connections if self.node.device_plugin.registrar.owner(c) is not None
        ]
        choice = self.draw(st.integers(0, 7))
        if owned and choice > 1:
            connection = self.draw(st.sampled_from(owned))
        elif self.connections and choice == 1:
            connection = self.draw(st.sampled_from(self.connections))
        else:
            connection = 10_000 + self.fresh()
        call = self.fresh()
        if action == "options":
            return OptionsRequested(connection, call, now)
        if action == "watch":
            self.streams.append(call)
            return WatchStarted(connection, call, now)
        owner = self.node.device_plugin.registrar.owner(connection)
        pool = [d.id for d in self.node.device_plugin.advertised(owner)] if owner else []
        pool.append("no-such-device")
        if action == "prestart":
            return PreStartRequested(connection, call, self._ids(pool), now)
        if action == "preferred":
            available = tuple(dict.fromkeys(self._ids(pool, 0, 4)))
            must = tuple(i for i in available if self.draw(st.integers(0, 3)) == 0)
            size = len(must) + self.draw(st.integers(0, 3))
            return PreferredAllocationRequested(
                connection, call, [ContainerPreference(available, must, size)], now
            )
        count = self.draw(st.integers(1, self.containers))
        return AllocateRequested(connection, call, [self._ids(pool) for _ in range(count)], now)

    def _ids(self, pool: list[str], low: int = 1, high: int = 3) -> tuple[str, ...]:
        # Mostly real IDs; the sentinel and duplicates now and then.
        weighted = st.sampled_from(pool[:-1]) if len(pool) > 1 else st.just(pool[-1])
        one_id = st.one_of(weighted, weighted, weighted, st.sampled_from(pool))
        return tuple(self.draw(st.lists(one_id, min_size=low, max_size=high)))
