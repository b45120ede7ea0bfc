"""The kubelet's DRA health streams in the core: what each stream is sent, and when (tables)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dp_core import (
    AllocationsObserved,
    Config,
    ConfigApplied,
    DeviceHealth,
    Health,
    HealthWatchEnded,
    HealthWatchStarted,
    HostObserved,
    KubeletStarted,
    MdevDevice,
    MdevType,
    MediatedDevice,
    PciAddress,
    PciHostDevice,
    PermittedHostDevices,
    PublishHealth,
    StandardNode,
    Tick,
    Timing,
    UsageError,
)
from dp_core.config import Dra
from dp_core.dra.claims import ClaimRef
from dp_core.dra.effects import ClaimRefused
from dp_core.dra.health_watch import device_health
from dp_core.dra.inputs import AllocatedDevice, ClaimPrepareRequested, ClaimUnprepareRequested
from dp_core.effects import Effect, Log

from core_builders import AUDIO, GPU, GPU_RESOURCE, effects_of, pci, prepare_claim, snapshot

DRIVER = "vfio.dp.example.com"
NODE = "worker-1"
GPU_A, GPU_B = "pci-0000-3b-00-0", "pci-0000-af-00-0"
VGPU_UUID = "8a3b9c1e-1f7a-4c55-9d0e-2b6f4a7e8c11"
VGPU = f"mdev-{VGPU_UUID}"
CLAIM = ClaimRef("vms", "uid-a", "vm-a")
RESEND = 10.0
H, U, X = Health.HEALTHY, Health.UNHEALTHY, Health.UNKNOWN


def host(*, missing: tuple[str, ...] = (), gpu_b: bool = True, vgpu: bool = True):
    """GPU A with its audio function in group 10 (the audio on the device
    plugin), GPU B alone in group 20, a vGPU of GPU A in group 40."""
    devices = [
        pci("0000:3b:00.0", GPU, 10),
        pci("0000:3b:00.1", AUDIO, 10, class_code=0x040300),
    ]
    if gpu_b:
        devices.append(pci("0000:af:00.0", GPU, 20))
    return snapshot(
        devices,
        mdev_types=(MdevType(PciAddress.parse("0000:3b:00.0"), "nvidia-222", "GRID T4-1Q"),),
        mdevs=(MdevDevice(VGPU_UUID, PciAddress.parse("0000:3b:00.0"), "nvidia-222", 40),)
        if vgpu
        else (),
        missing_nodes=missing,
    )


def config(*, gpus: bool = True) -> Config:
    pci_devices = [PciHostDevice(AUDIO, "nvidia.com/audio")]
    if gpus:
        pci_devices.insert(0, PciHostDevice(GPU, GPU_RESOURCE, frontend="dra"))
    return Config(
        permitted_host_devices=PermittedHostDevices(
            pci_host_devices=tuple(pci_devices),
            mediated_devices=(
                MediatedDevice("GRID T4-1Q", "nvidia.com/GRID_T4-1Q", frontend="dra"),
            ),
        ),
        shared_devices=(),
        dra=Dra(DRIVER),
    )


def started() -> StandardNode:
    node = StandardNode(config(), node_name=NODE, timing=Timing(health_resend=RESEND))
    node.handle(HostObserved(host(), 0.0))
    node.handle(KubeletStarted(0.0))
    node.handle(AllocationsObserved({}, 0.0))  # the kubelet has synced: no PodResources polls due
    return node


def sent(effects: list[Effect]) -> list[tuple[int, float, dict[str, Health]]]:
    """Each PublishHealth as (stream, at, {device: health})."""
    return [
        (e.stream, e.at, {d.device: d.health for d in e.devices})
        for e in effects_of(effects, PublishHealth)
    ]


ALL_HEALTHY = {GPU_A: H, GPU_B: H, VGPU: H}


def test_a_stream_is_sent_every_device_of_the_pool_at_once() -> None:
    node = started()
    effects = node.handle(HealthWatchStarted(7, 1.5))
    (publish,) = effects_of(effects, PublishHealth)
    assert publish == PublishHealth(
        7,
        (
            DeviceHealth(NODE, VGPU, H),
            DeviceHealth(NODE, GPU_A, H),
            DeviceHealth(NODE, GPU_B, H),
        ),
        1.5,
        31,  # three resend intervals, and the second the whole-second time may lose
    )
    assert node.dra.health.streams() == (7,)


# Each row: the inputs after two streams opened (1 at t=1, 2 at t=4), and what
# is sent: (stream, at, health of each device).
HOST_CHANGES = [
    pytest.param(
        [HostObserved(host(), 5.0)],
        [],
        id="a rescan that changes nothing sends nothing",
    ),
    pytest.param(
        [HostObserved(host(missing=("/dev/vfio/20",)), 5.0)],
        [(1, 5.0, {**ALL_HEALTHY, GPU_B: U}), (2, 5.0, {**ALL_HEALTHY, GPU_B: U})],
        id="a device's VFIO node gone: Unhealthy, to every stream at once",
    ),
    pytest.param(
        [HostObserved(host(missing=("/dev/vfio/20",)), 5.0), HostObserved(host(), 6.0)],
        [
            (1, 5.0, {**ALL_HEALTHY, GPU_B: U}),
            (2, 5.0, {**ALL_HEALTHY, GPU_B: U}),
            (1, 6.0, ALL_HEALTHY),
            (2, 6.0, ALL_HEALTHY),
        ],
        id="and back: Healthy again",
    ),
    pytest.param(
        [HostObserved(host(gpu_b=False), 5.0)],
        [(1, 5.0, {GPU_A: H, VGPU: H}), (2, 5.0, {GPU_A: H, VGPU: H})],
        id="a device no claim holds gone from the host: left out of the list",
    ),
    pytest.param(
        [AllocationsObserved({"nvidia.com/audio": frozenset({"0000:3b:00.1"})}, 5.0)],
        [],
        id="a device whose group another holder takes stays Healthy",
    ),
    pytest.param(
        [Tick(10.9)],
        [],
        id="a tick before any stream is due sends nothing",
    ),
    pytest.param(
        [Tick(11.0), Tick(13.9), Tick(14.0)],
        [(1, 11.0, ALL_HEALTHY), (2, 14.0, ALL_HEALTHY)],
        id="each stream is sent its list again resend seconds after the last",
    ),
    pytest.param(
        [HostObserved(host(missing=("/dev/vfio/20",)), 5.0), Tick(14.9), Tick(15.0)],
        [
            (1, 5.0, {**ALL_HEALTHY, GPU_B: U}),
            (2, 5.0, {**ALL_HEALTHY, GPU_B: U}),
            (1, 15.0, {**ALL_HEALTHY, GPU_B: U}),
            (2, 15.0, {**ALL_HEALTHY, GPU_B: U}),
        ],
        id="a change restarts both streams' resend intervals",
    ),
    pytest.param(
        [HealthWatchEnded(1), Tick(11.0), HostObserved(host(missing=("/dev/vfio/20",)), 12.0)],
        [(2, 12.0, {**ALL_HEALTHY, GPU_B: U})],
        id="an ended stream is sent nothing",
    ),
]


@pytest.mark.parametrize(("inputs", "expected"), HOST_CHANGES)
def test_what_each_open_stream_is_sent(
    inputs: list[object], expected: list[tuple[int, float, dict[str, Health]]]
) -> None:
    node = started()
    node.handle(HealthWatchStarted(1, 1.0))
    node.handle(HealthWatchStarted(2, 4.0))
    effects: list[Effect] = []
    for event in inputs:
        effects += node.handle(event)  # type: ignore[arg-type]
    assert sent(effects) == expected


def test_the_node_asks_for_a_tick_when_a_stream_is_next_due() -> None:
    node = started()
    assert node.next_deadline() is None  # the registrar waits for nothing, no stream is open
    node.handle(HealthWatchStarted(1, 1.0))
    node.handle(HealthWatchStarted(2, 4.0))
    assert node.next_deadline() == 11.0
    node.handle(Tick(11.0))
    assert node.next_deadline() == 14.0
    node.handle(HealthWatchEnded(2))
    node.handle(HealthWatchEnded(1))
    assert node.next_deadline() is None


def test_a_change_is_logged_once_and_the_reason_is_the_message() -> None:
    node = started()
    node.handle(HealthWatchStarted(1, 1.0))
    gone = node.handle(HostObserved(host(missing=("/dev/vfio/20",)), 5.0))
    (publish,) = effects_of(gone, PublishHealth)
    (unhealthy,) = [d for d in publish.devices if d.health is U]
    assert unhealthy.device == GPU_B
    assert "/dev/vfio/20" in unhealthy.message
    assert [
        (log.level, dict(log.fields))
        for log in effects_of(gone, Log)
        if log.event == "dra-health-changed"
    ] == [("warning", {"device": GPU_B, "health": "Unhealthy", "reason": unhealthy.message})]
    again = node.handle(HostObserved(host(missing=("/dev/vfio/20",)), 6.0))
    assert [log for log in effects_of(again, Log) if log.event == "dra-health-changed"] == []
    back = node.handle(HostObserved(host(), 7.0))
    assert [
        (log.level, dict(log.fields))
        for log in effects_of(back, Log)
        if log.event == "dra-health-changed"
    ] == [("info", {"device": GPU_B, "health": "Healthy", "reason": ""})]


def prepare(node: StandardNode, *devices: str, now: float = 2.0) -> list[Effect]:
    results = [AllocatedDevice(f"req{i}", DRIVER, NODE, name) for i, name in enumerate(devices)]
    return prepare_claim(node, 1, CLAIM, results, now)


# A device a prepared claim holds that is offered no longer: (what happens, its health).
HELD_AND_GONE = [
    pytest.param(
        lambda n: n.handle(HostObserved(host(gpu_b=False), 5.0)),
        GPU_B,
        U,
        "0000:af:00.0 is gone from the host",
        id="a held PCI function gone from the host: Unhealthy",
    ),
    pytest.param(
        lambda n: n.handle(HostObserved(host(vgpu=False), 5.0)),
        VGPU,
        U,
        f"{VGPU_UUID} is gone from the host",
        id="a held mdev gone from the host: Unhealthy",
    ),
    pytest.param(
        lambda n: n.handle(ConfigApplied(config(gpus=False), 5.0)),
        GPU_B,
        X,
        "0000:af:00.0 is no longer offered: the config does not select it",
        id="a held device the config no longer selects: Unknown",
    ),
]


@pytest.mark.parametrize(("change", "device", "health", "message"), HELD_AND_GONE)
def test_a_held_device_that_is_no_longer_offered(
    change: object, device: str, health: Health, message: str
) -> None:
    node = started()
    prepare(node, device)
    node.handle(HealthWatchStarted(1, 3.0))
    effects = change(node)  # type: ignore[operator]
    (publish,) = effects_of(effects, PublishHealth)
    entry = next(d for d in publish.devices if d.device == device)
    assert (entry.health, entry.message) == (health, message)
    # Once the claim is unprepared the device is nobody's business any more.
    released = node.handle(ClaimUnprepareRequested(2, CLAIM, 6.0))
    (publish,) = effects_of(released, PublishHealth)
    assert device not in {d.device for d in publish.devices}


def test_preparing_a_claim_on_offered_devices_sends_nothing() -> None:
    node = started()
    node.handle(HealthWatchStarted(1, 1.0))
    assert effects_of(prepare(node, GPU_A, GPU_B), PublishHealth) == []
    assert effects_of(node.handle(ClaimUnprepareRequested(2, CLAIM, 3.0)), PublishHealth) == []


def test_caller_errors() -> None:
    node = started()
    node.handle(HealthWatchStarted(1, 1.0))
    with pytest.raises(UsageError, match="health stream 1 started twice"):
        node.handle(HealthWatchStarted(1, 2.0))
    with pytest.raises(ValueError, match="health_resend must be positive"):
        Timing(health_resend=0.0)
    with pytest.raises(ValueError, match="healthy device d with a problem"):
        DeviceHealth(NODE, "d", H, "broken")
    with pytest.raises(ValueError, match="needs its pool and name"):
        DeviceHealth("", "d", U, "broken")


def test_without_dra_no_health_is_worked_out() -> None:
    plain = PermittedHostDevices(pci_host_devices=(PciHostDevice(AUDIO, "nvidia.com/audio"),))
    node = StandardNode(Config(permitted_host_devices=plain, dra=None), node_name=NODE)
    node.handle(HostObserved(host(), 0.0))
    assert node.dra.health.devices == ()
    assert effects_of(node.handle(HealthWatchStarted(1, 1.0)), PublishHealth)[0].devices == ()


# -- properties ------------------------------------------------------------------------

_GROUP_NODES = ("/dev/vfio/10", "/dev/vfio/20", "/dev/vfio/40")

steps = st.lists(
    st.one_of(
        st.tuples(
            st.just("host"),
            st.sets(st.sampled_from(_GROUP_NODES)),
            st.booleans(),
            st.booleans(),
        ),
        st.tuples(st.just("open")),
        st.tuples(st.just("close"), st.integers(0, 5)),
        st.tuples(st.just("tick")),
        st.tuples(st.just("wait"), st.floats(0.0, 25.0)),
        st.tuples(st.just("prepare"), st.sampled_from([GPU_A, GPU_B, VGPU])),
        st.tuples(st.just("unprepare")),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(steps)
def test_every_open_stream_holds_the_current_health_and_is_never_overdue(
    plan: list[tuple[object, ...]],
) -> None:
    node = started()
    now = 1.0
    last: dict[int, PublishHealth] = {}  # open stream -> what it was last sent
    next_stream = 100
    prepared = False
    for step in plan:
        kind = step[0]
        if kind == "host":
            missing, gpu_b, vgpu = step[1], step[2], step[3]
            event: object = HostObserved(host(missing=tuple(missing), gpu_b=gpu_b, vgpu=vgpu), now)  # type: ignore[arg-type]
        elif kind == "open":
            event = HealthWatchStarted(next_stream, now)
            next_stream += 1
        elif kind == "close" and last:
            stream = sorted(last)[step[1] % len(last)]  # type: ignore[operator]
            del last[stream]
            event = HealthWatchEnded(stream)
        elif kind == "tick":
            due = node.next_deadline()
            if due is None:
                continue
            now = max(now, due)
            event = Tick(now)
        elif kind == "wait":
            due = node.next_deadline()
            now = min(now + step[1], due) if due is not None else now + step[1]  # type: ignore[operator]
            event = Tick(now)
        elif kind == "prepare" and not prepared:
            results = [AllocatedDevice("r", DRIVER, NODE, step[1])]  # type: ignore[arg-type]
            event = ClaimPrepareRequested(1, CLAIM, now)
        elif kind == "unprepare" and prepared:
            event = ClaimUnprepareRequested(2, CLAIM, now)
        else:
            continue
        if isinstance(event, ClaimPrepareRequested):  # and its read, which the node asks for
            effects = prepare_claim(node, event.call, event.claim, results, now)
        else:
            effects = node.handle(event)  # type: ignore[arg-type]
        if isinstance(event, ClaimPrepareRequested):
            prepared = not any(isinstance(e, ClaimRefused) for e in effects)
        elif isinstance(event, ClaimUnprepareRequested):
            prepared = False
        for publish in effects_of(effects, PublishHealth):
            assert publish.stream in last or publish.stream == getattr(event, "stream", None)
            assert publish.at == now
            last[publish.stream] = publish
        current = node.dra.health.devices
        assert current == device_health(
            node.dra.devices(), node.dra.prepared(), node.snapshot, NODE
        )
        for publish in last.values():
            assert publish.devices == current  # every change reached every stream
            assert publish.at + RESEND >= now  # no stream is overdue its list
        assert set(node.dra.health.streams()) == set(last)
        if last:  # the shell ticks at the node's deadline: it must be in time
            due = node.next_deadline()
            assert due is not None and due <= min(p.at for p in last.values()) + RESEND
