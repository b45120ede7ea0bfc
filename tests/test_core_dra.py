"""The DRA front end of the core: names, attributes, pool content, claims (tables)."""

from __future__ import annotations

import attrs
import pytest

from dp_core import (
    AllocationsObserved,
    Config,
    ConfigError,
    HostObserved,
    KubeletStarted,
    MdevDevice,
    MdevType,
    MediatedDevice,
    PciAddress,
    PciHostDevice,
    PciId,
    PermittedHostDevices,
    Reply,
    StandardNode,
    UsageError,
)
from dp_core.config import Dra
from dp_core.dra.claims import ClaimRef
from dp_core.dra.effects import (
    ClaimAnswered,
    ClaimPrepared,
    ClaimRefused,
    ClaimsChanged,
    ClaimUnprepared,
    PoolChanged,
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
    DraFeaturesObserved,
)
from dp_core.dra.metadata import prepared_devices, request_metadata
from dp_core.dra.names import attribute_name_error, mdev_device_name, pci_device_name
from dp_core.dra.pool_content import PoolContent, Version
from dp_core.effects import HealthChanged, Log

from core_builders import (
    AUDIO,
    GPU,
    GPU_RESOURCE,
    Kubelet,
    effects_of,
    one,
    pci,
    prepare_claim,
    snapshot,
)

DRIVER = "vfio.dp.example.com"
NODE = "worker-1"
NIC = "intel.com/nic"
NIC_ID = PciAddress.parse("0000:5e:00.0")
VGPU_UUID = "8a3b9c1e-1f7a-4c55-9d0e-2b6f4a7e8c11"
NIC_PCI = PciId(0x8086, 0x1593)


def host():
    """GPU+audio in group 10 (both DRA), GPU+audio in 20 (GPU DRA, audio on the
    device plugin), a NIC alone in 30 (DRA), and a vGPU mdev (DRA) in 40."""
    return snapshot(
        [
            pci("0000:3b:00.0", GPU, 10, numa=0),
            pci("0000:3b:00.1", AUDIO, 10, numa=0, class_code=0x040300),
            pci("0000:af:00.0", GPU, 20, numa=1),
            pci("0000:af:00.1", AUDIO, 20, numa=1, class_code=0x040300),
            pci("0000:5e:00.0", NIC_PCI, 30, numa=None, class_code=0x020000),
        ],
        mdev_types=(MdevType(PciAddress.parse("0000:3b:00.0"), "nvidia-222", "GRID T4-1Q"),),
        mdevs=(MdevDevice(VGPU_UUID, PciAddress.parse("0000:3b:00.0"), "nvidia-222", 40),),
    )


def config(*, audio_frontend: str = "device-plugin", dra: bool = True) -> Config:
    return Config(
        permitted_host_devices=PermittedHostDevices(
            pci_host_devices=(
                PciHostDevice(GPU, GPU_RESOURCE, frontend="dra"),
                PciHostDevice(AUDIO, "nvidia.com/audio", frontend=audio_frontend),  # type: ignore[arg-type]
                PciHostDevice(NIC_PCI, NIC, frontend="dra"),
            ),
            mediated_devices=(
                MediatedDevice("GRID T4-1Q", "nvidia.com/GRID_T4-1Q", frontend="dra"),
            ),
        ),
        shared_devices=(),
        dra=Dra(DRIVER) if dra else None,
    )


def started(cfg: Config | None = None, **kwargs: object) -> tuple[StandardNode, list[object]]:
    node = StandardNode(cfg or config(), node_name=NODE, **kwargs)  # type: ignore[arg-type]
    effects: list[object] = list(node.handle(HostObserved(host(), 0.0)))
    effects += node.handle(KubeletStarted(0.0))
    effects += node.handle(AllocationsObserved({}, 0.0))  # a kubelet that had synced
    return node, effects


CLAIM_A = ClaimRef("vms", "uid-a", "vm-a")
CLAIM_B = ClaimRef("vms", "uid-b", "vm-b")


def prepare(
    node: StandardNode,
    claim: ClaimRef,
    *devices: str,
    pool: str = NODE,
    call: int = 1,
    now: float = 1.0,
):
    results = [AllocatedDevice(f"req{i}", DRIVER, pool, name) for i, name in enumerate(devices)]
    return prepare_claim(node, call, claim, results, now)


def unprepare(node: StandardNode, claim: ClaimRef, call: int = 2, now: float = 2.0):
    return node.handle(ClaimUnprepareRequested(call, claim, now))


def pool_names(node: StandardNode) -> list[str]:
    assert node.dra.pool is not None
    return [d.name for d in node.dra.pool.devices]


# -- names and attributes ------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "name"),
    [
        ("0000:3b:00.0", "pci-0000-3b-00-0"),
        ("0000:af:1f.7", "pci-0000-af-1f-7"),
        ("10000:00:02.1", "pci-10000-00-02-1"),
    ],
)
def test_pci_device_name(address: str, name: str) -> None:
    assert pci_device_name(PciAddress.parse(address)) == name


@pytest.mark.parametrize(
    ("uuid", "name"),
    [
        (VGPU_UUID, f"mdev-{VGPU_UUID}"),
        (VGPU_UUID.upper(), f"mdev-{VGPU_UUID}"),
        ("not a uuid", None),
        ("a" * 60, None),
    ],
)
def test_mdev_device_name(uuid: str, name: str | None) -> None:
    assert mdev_device_name(uuid) == name


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("resource.kubernetes.io/pciBusID", True),
        ("mdevUUID", True),
        ("iommuGroup", True),
        ("x" * 33, False),
        ("Bad.Domain/name", False),
        ("example.com/9lives", False),
        ("/name", False),
    ],
)
def test_attribute_names(name: str, ok: bool) -> None:
    assert (attribute_name_error(name) is None) is ok


