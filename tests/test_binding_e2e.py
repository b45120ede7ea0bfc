"""Binding end to end: the runtime moves selected devices on the fixture host to
vfio-pci through a fake kernel, and the kubelet emulator sees them turn Healthy."""

from __future__ import annotations

import asyncio
import logging

import pytest

from dp_core import PciAddress
from dp_server.binder import Binder
from dp_server.config_file import parse_config

from e2e_harness import Harness
from fake_kernel import FakeKernel

NIC = "intel.com/x710"
T4 = "nvidia.com/TU104GL_Tesla_T4"
AUDIO = "nvidia.com/gpu_audio"

CONFIG = """
permittedHostDevices:
  pciHostDevices:
    - {pciVendorSelector: "8086:1572", resourceName: "intel.com/x710"}
    - {pciVendorSelector: "10DE:1EB8", resourceName: "nvidia.com/TU104GL_Tesla_T4"}
    - {pciVendorSelector: "10DE:10F8", resourceName: "nvidia.com/gpu_audio"}
    - {pciVendorSelector: "1A03:2000", resourceName: "example.com/bmc_vga"}
sharedDevices:
  devices.kubevirt.io/kvm: {enabled: false}
  devices.kubevirt.io/tun: {enabled: false}
  devices.kubevirt.io/vhost-net: {enabled: false}
binding:
  replaceDrivers: [i40e, snd_hda_intel, ast]
"""


@pytest.fixture
async def harness():  # type: ignore[no-untyped-def]
    h = Harness()
    try:
        yield h
    finally:
        await h.close()


def health(harness: Harness, resource: str) -> dict[str, bool]:
    assert harness.emulator is not None
    state = harness.emulator.resources().get(resource)
    return {} if state is None else {i: d.healthy for i, d in state.devices.items()}


async def test_selected_devices_move_to_vfio_and_turn_healthy(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    kernel = FakeKernel(harness.sysfs, harness.dev)
    harness.start_kubelet()
    await harness.start_server(
        parse_config(CONFIG, "<test>"), binder=Binder(str(harness.sysfs), kernel.write)
    )

    # The NIC and the GPU's audio function move; the GPU whose group the audio
    # function blocked becomes usable with it.
    assert await harness.wait(
        lambda e: (
            health(harness, NIC) == {"0000:18:00.0": True}
            and health(harness, T4).get("0000:d8:00.0") is True
            and health(harness, AUDIO).get("0000:d8:00.1") is True
        ),
        timeout=10,
    ), (health(harness, NIC), health(harness, T4), health(harness, AUDIO))
    assert kernel.driver("0000:18:00.0") == "vfio-pci"
    assert kernel.driver("0000:d8:00.1") == "vfio-pci"
    assert (harness.dev / "vfio" / "18").exists()

    # The boot display is selected and its driver listed, but never touched.
    assert kernel.addresses_written() == {"0000:18:00.0", "0000:d8:00.1"}
    assert kernel.driver("0000:03:00.0") == "ast"
    assert kernel.override("0000:03:00.0") == "(null)"
    assert harness.runtime is not None
    (vga,) = [s for s in harness.runtime.node.inventory.skipped if s.id == "0000:03:00.0"]
    assert "boot display" in vga.reason
    # The order DESIGN.md §6 asks for: override, unbind, probe.
    assert [path for path, _ in kernel.writes if "18:00.0" in path or _ == "0000:18:00.0"] == [
        "bus/pci/devices/0000:18:00.0/driver_override",
        "bus/pci/drivers/i40e/unbind",
        "bus/pci/drivers_probe",
    ]
    logged = [
        (r.getMessage(), r.dp_fields.get("device"))  # type: ignore[attr-defined]
        for r in caplog.records
        if r.getMessage() in ("bind", "bound")
    ]
    assert sorted(logged) == [
        ("bind", "0000:18:00.0"),
        ("bind", "0000:d8:00.1"),
        ("bound", "0000:18:00.0"),
        ("bound", "0000:d8:00.1"),
    ]


async def test_a_failed_bind_gives_the_device_back_and_the_server_keeps_serving(
    harness: Harness,
) -> None:
    kernel = FakeKernel(harness.sysfs, harness.dev)
    kernel.busy.add("0000:18:00.0")
    harness.start_kubelet()
    runtime = await harness.start_server(
        parse_config(CONFIG, "<test>"), binder=Binder(str(harness.sysfs), kernel.write)
    )
    assert await harness.wait(lambda e: health(harness, AUDIO).get("0000:d8:00.1") is True, 10)

    async def skipped_reason() -> str:
        for _ in range(100):
            found = [s for s in runtime.node.inventory.skipped if s.id == "0000:18:00.0"]
            if found and "failed" in found[0].reason:
                return found[0].reason
            await asyncio.sleep(0.05)
        raise AssertionError(runtime.node.inventory.skipped)

    reason = await skipped_reason()
    assert "writing '0000:18:00.0' to" in reason and "i40e/unbind failed" in reason
    assert "given back to i40e" in reason
    # Still on its driver, with the override it had.
    assert kernel.driver("0000:18:00.0") == "i40e"
    assert kernel.override("0000:18:00.0") == "(null)"
    assert health(harness, NIC) == {}
    # A rescan does not try again.
    writes = len(kernel.writes)
    runtime.rescan()
    await asyncio.sleep(0.2)
    assert len(kernel.writes) == writes


async def test_a_driver_that_changed_since_the_scan_is_left_alone(harness: Harness) -> None:
    kernel = FakeKernel(harness.sysfs, harness.dev)
    binder = Binder(str(harness.sysfs), kernel.write)
    error = binder.bind(PciAddress.parse("0000:18:00.0"), "ixgbe")
    assert error == "its driver is i40e now, not ixgbe as scanned; left alone"
    assert kernel.writes == []


async def test_a_probe_that_does_not_reach_vfio_gives_the_device_back(harness: Harness) -> None:
    kernel = FakeKernel(harness.sysfs, harness.dev)
    # vfio-pci unloaded between the scan and the bind: the probe finds no driver.
    vfio = harness.sysfs / "bus/pci/drivers/vfio-pci"
    vfio.rename(vfio.with_name("vfio-pci.unloaded"))
    error = Binder(str(harness.sysfs), kernel.write).bind(PciAddress.parse("0000:18:00.0"), "i40e")
    assert error == "after drivers_probe it is bound to no driver; given back to i40e"
    assert kernel.driver("0000:18:00.0") == "i40e"
    assert kernel.override("0000:18:00.0") == "(null)"
    assert [path for path, _ in kernel.writes] == [
        "bus/pci/devices/0000:18:00.0/driver_override",
        "bus/pci/drivers/i40e/unbind",
        "bus/pci/drivers_probe",
        "bus/pci/devices/0000:18:00.0/driver_override",
        "bus/pci/drivers_probe",
    ]
