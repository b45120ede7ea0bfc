"""How soon a deleted pod's IOMMU group is free again, with the timing dp ships.

The kubelet never tells a device plugin that a pod ended: dp learns it when
PodResources `List` (which shows only active pods, from the devices the
kubelet recorded at Allocate) leaves the pod out. Two figures bound the wait
after that: the poll interval (`Settings.pod_resources_interval`), and, for a
pod that got its devices moments ago, the release grace
(`Timing.release_grace`), which must outlast a List answer asked before the
Allocate (`LIST_TIMEOUT`) by the time the kubelet takes to record it.
"""

from __future__ import annotations

import asyncio
import time

import attrs

from dp_core import Timing
from dp_server.config.settings import Settings
from dp_server.deviceplugin.pod_resources import LIST_TIMEOUT
from tests.e2e_harness import FAST, NVME, Harness

GRACE = Timing().release_grace
INTERVAL = Settings().pod_resources_interval
SLACK = 1.0  # the emulator's polls, the server's loop, the test's own looking


def test_the_grace_outlasts_an_answer_asked_before_the_allocate() -> None:
    """An answer comes at most LIST_TIMEOUT after it was asked; one that comes
    a grace after an Allocate was asked 2 s after it at the earliest, time
    enough for the kubelet to have recorded the devices (it does so as soon
    as Allocate returns)."""
    assert GRACE >= LIST_TIMEOUT + 2.0
    assert INTERVAL <= 2.0  # a deleted VM's siblings back within 2 s of List


async def test_a_deleted_pods_sibling_comes_back_a_grace_after_its_allocate_and_no_sooner(
    harness: Harness,
) -> None:
    """A VM deleted as soon as it started (the emulator's List drops it at
    once): its NVMe drive's sibling stays Unhealthy until the grace after the
    Allocate has passed, then is Healthy within one poll."""
    await harness.serve(
        pod_resources_interval=INTERVAL,
        timing=attrs.evolve(FAST, release_grace=GRACE),
    )
    emulator = harness.emulator
    assert emulator is not None
    before = time.monotonic()
    await harness.kubelet("admit", "vm-a", "compute", {NVME: 1})
    admitted = time.monotonic()
    (held,) = emulator.pods()["default/vm-a"].containers["compute"].devices[NVME]
    sibling = next(d for d in emulator.resources()[NVME].devices if d != held.id)
    assert await harness.wait(lambda e: not e.resources()[NVME].devices[sibling].healthy)
    await harness.kubelet("remove_pod", "vm-a")

    while not emulator.resources()[NVME].devices[sibling].healthy:
        assert time.monotonic() - admitted < GRACE + INTERVAL + SLACK, "sibling still held"
        await asyncio.sleep(0.02)
    back = time.monotonic()
    assert back - before >= GRACE, f"released {back - before:.2f} s after the Allocate"
    assert back - before < 10.0  # 30 s and more with the grace of 30 s it had before
