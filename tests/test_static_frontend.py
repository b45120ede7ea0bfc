"""A third front end beside dp's two: the promise that a new front end is its
own package, plugged into a real Node and a real Runtime without touching
either of the others (tests/static_frontend)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from dp_core import (
    AllocationsObserved,
    Config,
    HostObserved,
    KubeletStarted,
    Ledger,
    Node,
    PciHostDevice,
    PermittedHostDevices,
    StandardNode,
    UsageError,
)
from dp_core.config import Dra
from dp_core.dra.claims import ClaimRef
from dp_core.dra.effects import ClaimPrepared, ClaimRefused, PoolChanged
from dp_core.dra.inputs import AllocatedDevice
from dp_core.effects import HealthChanged
from dp_server.runtime.frontends import FRONTENDS

from core_builders import AUDIO, GPU, GPU_RESOURCE, effects_of, one, pci, prepare_claim, snapshot
from e2e_harness import GPU as FIXTURE_GPU
from e2e_harness import Harness
from static_frontend import (
    ConsumerHanded,
    ConsumerRefused,
    ConsumerStarted,
    ConsumerStopped,
    StaticFrontend,
    static_plug,
)

DRIVER = "vfio.dp.example.com"
NODE = "worker-1"
AUDIO_RESOURCE = "nvidia.com/audio"
CLAIM = ClaimRef("vms", "uid-a", "vm-a")


def host():
    """A T4 and its audio function in group 20: the GPU on DRA, the audio on
    the device plugin; another T4 alone in group 30."""
    return snapshot(
        [
            pci("0000:af:00.0", GPU, 20),
            pci("0000:af:00.1", AUDIO, 20, class_code=0x040300),
            pci("0000:d8:00.0", GPU, 30),
        ]
    )


def config() -> Config:
    return Config(
        permitted_host_devices=PermittedHostDevices(
            pci_host_devices=(
                PciHostDevice(GPU, GPU_RESOURCE, frontend="dra"),
                PciHostDevice(AUDIO, AUDIO_RESOURCE),
            ),
        ),
        shared_devices=(),
        dra=Dra(DRIVER),
    )


def three() -> tuple[StandardNode, StaticFrontend]:
    ledger = Ledger()
    static = StaticFrontend(ledger, {"vm1": ["0000:af:00.0"], "vm2": ["0000:d8:00.0"]})
    node = StandardNode(config(), node_name=NODE, ledger=ledger, more=(static,))
    node.handle(HostObserved(host(), 0.0))
    node.handle(KubeletStarted(0.0))
    node.handle(AllocationsObserved({}, 0.0))
    return node, static


def prepare(node: StandardNode, device: str, now: float):
    results = [AllocatedDevice("gpu", DRIVER, NODE, device)]
    return prepare_claim(node, 1, CLAIM, results, now)


def audio(node: StandardNode):
    return node.device_plugin.advertised(AUDIO_RESOURCE)[0]


def test_its_hold_reaches_both_other_front_ends_once_its_handler_has_returned() -> None:
    node, static = three()
    assert audio(node).healthy
    effects = node.handle(ConsumerStarted("vm1", 1.0))
    # Its own effect first; what the others did about the new holder after it.
    assert isinstance(effects[0], ConsumerHanded) and effects[0].groups == (20,)
    (change,) = effects_of(effects, HealthChanged)
    assert (change.resource, change.healthy) == (AUDIO_RESOURCE, False)
    assert effects.index(effects[0]) < effects.index(change)
    assert "static consumer vm1" in (audio(node).reason or "")
    assert effects_of(effects, PoolChanged)  # the scheduler is told the GPU is taken
    refused = one(prepare(node, "pci-0000-af-00-0", 2.0), ClaimRefused)
    assert "IOMMU group 20 of device pci-0000-af-00-0 is held by static consumer vm1" in (
        refused.error
    )
    assert static.running() == ("vm1",)

    effects = node.handle(ConsumerStopped("vm1", 3.0))
    assert audio(node).healthy and static.running() == ()
    assert effects_of(prepare(node, "pci-0000-af-00-0", 4.0), ClaimPrepared)


def test_a_consumer_is_refused_a_group_a_claim_holds_and_holds_nothing() -> None:
    node, static = three()
    assert effects_of(prepare(node, "pci-0000-af-00-0", 1.0), ClaimPrepared)
    effects = node.handle(ConsumerStarted("vm1", 2.0))
    refused = one(effects, ConsumerRefused)
    assert "is held by claim vms/vm-a (UID uid-a)" in refused.reason
    assert static.running() == () and not effects_of(effects, ConsumerHanded)
    # One front end's refusal is not the others' business: vm2's GPU is free.
    assert effects_of(node.handle(ConsumerStarted("vm2", 3.0)), ConsumerHanded)


def test_a_node_knows_none_of_its_front_ends_by_name() -> None:
    ledger = Ledger()
    static = StaticFrontend(ledger, {"vm2": ["0000:d8:00.0"]})
    node = Node(Config(shared_devices=()), [static], ledger=ledger)
    node.handle(HostObserved(host(), 0.0))
    assert effects_of(node.handle(ConsumerStarted("vm2", 1.0)), ConsumerHanded)
    assert node.frontend(StaticFrontend) is static
    assert [f.name for f in node.frontends] == ["static"]
    with pytest.raises(UsageError, match="two front ends have one name"):
        Node(Config(), [static, StaticFrontend(ledger, {})], ledger=ledger)
    with pytest.raises(UsageError, match="ConsumerStarted is handled twice"):
        Node(Config(), [static, _Renamed(StaticFrontend(ledger, {}))], ledger=ledger)


class _Renamed:
    """A front end under another name, declaring the same inputs."""

    def __init__(self, inner: StaticFrontend) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    @property
    def name(self) -> str:
        return "another"


async def _until(predicate, timeout: float = 5.0) -> bool:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)
    return True


async def test_a_real_runtime_serves_it_beside_the_device_plugin(
    harness: Harness, tmp_path: Path
) -> None:
    """The grpcio kubelet sees the GPU the consumer holds go Unhealthy and
    come back; an Allocate of it is refused naming the consumer."""
    control = tmp_path / "static"
    plug = static_plug(control, {"vm1": ["0000:3b:00.0"]})
    runtime = await harness.serve(frontends=(*FRONTENDS, plug))
    assert [f.name for f in runtime.frontends] == ["device-plugin", "static"]

    def healthy() -> bool:
        devices = harness.emulator.resources()[FIXTURE_GPU].devices  # type: ignore[union-attr]
        return devices["0000:3b:00.0"].healthy

    assert healthy()
    (control / "vm1.run").touch()
    handed = control / "vm1.devices"
    assert await _until(handed.exists)
    assert json.loads(handed.read_text())["devices"] == ["0000:3b:00.0"]
    assert await harness.wait(lambda e: not healthy())
    with pytest.raises(Exception, match="static consumer vm1"):
        await harness.kubelet("allocate", FIXTURE_GPU, ["0000:3b:00.0"])
    (control / "vm1.run").unlink()
    assert await harness.wait(lambda e: healthy())
    assert not handed.exists()
    response = await harness.kubelet("allocate", FIXTURE_GPU, ["0000:3b:00.0"])
    assert response.envs["PCI_RESOURCE_NVIDIA_COM_TU104GL_TESLA_T4"] == "0000:3b:00.0"
