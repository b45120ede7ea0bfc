"""Small hand-made hosts for core tests, independent of the fixture tree."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from dp_core import (
    AllocateRequested,
    Config,
    ConnectionOpened,
    Effect,
    HostObserved,
    HostSnapshot,
    Input,
    IommuGroup,
    KubeletStarted,
    Log,
    MdevDevice,
    MdevType,
    Node,
    OptionsRequested,
    PciAddress,
    PciDevice,
    PciHostDevice,
    PciId,
    PermittedHostDevices,
    Register,
    RegistrationSucceeded,
    SocketMode,
    Timing,
    WatchStarted,
)

E = TypeVar("E")

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
# Driving a Node


def effects_of(effects: Iterable[Effect], kind: type[E]) -> list[E]:
    return [effect for effect in effects if isinstance(effect, kind)]


def one(effects: Iterable[Effect], kind: type[E]) -> E:
    found = effects_of(effects, kind)
    assert len(found) == 1, f"expected one {kind.__name__}, got {found}"
    return found[0]


def without_logs(effects: Iterable[Effect]) -> list[Effect]:
    return [effect for effect in effects if not isinstance(effect, Log)]


def started_node(
    config: Config | None = None,
    host: HostSnapshot | None = None,
    *,
    mode: SocketMode = SocketMode.SINGLE,
    timing: Timing | None = None,
    now: float = 0.0,
) -> tuple[Node, list[Effect]]:
    """A Node that has seen the host and a running kubelet; returns its first effects."""
    node = Node(
        config if config is not None else gpu_config(shared_devices=()),
        socket_mode=mode,
        timing=timing,
    )
    effects = node.handle(HostObserved(host if host is not None else two_gpus_and_vfs(), now))
    effects += node.handle(KubeletStarted(now))
    return node, effects


class Kubelet:
    """A scripted modern kubelet: dials and asks for options inside Register.

    It is only a convenience for tests that need live resources; it numbers
    connections, calls and streams itself so the tests stay readable.
    """

    def __init__(self, node: Node, now: float = 0.0) -> None:
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
) -> tuple[Node, Kubelet]:
    """A Node whose resources are all registered, bound and watched."""
    node, effects = started_node(config, host, mode=mode, timing=timing)
    kubelet = Kubelet(node)
    kubelet.register_all(effects)
    return node, kubelet