def test_attributes_of_a_pci_function_and_an_mdev() -> None:
    node, _ = started()
    gpu = {d.name: d for d in node.dra.devices()}["pci-0000-3b-00-0"]
    assert dict(gpu.attributes) == {
        "resource.kubernetes.io/pciBusID": "0000:3b:00.0",
        "resourceName": GPU_RESOURCE,
        "vendorID": "10de",
        "deviceID": "1eb8",
        "classID": "030200",
        "numaNode": 0,
        "iommuGroup": 10,
    }
    mdev = {d.name: d for d in node.dra.devices()}[f"mdev-{VGPU_UUID}"]
    assert dict(mdev.attributes)["mdevUUID"] == VGPU_UUID
    assert dict(mdev.attributes)["parentPciBusID"] == "0000:3b:00.0"
    assert dict(mdev.attributes)["iommuGroup"] == 40
    nic = {d.name: d for d in node.dra.devices()}["pci-0000-5e-00-0"]
    assert "numaNode" not in dict(nic.attributes)  # unknown NUMA is left out, not -1


def test_a_vf_names_its_pf() -> None:
    vf = attrs.evolve(pci("0000:5e:01.0", NIC_PCI, 31), physfn=PciAddress.parse("0000:5e:00.0"))
    node = StandardNode(config(), node_name=NODE)
    node.handle(HostObserved(snapshot([vf]), 0.0))
    (device,) = node.dra.devices()
    assert dict(device.attributes)["pfPciBusID"] == "0000:5e:00.0"


def test_a_long_resource_name_is_left_out_of_the_attributes_and_logged() -> None:
    long_name = "example.com/" + "x" * 60
    cfg = Config(
        permitted_host_devices=PermittedHostDevices(
            pci_host_devices=(PciHostDevice(NIC_PCI, long_name, frontend="dra"),)
        ),
        shared_devices=(),
        dra=Dra(DRIVER),
    )
    node, effects = started(cfg)
    (device,) = node.dra.devices()
    assert "resourceName" not in dict(device.attributes)
    logged = [e for e in effects if getattr(e, "event", "") == "dra-device-problem"]
    assert len(logged) == 1 and "longer than 64" in str(logged[0].fields)  # type: ignore[attr-defined]


# -- which front end offers what ------------------------------------------------------


def test_devices_go_to_exactly_one_front_end() -> None:
    node, _ = started()
    assert node.device_plugin.resource_names() == ("nvidia.com/audio",)
    assert [d.id for d in node.device_plugin.advertised("nvidia.com/audio")] == [
        "0000:3b:00.1",
        "0000:af:00.1",
    ]
    assert sorted(d.name for d in node.dra.devices()) == [
        f"mdev-{VGPU_UUID}",
        "pci-0000-3b-00-0",
        "pci-0000-5e-00-0",
        "pci-0000-af-00-0",
    ]
    skipped = {s.id: s.reason for s in node.inventory.skipped}
    assert "DRA front end" in skipped["0000:3b:00.0"]


def test_without_dra_there_is_no_pool() -> None:
    cfg = Config(
        permitted_host_devices=PermittedHostDevices(pci_host_devices=(PciHostDevice(GPU),)),
        shared_devices=(),
    )
    node = StandardNode(cfg)
    effects = node.handle(HostObserved(host(), 0.0))
    assert effects_of(effects, PoolChanged) == []
    assert node.dra.pool is None


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Dra("Not_A_Domain"), "is not a DNS subdomain"),
        (lambda: Dra("x" * 64 + ".com"), "is not a DNS subdomain"),
        (lambda: PciHostDevice(GPU, frontend="gpu"), "is not one of 'device-plugin', 'dra'"),
        (
            lambda: PciHostDevice(GPU, external_resource_provider=False, frontend="dra"),
            "contradict each other: KubeVirt's virt-handler serves the device",
        ),
        (lambda: config(dra=False), "frontend is dra, which needs the dra section"),
        (
            lambda: Config(
                permitted_host_devices=PermittedHostDevices(
                    pci_host_devices=(
                        PciHostDevice(GPU, "nvidia.com/gpu", frontend="dra"),
                        PciHostDevice(AUDIO, "nvidia.com/gpu"),
                    )
                ),
                dra=Dra(DRIVER),
            ),
            "on both front ends",
        ),
    ],
)
def test_config_errors(build, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=message):
        build()


# -- pool content --------------------------------------------------------------------------


def test_pool_with_counters_for_a_multi_device_group() -> None:
    node, effects = started(config(audio_frontend="dra"))
    content = one(effects, PoolChanged).content
    assert (content.driver, content.pool, content.node_name) == (DRIVER, NODE, NODE)
    assert [s.name for s in content.shared_counters] == ["iommu-group-10", "iommu-group-20"]
    assert content.shared_counters[0].counters == (("slot", 1),)
    gpu = content.device("pci-0000-3b-00-0")
    audio = content.device("pci-0000-3b-00-1")
    nic = content.device("pci-0000-5e-00-0")
    assert gpu is not None and audio is not None and nic is not None
    assert gpu.consumes_counters == audio.consumes_counters
    assert gpu.consumes_counters[0].counter_set == "iommu-group-10"
    assert nic.consumes_counters == ()


def test_pool_without_partitionable_devices_has_one_member_per_group() -> None:
    node, effects = started(config(audio_frontend="dra"), dra_partitionable=False)
    content = one(effects, PoolChanged).content
    assert content.shared_counters == ()
    assert [d.name for d in content.devices] == [
        f"mdev-{VGPU_UUID}",
        "pci-0000-3b-00-0",
        "pci-0000-5e-00-0",
        "pci-0000-af-00-0",
    ]


def test_an_unhealthy_device_leaves_the_pool_and_returns() -> None:
    node, _ = started(dra_device_taints=False)
    gone = snapshot(
        list(host().pci_devices),
        mdev_types=host().mdev_types,
        mdevs=host().mdevs,
        missing_nodes=("/dev/vfio/30",),
    )
    effects = node.handle(HostObserved(gone, 1.0))
    assert "pci-0000-5e-00-0" not in [d.name for d in one(effects, PoolChanged).content.devices]
    effects = node.handle(HostObserved(host(), 2.0))
    assert "pci-0000-5e-00-0" in [d.name for d in one(effects, PoolChanged).content.devices]
    assert node.handle(HostObserved(host(), 3.0)) == []  # nothing changed, nothing published


