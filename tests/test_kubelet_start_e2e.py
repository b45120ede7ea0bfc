"""dp and a kubelet that has just started, end to end through the grpcio emulator.

A real kubelet (v1.36) answers PodResources before it has synced its pods:
nothing listens at first, then `List` says no pod holds anything, then the
real list comes, 1.34 s after its start (issue 23). The emulator does the
same (`Startup.measured()`), keeps the kubelet's device-manager checkpoint
as the kubelet does, and admits new pods once it has synced. Each test
restarts dp and the kubelet in one of the orders the issue saw, then asks for
the sibling of a running VM's device: it must never be given out.

NVMe 0000:5e:00.0 and 0000:5e:01.0 share IOMMU group 93 on the fixture
host; every other device there is alone in its group.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from dp_core import DevicePluginFrontend, SyncPhase
from dp_testing.emulator import CHECKPOINT_FILE, AdmissionError, KubeletEmulator, Startup

from e2e_harness import GPU, NVME, QAT, Harness

pytestmark = pytest.mark.asyncio

GROUP_93 = ("0000:5e:00.0", "0000:5e:01.0")


async def run_vm_a(harness: Harness) -> tuple[str, str]:
    """A running VM holding one NVMe drive (and a T4); its drive and the sibling."""
    await harness.serve(kubelet={"startup": Startup.measured()})
    await harness.kubelet("admit", "vm-a", "compute", {NVME: 1, GPU: 1})
    emulator = harness.emulator
    assert emulator is not None
    (held,) = [d.id for d in emulator.pods()["default/vm-a"].containers["compute"].devices[NVME]]
    (sibling,) = [d for d in GROUP_93 if d != held]
    assert await harness.wait(lambda e: not e.resources()[NVME].devices[sibling].healthy)
    return held, sibling


async def admit_vm_b(harness: Harness, held: str) -> None:
    """A second VM asks for an NVMe drive once the kubelet has synced: the only
    other one is the running VM's sibling, which must not be given out."""
    emulator = harness.emulator
    assert emulator is not None
    with pytest.raises(AdmissionError, match="Available: 0"):
        await harness.kubelet("admit", "vm-b", "compute", {NVME: 1})
    in_group = {
        key: [d.id for c in pod.containers.values() for d in c.devices.get(NVME, ())]
        for key, pod in emulator.pods().items()
    }
    assert in_group == {"default/vm-a": [held]}


async def young(emulator: KubeletEmulator) -> bool:
    """Whether the kubelet has not synced its pods yet."""
    return time.monotonic() < emulator.synced_at


async def test_dp_and_the_kubelet_restarted_together_split_no_group(harness: Harness) -> None:
    held, sibling = await run_vm_a(harness)
    emulator = harness.emulator
    assert emulator is not None
    await harness.stop_server()
    await harness.kubelet("restart")
    runtime = await harness.start_server()
    assert await harness.registered()
    # Registered while the kubelet still lists no pod: the sibling is held back...
    assert await young(emulator)
    devices = emulator.resources()[NVME].devices
    assert devices[held].healthy and not devices[sibling].healthy
    # ...and nothing that cannot split a group is: the other T4 and the QAT VFs.
    assert emulator.allocatable()[GPU] == 2 and emulator.allocatable()[QAT] == 3
    assert runtime.node.frontend(DevicePluginFrontend).sync.phase is SyncPhase.SYNCING
    await admit_vm_b(harness, held)
    # Once the kubelet lists the VM, dp trusts it and holds the group for it.
    for _ in range(100):
        if runtime.node.frontend(DevicePluginFrontend).sync.trusted:
            break
        await asyncio.sleep(0.05)
    assert runtime.node.frontend(DevicePluginFrontend).sync.trusted
    assert [
        a.device_ids
        for a in runtime.node.frontend(DevicePluginFrontend).allocations.all()
        if NVME == a.resource
    ] == [(held,)]
    assert not emulator.resources()[NVME].devices[sibling].healthy


async def test_dp_restarted_just_after_the_kubelet_splits_no_group(harness: Harness) -> None:
    held, sibling = await run_vm_a(harness)
    emulator = harness.emulator
    assert emulator is not None
    await harness.kubelet("restart")
    await asyncio.sleep(0.6)  # the kubelet answers "no pods" by now
    await harness.stop_server()
    await harness.start_server()
    assert await harness.registered()
    assert await young(emulator)
    assert not emulator.resources()[NVME].devices[sibling].healthy
    await admit_vm_b(harness, held)


async def test_a_kubelet_restart_under_a_running_dp_splits_no_group(harness: Harness) -> None:
    """dp keeps running: the young kubelet's empty answers release nothing."""
    held, sibling = await run_vm_a(harness)
    emulator = harness.emulator
    assert emulator is not None
    await asyncio.sleep(0.3)  # past the harness's release grace: an empty answer would free it
    await harness.restart_kubelet()
    assert await young(emulator)
    assert not emulator.resources()[NVME].devices[sibling].healthy
    await admit_vm_b(harness, held)


async def test_a_vm_deleted_while_the_kubelet_was_down_frees_its_group_once_it_has_synced(
    harness: Harness,
) -> None:
    """The kubelet's checkpoint still names vm-a's drive: held back until the
    kubelet, synced, drops it (dp sends a device list, the kubelet writes its
    checkpoint), and then the whole group can go to one new VM."""
    held, sibling = await run_vm_a(harness)
    emulator = harness.emulator
    assert emulator is not None
    await harness.stop_server()
    await harness.kubelet("restart", removed=["vm-a"])
    runtime = await harness.start_server()
    assert await harness.registered()
    assert not emulator.resources()[NVME].devices[sibling].healthy
    assert await harness.wait(
        lambda e: all(d.healthy for d in e.resources()[NVME].devices.values())
    )
    assert time.monotonic() >= emulator.synced_at
    assert runtime.node.frontend(DevicePluginFrontend).sync.trusted
    entries = json.loads((harness.plugin_dir / CHECKPOINT_FILE).read_bytes())["Data"]
    assert entries["PodDeviceEntries"] is None  # the kubelet dropped vm-a
    await harness.kubelet("admit", "vm-c", "compute", {NVME: 2})