def test_with_device_taints_an_unhealthy_device_is_tainted_instead() -> None:
    node, _ = started(dra_device_taints=True)
    gone = snapshot(
        list(host().pci_devices),
        mdev_types=host().mdev_types,
        mdevs=host().mdevs,
        missing_nodes=("/dev/vfio/30",),
    )
    content = one(node.handle(HostObserved(gone, 1.0)), PoolChanged).content
    nic = content.device("pci-0000-5e-00-0")
    assert nic is not None
    assert [(t.key, t.effect) for t in nic.taints] == [(f"{DRIVER}/unhealthy", "NoSchedule")]


# -- what the API server keeps (DraFeaturesObserved) ----------------------------------------

NIC_GONE = ("/dev/vfio/30",)  # the NIC (group 30) turns unhealthy
# With counters, each group of two offered functions has a device for all of it.
ALL_MEMBERS = [
    "iommu-group-10",
    "iommu-group-20",
    f"mdev-{VGPU_UUID}",
    "pci-0000-3b-00-0",
    "pci-0000-3b-00-1",
    "pci-0000-af-00-0",
    "pci-0000-af-00-1",
]
ONE_PER_GROUP = [f"mdev-{VGPU_UUID}", "pci-0000-3b-00-0", "pci-0000-af-00-0"]


def unhealthy_nic_host():
    return snapshot(
        list(host().pci_devices),
        mdev_types=host().mdev_types,
        mdevs=host().mdevs,
        missing_nodes=NIC_GONE,
    )


def features_node(partitionable: object = "auto", taints: object = "auto") -> StandardNode:
    cfg = attrs.evolve(
        config(audio_frontend="dra"),
        dra=Dra(DRIVER, partitionable_devices=partitionable, device_taints=taints),  # type: ignore[arg-type]
    )
    node, _ = started(cfg)
    node.handle(HostObserved(unhealthy_nic_host(), 0.5))
    return node


def pool_summary(node: StandardNode) -> tuple[list[str], list[str], dict[str, list[str]]]:
    """(device names but the NIC, counter sets, the NIC's taint keys or absent)."""
    pool = node.dra.pool
    assert pool is not None
    names = [d.name for d in pool.devices if d.name != "pci-0000-5e-00-0"]
    nic = pool.device("pci-0000-5e-00-0")
    taints = {"nic": [t.key for t in nic.taints]} if nic is not None else {}
    return names, [c.name for c in pool.shared_counters], taints


COUNTERS = ["iommu-group-10", "iommu-group-20"]
TAINTED = {"nic": [f"{DRIVER}/unhealthy"]}


@pytest.mark.parametrize(
    ("partitionable", "taints", "observed", "changed", "pool", "log"),
    [
        # auto: the rich pool until the API server drops a feature's fields.
        ("auto", "auto", DraFeaturesObserved(), False, (ALL_MEMBERS, COUNTERS, TAINTED), None),
        (
            "auto",
            "auto",
            DraFeaturesObserved(partitionable=False),
            True,
            (ONE_PER_GROUP, [], TAINTED),
            "the API server dropped sharedCounters (DRAPartitionableDevices is off): "
            "publishing one device per multi-device IOMMU group",
        ),
        (
            "auto",
            "auto",
            DraFeaturesObserved(device_taints=False),
            True,
            (ALL_MEMBERS, COUNTERS, {}),
            "the API server dropped device taints (DRADeviceTaints is off): leaving unhealthy "
            "devices",
        ),
        (
            "auto",
            "auto",
            DraFeaturesObserved(partitionable=False, device_taints=False),
            True,
            (ONE_PER_GROUP, [], {}),
            "the API server dropped",
        ),
        (
            "auto",
            "auto",
            DraFeaturesObserved(partitionable=True, device_taints=True),
            False,
            (ALL_MEMBERS, COUNTERS, TAINTED),
            "the API server kept",
        ),
        # The operator's word wins over what is observed.
        (
            True,
            True,
            DraFeaturesObserved(partitionable=False, device_taints=False),
            False,
            (ALL_MEMBERS, COUNTERS, TAINTED),
            "dra.partitionableDevices is true, so dp keeps publishing them",
        ),
        (False, False, DraFeaturesObserved(), False, (ONE_PER_GROUP, [], {}), None),
        (False, "auto", DraFeaturesObserved(), False, (ONE_PER_GROUP, [], TAINTED), None),
        # A server that refuses the dry run: what was not seen counts as absent.
        (
            "auto",
            "auto",
            DraFeaturesObserved(unknown="400 BadRequest: a webhook refuses dry runs"),
            True,
            (ONE_PER_GROUP, [], {}),
            "cannot ask the API server whether it has DRAPartitionableDevices (400 BadRequest: "
            "a webhook refuses dry runs): taking it as off",
        ),
        (
            True,
            "auto",
            DraFeaturesObserved(unknown="403 Forbidden"),
            True,
            (ALL_MEMBERS, COUNTERS, {}),
            "dra.partitionableDevices decides",
        ),
    ],
)
def test_the_pool_follows_what_the_api_server_keeps(
    partitionable: object,
    taints: object,
    observed: DraFeaturesObserved,
    changed: bool,
    pool: tuple[list[str], list[str], dict[str, list[str]]],
    log: str | None,
) -> None:
    node = features_node(partitionable, taints)
    effects = node.handle(observed)
    assert len(effects_of(effects, PoolChanged)) == (1 if changed else 0)
    assert pool_summary(node) == pool
    details = [str(dict(e.fields).get("detail")) for e in effects_of(effects, Log)]
    if log is None:
        assert details == []
    else:
        assert any(log in d for d in details), details
    # The same finding again changes nothing and says nothing.
    assert node.handle(observed) == []


def test_a_finding_after_an_unknown_is_logged_and_followed() -> None:
    node = features_node()
    node.handle(DraFeaturesObserved(unknown="400 BadRequest"))
    assert pool_summary(node) == (ONE_PER_GROUP, [], {})
    effects = node.handle(DraFeaturesObserved(partitionable=False, device_taints=True))
    details = [str(dict(e.fields).get("detail")) for e in effects_of(effects, Log)]
    # Both are logged: absent was a guess, and now it is known.
    assert any("dropped sharedCounters" in d for d in details), details
    assert any("kept device taints" in d for d in details), details
    assert pool_summary(node) == (ONE_PER_GROUP, [], TAINTED)


def test_a_finding_is_logged_once_and_kept_across_rebuilds() -> None:
    node = features_node()
    effects = node.handle(DraFeaturesObserved(partitionable=False))
    (warning,) = effects_of(effects, Log)
    assert (warning.level, warning.event) == ("warning", "dra-feature-missing")
    assert dict(warning.fields)["feature"] == "DRAPartitionableDevices"
    # A rescan rebuilds the pool in the mode found, and a write that sent no
    # counters (None) does not undo the finding.
    node.handle(HostObserved(host(), 1.0))
    assert node.handle(DraFeaturesObserved(partitionable=None, device_taints=None)) == []
    assert node.dra.pool is not None and node.dra.pool.shared_counters == ()
    assert [d.name for d in node.dra.pool.devices] == sorted([*ONE_PER_GROUP, "pci-0000-5e-00-0"])


def test_features_observed_without_dra_is_nothing_to_publish() -> None:
    node, _ = started(Config(shared_devices=()))
    effects = node.handle(DraFeaturesObserved(partitionable=False))
    assert effects_of(effects, PoolChanged) == []


# -- claims -----------------------------------------------------------------------------------


def test_prepare_holds_the_group_and_unprepare_frees_it_at_once() -> None:
    node, _ = started()
    effects = prepare(node, CLAIM_A, "pci-0000-af-00-0")
    prepared = one(effects, ClaimPrepared).prepared
    assert prepared.groups == (20,)
    (device,) = prepared.devices
    assert [(d.container_path, d.permissions) for d in device.edits.devices] == [
        ("/dev/vfio/vfio", "mrw"),
        ("/dev/vfio/20", "mrw"),
    ]
    assert one(effects, ClaimsChanged).prepared == (prepared,)
    # The audio sibling on the device-plugin front end turns Unhealthy, naming the claim.
    change = one(effects, HealthChanged)
    assert (change.device_id, change.healthy) == ("0000:af:00.1", False)
    assert "claim vms/vm-a (UID uid-a)" in change.reason
    effects = unprepare(node, CLAIM_A)
    assert one(effects, ClaimUnprepared).prepared == prepared
    assert one(effects, ClaimsChanged).prepared == ()
    assert one(effects, HealthChanged).healthy is True
    assert node.ledger.held() == {}


def test_a_claim_is_answered_once_its_files_are_written() -> None:
    node, _ = started()
    effects = prepare(node, CLAIM_A, "pci-0000-af-00-0", call=7)
    prepared = one(effects, ClaimPrepared).prepared
    assert effects_of(effects, ClaimAnswered) == []  # not before its files are in place
    answered = node.handle(ClaimFilesWritten(7))
    assert answered == [ClaimAnswered(7, CLAIM_A, prepared_devices(DRIVER, prepared))]
    assert node.ledger.holder(20).claim == CLAIM_A  # type: ignore[union-attr]
    effects = unprepare(node, CLAIM_A, call=8)
    assert effects_of(effects, ClaimAnswered) == []
    assert node.ledger.held() == {}  # free at once, files or not
    assert node.handle(ClaimFilesRemoved(8)) == [ClaimAnswered(8, CLAIM_A)]


def test_a_claim_whose_files_cannot_be_written_is_let_go_before_it_is_answered() -> None:
    node, _ = started()
    prepared = one(prepare(node, CLAIM_A, "pci-0000-af-00-0", call=7), ClaimPrepared).prepared
    effects = node.handle(ClaimFilesWritten(7, "cannot write /var/run/cdi/x.json: No space"))
    # Nothing stays held for a claim the kubelet is told failed: its files go first.
    assert one(effects, ClaimUnprepared) == ClaimUnprepared(7, CLAIM_A, prepared)
    assert one(effects, ClaimsChanged).prepared == ()
    assert one(effects, HealthChanged).healthy is True  # the audio sibling is free again
    assert effects_of(effects, ClaimAnswered) == []
    assert node.ledger.held() == {} and node.dra.prepared() == ()
    (answer,) = node.handle(ClaimFilesRemoved(7, "no such directory"))
    assert answer == ClaimAnswered(
        7,
        CLAIM_A,
        error="claim vms/vm-a (UID uid-a): its CDI files could not be written: "
        "cannot write /var/run/cdi/x.json: No space",
    )


def test_a_claim_prepared_before_stays_held_when_its_files_fail_again() -> None:
    node, _ = started()
    prepare(node, CLAIM_A, "pci-0000-af-00-0", call=7)
    node.handle(ClaimFilesWritten(7))
    again = prepare(node, CLAIM_A, "pci-0000-af-00-0", call=9, now=2.0)
    assert [type(e) for e in again] == [ClaimPrepared]
    (answer,) = node.handle(ClaimFilesWritten(9, "read-only file system"))
    assert answer.error.endswith("its CDI files could not be written: read-only file system")
    assert node.ledger.holder(20).claim == CLAIM_A  # type: ignore[union-attr]


def test_an_unprepare_whose_files_cannot_be_removed_says_so_and_frees_the_group() -> None:
    node, _ = started()
    prepare(node, CLAIM_A, "pci-0000-af-00-0", call=7)
    node.handle(ClaimFilesWritten(7))
    unprepare(node, CLAIM_A, call=8)
    (answer,) = node.handle(ClaimFilesRemoved(8, "permission denied"))
    assert answer == ClaimAnswered(
        8,
        CLAIM_A,
        error="claim vms/vm-a (UID uid-a): its CDI files could not be removed: permission denied",
    )
    assert node.ledger.held() == {}


@pytest.mark.parametrize(
    "report", [ClaimFilesWritten(3), ClaimFilesRemoved(3)], ids=["written", "removed"]
)
def test_a_files_report_for_a_call_that_asked_for_none_is_the_shells_mistake(
    report: object,
) -> None:
    node, _ = started()
    with pytest.raises(UsageError, match="call 3, which waits for no such report"):
        node.handle(report)  # type: ignore[arg-type]
    prepare(node, CLAIM_A, "pci-0000-af-00-0", call=3)
    with pytest.raises(UsageError):
        node.handle(ClaimFilesRemoved(3))  # it waits for its files to be written


def read(call: int, *devices: str, now: float = 1.5) -> ClaimRead:
    results = [AllocatedDevice(f"req{i}", DRIVER, NODE, name) for i, name in enumerate(devices)]
    return ClaimRead(call, results, now)


def reads_waiting(node: StandardNode) -> float:
    (gauge,) = [f for f in node.dra.metrics() if f.name == "dp_dra_claim_reads_waiting"]
    (sample,) = gauge.samples
    return sample.value


def test_a_claim_not_prepared_is_read_first_and_nothing_is_held_meanwhile() -> None:
    node, _ = started()
    assert node.handle(ClaimPrepareRequested(7, CLAIM_A, 1.0)) == [ReadClaim(7, CLAIM_A)]
    assert node.ledger.held() == {} and node.dra.prepared() == ()
    assert reads_waiting(node) == 1
    effects = node.handle(read(7, "pci-0000-af-00-0"))
    prepared = one(effects, ClaimPrepared).prepared
    assert (prepared.claim, prepared.groups) == (CLAIM_A, (20,))
    assert one(effects, ClaimsChanged).prepared == (prepared,)
    assert reads_waiting(node) == 0
    assert node.handle(ClaimFilesWritten(7)) == [
        ClaimAnswered(7, CLAIM_A, prepared_devices(DRIVER, prepared))
    ]


def test_a_claim_prepared_already_is_answered_without_a_read() -> None:
    node, _ = started()
    prepared = one(prepare(node, CLAIM_A, "pci-0000-af-00-0", call=7), ClaimPrepared).prepared
    node.handle(ClaimFilesWritten(7))
    # The API server may be away: the node answers from what it holds.
    assert node.handle(ClaimPrepareRequested(8, CLAIM_A, 2.0)) == [ClaimPrepared(8, prepared)]
    assert node.handle(ClaimFilesWritten(8)) == [
        ClaimAnswered(8, CLAIM_A, prepared_devices(DRIVER, prepared))
    ]


def test_a_claim_that_could_not_be_read_is_refused_by_the_core_and_nothing_is_released() -> None:
    node, _ = started()
    prepare(node, CLAIM_A, "pci-0000-af-00-0", call=1)
    node.handle(ClaimFilesWritten(1))
    node.handle(ClaimPrepareRequested(2, CLAIM_B, 2.0))
    problem = "cannot read claim vms/vm-b (UID uid-b): the API server is unavailable"
    effects = node.handle(ClaimUnreadable(2, problem))
    assert effects == [
        ClaimRefused(2, CLAIM_B, problem, "ClaimUnreadable"),
        Log.warning("claim-refused", claim="vms/vm-b", uid="uid-b", reason=problem),
    ]
    assert node.ledger.holder(20).claim == CLAIM_A  # type: ignore[union-attr]
    assert [p.claim for p in node.dra.prepared()] == [CLAIM_A]
    assert reads_waiting(node) == 0


def test_a_claim_that_could_not_be_read_needs_the_reason() -> None:
    with pytest.raises(ValueError, match="needs the problem it met"):
        ClaimUnreadable(1, "")


def test_reads_continued_in_another_order_than_asked_are_judged_in_theirs() -> None:
    """Two claims on one IOMMU group: the one whose read is handed over first
    gets the group, whichever was asked for first."""
    node, _ = started(config(audio_frontend="dra"))
    node.handle(ClaimPrepareRequested(1, CLAIM_A, 1.0))
    node.handle(ClaimPrepareRequested(2, CLAIM_B, 1.0))
    assert reads_waiting(node) == 2
    assert effects_of(node.handle(read(2, "pci-0000-3b-00-1")), ClaimPrepared)
    refused = one(node.handle(read(1, "pci-0000-3b-00-0")), ClaimRefused)
    assert (refused.call, refused.claim, refused.reason) == (1, CLAIM_A, "IOMMUGroupHeld")
    assert "held by claim vms/vm-b (UID uid-b)" in refused.error
    assert node.ledger.holder(10).claim == CLAIM_B  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "second",
    [read(2, "pci-0000-3b-00-0"), ClaimUnreadable(2, "cannot read claim vms/vm-a: timed out")],
    ids=["read", "unreadable"],
)
def test_a_claim_prepared_by_another_call_while_it_was_read_is_answered_from_what_is_held(
    second: ClaimRead | ClaimUnreadable,
) -> None:
    """The kubelet asked twice (its first call timed out): the second read is
    not needed, whatever it says, and the claim is not this call's to let go."""
    node, _ = started()
    node.handle(ClaimPrepareRequested(1, CLAIM_A, 1.0))
    node.handle(ClaimPrepareRequested(2, CLAIM_A, 1.0))
    prepared = one(node.handle(read(1, "pci-0000-af-00-0")), ClaimPrepared).prepared
    assert node.handle(second) == [ClaimPrepared(2, prepared)]
    (answer,) = node.handle(ClaimFilesWritten(2, "read-only file system"))
    assert answer.error.endswith("its CDI files could not be written: read-only file system")
    assert node.dra.prepared() == (prepared,)
    assert node.handle(ClaimFilesWritten(1)) == [
        ClaimAnswered(1, CLAIM_A, prepared_devices(DRIVER, prepared))
    ]


@pytest.mark.parametrize(
    "report",
    [read(3, "pci-0000-af-00-0"), ClaimUnreadable(3, "cannot read claim")],
    ids=["read", "unreadable"],
)
def test_a_read_for_a_call_that_waits_for_none_is_the_shells_mistake(report: object) -> None:
    node, _ = started()
    with pytest.raises(UsageError, match="call 3, which waits for no such report"):
        node.handle(report)  # type: ignore[arg-type]
    node.handle(ClaimPrepareRequested(3, CLAIM_A, 1.5))
    with pytest.raises(UsageError, match="ClaimFilesWritten for call 3"):
        node.handle(ClaimFilesWritten(3))  # it waits for its read
    node.handle(report)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="call 3, which waits for no such report"):
        node.handle(report)  # type: ignore[arg-type]  # once only


def test_a_claim_that_would_split_a_group_is_refused_naming_the_holder() -> None:
    node, _ = started(config(audio_frontend="dra"))
    prepare(node, CLAIM_A, "pci-0000-3b-00-0")
    effects = prepare(node, CLAIM_B, "pci-0000-3b-00-1", call=7)
    refused = one(effects, ClaimRefused)
    assert (refused.call, refused.claim) == (7, CLAIM_B)
    assert refused.error == (
        "IOMMU group 10 of device pci-0000-3b-00-1 is held by claim vms/vm-a (UID uid-a); "
        "VFIO cannot split a group between holders; the kubelet retries until that holder "
        "lets go, or delete the pod to have its claim allocated again"
    )
    assert refused.reason == "IOMMUGroupHeld"
    assert effects_of(effects, ClaimsChanged) == []
    assert node.ledger.holder(10).claim == CLAIM_A  # type: ignore[union-attr]


def test_a_claim_against_a_device_plugin_allocation_is_refused() -> None:
    node, effects = started(dra_device_taints=False)
    kubelet = Kubelet(node)
    kubelet.register_all(effects)  # type: ignore[arg-type]
    # The device plugin gives the group-20 audio function to a container.
    reply = kubelet.allocate("nvidia.com/audio", ("0000:af:00.1",))
    assert effects_of(reply, Reply)
    assert "pci-0000-af-00-0" not in [d.name for d in one(reply, PoolChanged).content.devices]
    effects = prepare(node, CLAIM_A, "pci-0000-af-00-0")
    assert "IOMMU group 20 of device pci-0000-af-00-0 is held by allocation #1 of " in (
        one(effects, ClaimRefused).error
    )


def test_device_plugin_allocate_is_refused_while_a_claim_holds_the_group() -> None:
    node, _ = started()
    prepare(node, CLAIM_A, "pci-0000-af-00-0")
    conflict = node.device_plugin.allocations.conflict(
        "nvidia.com/audio",
        [node.inventory.resource("nvidia.com/audio").devices[1]],  # type: ignore[union-attr]
    )
    assert conflict is not None and "claim vms/vm-a (UID uid-a)" in conflict


@pytest.mark.parametrize("taints", [True, False])
def test_a_claim_on_a_group_with_a_counter_leaves_the_pool_as_it_is(taints: bool) -> None:
    """The scheduler counts the claim's device against the group's counter: the
    sibling needs no mark, so Prepare and Unprepare write nothing."""
    node, _ = started(config(audio_frontend="dra"), dra_device_taints=taints)
    before = node.dra.pool
    assert before is not None and before.device("pci-0000-3b-00-1") is not None
    effects = prepare(node, CLAIM_A, "pci-0000-3b-00-0")
    assert effects_of(effects, ClaimPrepared) and effects_of(effects, PoolChanged) == []
    effects = unprepare(node, CLAIM_A)
    assert effects_of(effects, ClaimUnprepared) and effects_of(effects, PoolChanged) == []
    assert node.dra.pool == before


def test_a_group_held_through_the_device_plugin_is_marked_for_the_scheduler() -> None:
    """The scheduler cannot see a device-plugin allocation: the DRA members of a
    group it holds are tainted, though they consume the group's counter."""
    node = StandardNode(config(), node_name=NODE, dra_device_taints=True)
    # Group 20 gets a NIC beside its GPU (DRA) and audio (device plugin).
    third = pci("0000:af:00.2", NIC_PCI, 20, numa=1, class_code=0x020000)
    node.handle(HostObserved(snapshot([*host().pci_devices, third]), 0.0))
    node.handle(KubeletStarted(0.0))
    effects = node.handle(
        AllocationsObserved({"nvidia.com/audio": frozenset({"0000:af:00.1"})}, 1.0)
    )
    content = one(effects, PoolChanged).content
    for name in ("pci-0000-af-00-0", "pci-0000-af-00-2"):
        device = content.device(name)
        assert device is not None and device.consumes_counters
        assert [t.key for t in device.taints] == [f"{DRIVER}/iommu-group-held"], name


def test_adopted_pod_holding_the_sibling_takes_the_dra_device_out_of_the_pool() -> None:
    node, _ = started(dra_device_taints=False)
    assert "pci-0000-af-00-0" in pool_names(node)
    effects = node.handle(
        AllocationsObserved({"nvidia.com/audio": frozenset({"0000:af:00.1"})}, 1.0)
    )
    assert "pci-0000-af-00-0" not in [d.name for d in one(effects, PoolChanged).content.devices]
    effects = node.handle(AllocationsObserved({}, 100.0))
    assert "pci-0000-af-00-0" in [d.name for d in one(effects, PoolChanged).content.devices]


@pytest.mark.parametrize(
    ("results", "error"),
    [
        (
            [AllocatedDevice("gpu", DRIVER, NODE, "pci-0000-99-00-0")],
            "request 'gpu': device 'pci-0000-99-00-0' is not offered by vfio.dp.example.com "
            "in pool 'worker-1'",
        ),
        (
            [AllocatedDevice("gpu", DRIVER, "worker-2", "pci-0000-3b-00-0")],
            "request 'gpu': device 'pci-0000-3b-00-0' is in pool 'worker-2', not this node's "
            "pool 'worker-1'",
        ),
    ],
)
def test_unknown_device_or_other_pool_is_refused_and_nothing_is_released(
    results: list[AllocatedDevice], error: str
) -> None:
    node, _ = started()
    prepare(node, CLAIM_A, "pci-0000-af-00-0")
    effects = prepare_claim(node, 3, CLAIM_B, results, 2.0)
    assert one(effects, ClaimRefused).error == error
    assert node.ledger.holder(20).claim == CLAIM_A  # type: ignore[union-attr]


def test_other_drivers_results_are_not_ours() -> None:
    node, _ = started()
    results = [
        AllocatedDevice("gpu", DRIVER, NODE, "pci-0000-3b-00-0"),
        AllocatedDevice("net", "sriov.example.com", "elsewhere", "vf-1"),
    ]
    prepared = one(prepare_claim(node, 1, CLAIM_A, results, 1.0), ClaimPrepared)
    assert [d.name for d in prepared.prepared.devices] == ["pci-0000-3b-00-0"]


def test_prepare_and_unprepare_are_idempotent() -> None:
    node, _ = started()
    first = one(prepare(node, CLAIM_A, "pci-0000-3b-00-0"), ClaimPrepared).prepared
    again = prepare(node, CLAIM_A, "pci-0000-3b-00-0", call=5, now=3.0)
    assert again == [ClaimPrepared(5, first)]
    unprepare(node, CLAIM_A, now=3.5)
    assert unprepare(node, CLAIM_A, call=9, now=4.0) == [ClaimUnprepared(9, CLAIM_A, None)]


def test_unprepare_of_an_unknown_claim_is_fine() -> None:
    node, _ = started()
    prepare(node, CLAIM_A, "pci-0000-3b-00-0")
    assert unprepare(node, CLAIM_B) == [ClaimUnprepared(2, CLAIM_B, None)]
    assert node.ledger.holder(10) is not None


def test_a_restart_recalls_the_claims_and_an_unprepare_still_frees_the_group() -> None:
    node, _ = started()
    prepare(node, CLAIM_A, "pci-0000-3b-00-0", f"mdev-{VGPU_UUID}")
    checkpoint = node.dra.prepared()
    restarted = StandardNode(config(), node_name=NODE)
    restarted.handle(ClaimsRecalled(checkpoint))
    effects = restarted.handle(HostObserved(host(), 0.0))
    held = {g: h.claim for g, h in restarted.ledger.held().items()}
    assert held == {10: CLAIM_A, 40: CLAIM_A}
    assert restarted.dra.prepared() == checkpoint
    assert one(effects, PoolChanged).content == node.dra.pool
    # The claim was deleted from the API meanwhile: the kubelet still unprepares it by UID.
    effects = restarted.handle(ClaimUnprepareRequested(1, CLAIM_A, 1.0))
    assert one(effects, ClaimUnprepared).prepared == checkpoint[0]
    assert restarted.ledger.held() == {}


def test_a_device_gone_after_prepare_stays_held() -> None:
    node, _ = started()
    prepare(node, CLAIM_A, "pci-0000-5e-00-0")
    gone = snapshot([d for d in host().pci_devices if d.iommu_group != 30])
    node.handle(HostObserved(gone, 3.0))
    assert node.ledger.holder(30).claim == CLAIM_A  # type: ignore[union-attr]
    again = prepare(node, CLAIM_A, "pci-0000-5e-00-0", now=4.0)
    assert one(again, ClaimPrepared).prepared.devices[0].device_id == str(NIC_ID)


# -- what the container gets ------------------------------------------------------------------


def test_cdi_ids_and_metadata_for_a_prepared_claim() -> None:
    node, _ = started()
    claim = ClaimRef("vms", "1234", "vm-a")
    results = [
        AllocatedDevice("gpu", DRIVER, NODE, "pci-0000-3b-00-0"),
        AllocatedDevice("vgpu/small", DRIVER, NODE, f"mdev-{VGPU_UUID}"),
    ]
    prepared = one(
        prepare_claim(node, 1, claim, results, 1.0, pod_claim_name="gpus"),
        ClaimPrepared,
    ).prepared
    answer = prepared_devices(DRIVER, prepared)
    assert [(d.request_names, d.device_name, d.cdi_device_ids) for d in answer] == [
        (
            ("gpu",),
            "pci-0000-3b-00-0",
            (f"{DRIVER}/claim=1234-pci-0000-3b-00-0", f"{DRIVER}/metadata=1234_gpu"),
        ),
        (
            ("vgpu/small",),
            f"mdev-{VGPU_UUID}",
            (f"{DRIVER}/claim=1234-mdev-{VGPU_UUID}", f"{DRIVER}/metadata=1234_vgpu"),
        ),
    ]
    gpu_file, vgpu_file = request_metadata(DRIVER, prepared)
    assert gpu_file.container_path == (
        "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpus/gpu/"
        f"{DRIVER}-metadata.json"
    )
    assert [o["apiVersion"] for o in gpu_file.objects] == [
        "metadata.resource.k8s.io/v1beta1",
        "metadata.resource.k8s.io/v1alpha1",
    ]
    v1alpha1 = gpu_file.objects[1]
    assert v1alpha1["kind"] == "DeviceMetadata"
    assert v1alpha1["metadata"] == {
        "name": "vm-a",
        "namespace": "vms",
        "uid": "1234",
        "generation": 1,
    }
    assert v1alpha1["podClaimName"] == "gpus"
    (request,) = v1alpha1["requests"]  # type: ignore[misc]
    assert request["name"] == "gpu"
    (device,) = request["devices"]
    assert (device["driver"], device["pool"], device["name"]) == (DRIVER, NODE, "pci-0000-3b-00-0")
    assert device["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": "0000:3b:00.0"}
    assert device["attributes"]["iommuGroup"] == {"int": 10}
    assert vgpu_file.request == "vgpu"
    vgpu = vgpu_file.objects[1]["requests"][0]  # type: ignore[index]
    assert vgpu["name"] == "vgpu/small"
    assert vgpu["devices"][0]["attributes"]["mdevUUID"] == {"string": VGPU_UUID}


def test_attribute_json_of_each_kind() -> None:
    from dp_core.dra.metadata import attribute_json

    assert attribute_json("x") == {"string": "x"}
    assert attribute_json(3) == {"int": 3}
    assert attribute_json(True) == {"bool": True}
    assert attribute_json(Version("1.2.3")) == {"version": "1.2.3"}


def test_a_claim_from_a_resource_claim_has_its_own_metadata_path() -> None:
    node, _ = started()
    prepared = one(prepare(node, CLAIM_A, "pci-0000-3b-00-0"), ClaimPrepared).prepared
    (meta,) = request_metadata(DRIVER, prepared)
    assert meta.container_path == (
        "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/vm-a/req0/"
        f"{DRIVER}-metadata.json"
    )
    assert "podClaimName" not in meta.objects[0]


def test_pool_content_is_a_value() -> None:
    assert PoolContent(DRIVER, NODE, NODE) == PoolContent(DRIVER, NODE, NODE, (), ())


# -- one claim, one whole group --------------------------------------------------------------


def test_a_group_of_two_offered_functions_is_offered_whole_too() -> None:
    node, effects = started(config(audio_frontend="dra"))
    content = one(effects, PoolChanged).content
    whole = content.device("iommu-group-10")
    gpu = content.device("pci-0000-3b-00-0")
    assert whole is not None and gpu is not None
    # The group's one counter: the whole and each member exclude one another.
    assert whole.consumes_counters == gpu.consumes_counters
    attributes = dict(whole.attributes)
    assert attributes["resourceName"] == "iommu-group"
    assert attributes["leadResourceName"] == GPU_RESOURCE
    assert attributes["resource.kubernetes.io/pciBusID"] == "0000:3b:00.0"
    assert attributes["members"] == "0000:3b:00.0,0000:3b:00.1"
    assert attributes["memberCount"] == 2
    assert attributes["iommuGroup"] == 10
    # Not without counters: nothing would keep it apart from its members.
    node, effects = started(config(audio_frontend="dra"), dra_partitionable=False)
    assert one(effects, PoolChanged).content.device("iommu-group-10") is None
    # Not for a group with one function offered here (20: the audio is the device plugin's).
    node, effects = started()
    assert one(effects, PoolChanged).content.device("iommu-group-20") is None


def test_a_claim_for_the_whole_group_gets_every_member_and_excludes_each() -> None:
    node, _ = started(config(audio_frontend="dra"))
    effects = prepare(node, CLAIM_A, "iommu-group-10")
    prepared = one(effects, ClaimPrepared).prepared
    (device,) = prepared.devices
    assert (device.name, device.device_id, device.iommu_group) == (
        "iommu-group-10",
        "0000:3b:00.0",
        10,
    )
    assert [d.container_path for d in device.edits.devices] == ["/dev/vfio/vfio", "/dev/vfio/10"]
    # Each member's resource variable, as Allocate would give them.
    assert dict(device.edits.envs) == {
        "PCI_RESOURCE_NVIDIA_COM_T4": "0000:3b:00.0",
        "PCI_RESOURCE_NVIDIA_COM_AUDIO": "0000:3b:00.1",
    }
    assert effects_of(effects, PoolChanged) == []  # the counter says it to the scheduler
    refused = one(prepare(node, CLAIM_B, "pci-0000-3b-00-1", call=5), ClaimRefused)
    assert refused.reason == "IOMMUGroupHeld" and "vms/vm-a" in refused.error
    unprepare(node, CLAIM_A)
    assert effects_of(prepare(node, CLAIM_B, "pci-0000-3b-00-0", call=6, now=3.0), ClaimPrepared)
    refused = one(prepare(node, CLAIM_A, "iommu-group-10", call=7, now=4.0), ClaimRefused)
    assert refused.reason == "IOMMUGroupHeld" and "vms/vm-b" in refused.error


def test_a_whole_group_is_unhealthy_while_a_member_is() -> None:
    node, _ = started(config(audio_frontend="dra"), dra_device_taints=True)
    gone = snapshot(
        list(host().pci_devices),
        mdev_types=host().mdev_types,
        mdevs=host().mdevs,
        missing_nodes=("/dev/vfio/10",),
    )
    content = one(node.handle(HostObserved(gone, 1.0)), PoolChanged).content
    whole = content.device("iommu-group-10")
    assert whole is not None
    assert [t.key for t in whole.taints] == [f"{DRIVER}/unhealthy"]
    refused = one(prepare(node, CLAIM_A, "iommu-group-10"), ClaimRefused)
    assert refused.reason == "DeviceUnhealthy" and "pci-0000-3b-00-0" in refused.error


def test_the_whole_groups_metadata_names_its_lead_and_members() -> None:
    node, _ = started(config(audio_frontend="dra"))
    prepared = one(prepare(node, CLAIM_A, "iommu-group-10"), ClaimPrepared).prepared
    (request,) = request_metadata(DRIVER, prepared)
    for document in request.objects:
        ((one_request),) = document["requests"]  # type: ignore[misc]
        # One device per request, as KubeVirt 1.9 reads it: the lead's address.
        (device,) = one_request["devices"]
        attributes = device["attributes"]
        assert attributes["resource.kubernetes.io/pciBusID"] == {"string": "0000:3b:00.0"}
        assert attributes["members"] == {"string": "0000:3b:00.0,0000:3b:00.1"}
