"""Binding end to end: the runtime moves selected devices on the fixture host to
vfio-pci through a fake kernel, and the kubelet emulator sees them turn Healthy."""

from __future__ import annotations

import asyncio
import errno
import logging
import threading

import attrs
import pytest

from dp_core import VFIO_DRIVER, BindDevice, ConfigApplied, Move, PciAddress
from dp_server.binding import queue as bind_queue
from dp_server.binding.binder import Binder
from dp_server.binding.moves_file import MOVES_FILE, read_moves, write_moves
from dp_server.config.loader import parse_config
from dp_testing.topology import fixture_topology, write_sysfs

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
    # The order docs/design.md §6 asks for: override, unbind, probe.
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
    # The kubelet hears of it with the next device list, on its own thread.
    assert await harness.wait(lambda e: health(harness, NIC) == {}, 5), health(harness, NIC)
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


async def test_virtual_functions_enabled_since_the_scan_leave_the_function_alone(
    harness: Harness,
) -> None:
    """Unbinding a physical function's driver destroys its VFs: enabled between
    the scan and the bind, they stop it before anything is written."""
    kernel = FakeKernel(harness.sysfs, harness.dev)
    nic = harness.sysfs / "bus/pci/devices/0000:18:00.0"
    (nic / "sriov_numvfs").write_text("2\n")
    error = Binder(str(harness.sysfs), kernel.write).bind(PciAddress.parse("0000:18:00.0"), "i40e")
    assert error is not None and "virtual functions enabled (sriov_numvfs '2'" in error
    assert "left alone" in error and kernel.writes == []
    (nic / "sriov_numvfs").write_text("0\n")
    (nic / "virtfn0").symlink_to("../0000:6b:00.1")  # a link the scan did not see
    error = Binder(str(harness.sysfs), kernel.write).bind(PciAddress.parse("0000:18:00.0"), "i40e")
    assert error is not None and "1 virtfn links" in error and kernel.writes == []


async def test_an_unreadable_driver_override_is_an_answer_not_an_exception(
    harness: Harness,
) -> None:
    kernel = FakeKernel(harness.sysfs, harness.dev)
    override = harness.sysfs / "bus/pci/devices/0000:18:00.0/driver_override"
    override.write_bytes(b"\xff\xfe\n")  # root can write any bytes there
    binder = Binder(str(harness.sysfs), kernel.write)
    assert binder.bind(PciAddress.parse("0000:18:00.0"), "i40e") is None
    assert kernel.driver("0000:18:00.0") == "vfio-pci"

    # Whatever goes wrong, the core hears back rather than waiting forever.
    def broken(path: str, text: str) -> None:
        raise RuntimeError("a bug")

    error = Binder(str(harness.sysfs), broken).bind(
        PciAddress.parse("0000:d8:00.1"), "snd_hda_intel"
    )
    assert error is not None and error.startswith("unexpected RuntimeError: a bug")


async def test_a_bind_the_config_withdrew_while_it_waited_writes_nothing(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """Binds run one at a time, and a driver can take seconds to let go. A
    config reload in that time that stops selecting the next device must stop
    its bind: dp never writes to a device the config does not select."""
    caplog.set_level(logging.INFO, logger="dp")
    kernel = FakeKernel(harness.sysfs, harness.dev)
    release = asyncio.Event()
    loop = asyncio.get_running_loop()

    def slow_write(path: str, text: str) -> None:
        if path.endswith("i40e/unbind"):  # the NIC's driver takes its time
            asyncio.run_coroutine_threadsafe(release.wait(), loop).result(10)
        kernel.write(path, text)

    harness.start_kubelet()
    runtime = await harness.start_server(
        parse_config(CONFIG, "<test>"), binder=Binder(str(harness.sysfs), slow_write)
    )
    for _ in range(100):  # the NIC's bind is under way, the audio's waits its turn
        if (
            any(p.endswith("i40e/unbind") for p, _ in kernel.writes)
            or len(runtime.node.bind_book.in_flight) > 1
        ):
            break
        await asyncio.sleep(0.02)
    assert runtime.node.bind_book.in_flight.keys() >= {PciAddress.parse("0000:d8:00.1")}
    without_audio = CONFIG.replace(
        '    - {pciVendorSelector: "10DE:10F8", resourceName: "nvidia.com/gpu_audio"}\n', ""
    )
    runtime.config = parse_config(without_audio, "<test>")
    runtime.feed(ConfigApplied(runtime.config, runtime.now(), {}))
    release.set()
    for _ in range(100):
        if not runtime.node.bind_book.in_flight:
            break
        await asyncio.sleep(0.05)
    assert not runtime.node.bind_book.in_flight
    assert not [
        p for p, _ in kernel.writes if "0000:d8:00.1" in p or p.endswith("hda_intel/unbind")
    ]
    assert kernel.driver("0000:d8:00.1") == "snd_hda_intel"
    assert kernel.driver("0000:18:00.0") == "vfio-pci"  # the one under way finished
    assert [r.dp_fields for r in caplog.records if r.getMessage() == "bind-withdrawn"] == [  # type: ignore[attr-defined]
        {"device": "0000:d8:00.1"}
    ]


# -- giving a group back ---------------------------------------------------------------


async def test_a_give_back_returns_a_function_to_its_driver(harness: Harness) -> None:
    kernel = FakeKernel(harness.sysfs, harness.dev)
    binder = Binder(str(harness.sysfs), kernel.write)
    nic = PciAddress.parse("0000:18:00.0")
    assert binder.bind(nic, "i40e") is None
    assert (harness.dev / "vfio" / "18").exists()
    kernel.writes.clear()
    assert binder.unbind(nic, "i40e") is None
    assert kernel.driver("0000:18:00.0") == "i40e"
    assert kernel.override("0000:18:00.0") == "(null)"
    assert not (harness.dev / "vfio" / "18").exists()
    assert kernel.writes == [
        ("bus/pci/drivers/vfio-pci/unbind", "0000:18:00.0"),
        ("bus/pci/devices/0000:18:00.0/driver_override", "\n"),
        ("bus/pci/drivers/i40e/bind", "0000:18:00.0"),
    ]


async def test_a_give_back_leaves_a_function_vfio_pci_no_longer_holds_alone(
    harness: Harness,
) -> None:
    kernel = FakeKernel(harness.sysfs, harness.dev)
    binder = Binder(str(harness.sysfs), kernel.write)
    error = binder.unbind(PciAddress.parse("0000:18:00.0"), "i40e")
    assert error == "its driver is i40e now, not vfio-pci; left alone"
    assert kernel.writes == []


async def test_a_driver_that_will_not_take_the_function_back_is_reported(
    harness: Harness,
) -> None:
    kernel = FakeKernel(harness.sysfs, harness.dev)
    binder = Binder(str(harness.sysfs), kernel.write)
    nic = PciAddress.parse("0000:18:00.0")
    assert binder.bind(nic, "i40e") is None
    kernel.refuses_bind.add("i40e")
    error = binder.unbind(nic, "i40e")
    assert error is not None and error.startswith("writing '0000:18:00.0' to ")
    assert error.endswith("i40e/bind failed: i40e does not take 0000:18:00.0")
    assert kernel.driver("0000:18:00.0") is None


GROUP_CONFIG = """
permittedHostDevices:
  pciHostDevices:
    - {pciVendorSelector: "10DE:1EB8", resourceName: "nvidia.com/TU104GL_Tesla_T4"}
    - {pciVendorSelector: "10DE:10F8", resourceName: "nvidia.com/gpu_audio"}
sharedDevices:
  devices.kubevirt.io/kvm: {enabled: false}
  devices.kubevirt.io/tun: {enabled: false}
  devices.kubevirt.io/vhost-net: {enabled: false}
binding:
  replaceDrivers: [nouveau, snd_hda_intel]
"""


async def test_a_group_that_cannot_be_moved_whole_goes_back_to_its_drivers(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """A T4 and its audio function, both on host drivers: the GPU moves first,
    then the audio function's driver will not let go. The GPU goes back to
    nouveau, rather than sit on vfio-pci in a group no VM can use."""
    caplog.set_level(logging.INFO, logger="dp")
    kernel = gpu_group_on_host_drivers(harness)
    kernel.busy.add("0000:3b:00.1")
    harness.start_kubelet()
    runtime = await harness.start_server(
        parse_config(GROUP_CONFIG, "<test>"), binder=Binder(str(harness.sysfs), kernel.write)
    )

    def given_back() -> bool:
        return any(r.getMessage() == "given-back" for r in caplog.records)

    for _ in range(200):
        if given_back() and not runtime.node.bind_book.giving_back:
            break
        await asyncio.sleep(0.05)
    assert given_back(), [r.getMessage() for r in caplog.records]
    assert kernel.driver("0000:3b:00.0") == "nouveau"
    assert kernel.driver("0000:3b:00.1") == "snd_hda_intel"
    assert kernel.override("0000:3b:00.0") == kernel.override("0000:3b:00.1") == "(null)"
    assert not (harness.dev / "vfio" / "59").exists()
    # Only selected functions were written to: the group's two, and the
    # third T4's audio function, whose move makes that T4 usable.
    assert kernel.addresses_written() == {"0000:3b:00.0", "0000:3b:00.1", "0000:d8:00.1"}
    events = [
        (r.getMessage(), r.dp_fields.get("device"))  # type: ignore[attr-defined]
        for r in caplog.records
        if r.getMessage() in ("bound", "bind-failed", "give-back", "given-back")
        and r.dp_fields.get("device", "").startswith("0000:3b")  # type: ignore[attr-defined]
    ]
    assert events == [
        ("bound", "0000:3b:00.0"),
        ("bind-failed", "0000:3b:00.1"),
        ("give-back", "0000:3b:00.0"),
        ("given-back", "0000:3b:00.0"),
    ]
    # The rescan after the give-back shows the GPU skipped, and it stays put.
    for _ in range(100):
        skipped = {s.id: s.reason for s in runtime.node.inventory.skipped}
        if "given back to nouveau" in skipped.get("0000:3b:00.0", ""):
            break
        await asyncio.sleep(0.05)
    assert "0000:3b:00.1, in the same IOMMU group, could not be moved" in skipped["0000:3b:00.0"]
    writes = len(kernel.writes)
    runtime.rescan()
    await asyncio.sleep(0.2)
    assert len(kernel.writes) == writes
    # The other T4s are served.
    assert await harness.wait(
        lambda e: health(harness, T4) == {"0000:af:00.0": True, "0000:d8:00.0": True}, 5
    ), health(harness, T4)


def gpu_group_on_host_drivers(harness: Harness) -> FakeKernel:
    """The fixture host with the first T4 and its audio function on host drivers."""
    on_host = {"0000:3b:00.0": "nouveau", "0000:3b:00.1": "snd_hda_intel"}
    topology = fixture_topology()
    topology = attrs.evolve(
        topology,
        pci=[attrs.evolve(f, driver=on_host.get(str(f.address), f.driver)) for f in topology.pci],
        dev_nodes=topology.dev_nodes - {"/dev/vfio/59"},
    )
    harness.sysfs, harness.dev = write_sysfs(topology, harness.root / "host-nouveau")
    return FakeKernel(harness.sysfs, harness.dev)


async def test_a_queued_give_back_of_a_device_the_config_dropped_writes_nothing(
    harness: Harness,
) -> None:
    """The give-back of the first T4 waits behind the third T4's audio bind; a
    reload meanwhile stops selecting T4s, so when its turn comes nothing is
    written to the GPU."""
    kernel = gpu_group_on_host_drivers(harness)
    kernel.busy.add("0000:3b:00.1")
    release = asyncio.Event()
    loop = asyncio.get_running_loop()

    def slow_write(path: str, text: str) -> None:
        if path.endswith("snd_hda_intel/unbind") and text == "0000:d8:00.1":
            asyncio.run_coroutine_threadsafe(release.wait(), loop).result(10)
        kernel.write(path, text)

    harness.start_kubelet()
    runtime = await harness.start_server(
        parse_config(GROUP_CONFIG, "<test>"), binder=Binder(str(harness.sysfs), slow_write)
    )
    gpu = PciAddress.parse("0000:3b:00.0")
    for _ in range(200):
        if gpu in runtime.node.bind_book.giving_back:
            break
        await asyncio.sleep(0.02)
    assert gpu in runtime.node.bind_book.giving_back
    without_t4 = GROUP_CONFIG.replace(
        '    - {pciVendorSelector: "10DE:1EB8", resourceName: "nvidia.com/TU104GL_Tesla_T4"}\n', ""
    )
    runtime.config = parse_config(without_t4, "<test>")
    runtime.feed(ConfigApplied(runtime.config, runtime.now(), {}))
    writes_before = len(kernel.writes)
    release.set()
    for _ in range(200):
        if not runtime.node.bind_book.giving_back and not runtime.node.bind_book.in_flight:
            break
        await asyncio.sleep(0.02)
    assert not runtime.node.bind_book.giving_back
    late = kernel.writes[writes_before:]
    assert [w for w in late if "0000:3b:00.0" in w[0] or w[1] == "0000:3b:00.0"] == []
    assert kernel.driver("0000:3b:00.0") == "vfio-pci"


async def test_a_give_back_restores_the_override_the_function_had(harness: Harness) -> None:
    """An administrator's pin (or pci-stub's) held the function on its driver:
    the give-back puts it back before binding, rather than clearing it."""
    kernel = FakeKernel(harness.sysfs, harness.dev)
    (harness.sysfs / "bus/pci/devices/0000:18:00.0/driver_override").write_text("i40e\n")
    nic = PciAddress.parse("0000:18:00.0")
    assert Binder(str(harness.sysfs), kernel.write).move(nic, "i40e") == (None, True)
    assert kernel.override("0000:18:00.0") == "vfio-pci"
    kernel.writes.clear()
    # Given back by another binder (a restarted dp), told of the pin by the core.
    assert Binder(str(harness.sysfs), kernel.write).unbind(nic, "i40e", pinned=True) is None
    assert kernel.override("0000:18:00.0") == "i40e"
    assert kernel.driver("0000:18:00.0") == "i40e"
    assert ("bus/pci/devices/0000:18:00.0/driver_override", "i40e") in kernel.writes


async def test_an_override_that_did_not_hold_the_function_is_not_restored(
    harness: Harness,
) -> None:
    """i40e holds the NIC while driver_override names pci-stub (an
    administrator's, for later): putting that back would stop the NIC's
    rebind to i40e, so the give-back clears it instead."""
    kernel = FakeKernel(harness.sysfs, harness.dev)
    (harness.sysfs / "bus/pci/devices/0000:18:00.0/driver_override").write_text("pci-stub\n")
    binder = Binder(str(harness.sysfs), kernel.write)
    nic = PciAddress.parse("0000:18:00.0")
    assert binder.move(nic, "i40e") == (None, False)
    assert binder.unbind(nic, "i40e", pinned=False) is None
    assert kernel.driver("0000:18:00.0") == "i40e"
    assert kernel.override("0000:18:00.0") == "(null)"


async def test_a_bind_of_a_function_already_on_vfio_pci_writes_nothing(harness: Harness) -> None:
    """A plan from a scan older than an earlier bind, or something else (libvirt,
    driverctl) that put the function on vfio-pci first: the bind is withdrawn
    unwritten, and dp does not count the function as one it moved."""
    kernel = FakeKernel(harness.sysfs, harness.dev)
    harness.start_kubelet()
    runtime = await harness.start_server(
        parse_config(CONFIG, "<test>"), binder=Binder(str(harness.sysfs), kernel.write)
    )
    for _ in range(200):  # the binds the config asks for are done
        if not runtime.node.bind_book.in_flight and len(kernel.writes) >= 6:
            break
        await asyncio.sleep(0.02)
    kernel.writes.clear()
    on_vfio = PciAddress.parse("0000:3b:00.0")
    queue = bind_queue.BindQueue(
        Binder(str(harness.sysfs), kernel.write),
        lambda make: pytest.fail("carrying a write out asks the core nothing"),
        runtime.feed,
        runtime.now,
        runtime.stopping,
        lambda: None,
    )
    result = queue.carry_out(BindDevice(on_vfio, "nouveau"))
    assert result == (None, True, False)
    assert kernel.writes == []
    direct = Binder(str(harness.sysfs), kernel.write).bind(on_vfio, "nouveau")
    assert direct == "its driver is vfio-pci now, not nouveau as scanned; left alone"


def gpu_on_vfio_audio_on_host(harness: Harness) -> FakeKernel:
    """The fixture host with the first T4 on vfio-pci and its audio function on
    snd_hda_intel: an earlier run moved the one and not yet the other."""
    topology = fixture_topology()
    audio = "0000:3b:00.1"
    topology = attrs.evolve(
        topology,
        pci=[
            attrs.evolve(f, driver="snd_hda_intel") if str(f.address) == audio else f
            for f in topology.pci
        ],
    )
    harness.sysfs, harness.dev = write_sysfs(topology, harness.root / "host-half")
    (harness.sysfs / "bus/pci/drivers/nouveau").mkdir()  # loaded, driving nothing now
    return FakeKernel(harness.sysfs, harness.dev)


@pytest.mark.parametrize("kept", ["moved", "moved, pinned", ""])
async def test_a_restarted_dp_gives_back_what_an_earlier_run_moved(
    harness: Harness, caplog: pytest.LogCaptureFixture, kept: str
) -> None:
    """The earlier run moved the T4 from nouveau and stopped before moving its
    audio function, whose driver will not let go now. With the moves file the
    restarted dp knows the T4 is its own to give back; without it, the T4 is
    just a function on vfio-pci, and dp leaves it alone. A driver_override that
    pinned the T4 to nouveau before the move is written back."""
    caplog.set_level(logging.INFO, logger="dp")
    gpu, audio = "0000:3b:00.0", "0000:3b:00.1"
    kernel = gpu_on_vfio_audio_on_host(harness)
    kernel.busy.add(audio)
    state = harness.root / "state"
    if kept:
        move = Move(PciAddress.parse(gpu), "nouveau", 59, pinned="pinned" in kept)
        write_moves(state / MOVES_FILE, (move,))
    harness.start_kubelet()
    runtime = await harness.start_server(
        parse_config(GROUP_CONFIG, "<test>"),
        binder=Binder(str(harness.sysfs), kernel.write),
        state_dir=str(state),
    )

    def logged(event: str, device: str) -> bool:
        return any(
            r.getMessage() == event and r.dp_fields.get("device") == device  # type: ignore[attr-defined]
            for r in caplog.records
        )

    for _ in range(200):
        done = logged("given-back", gpu) if kept else logged("bind-failed", audio)
        if done and not runtime.node.bind_book.giving_back:
            break
        await asyncio.sleep(0.05)
    assert logged("bind-failed", audio)
    if kept:
        assert logged("given-back", gpu)
        assert kernel.driver(gpu) == "nouveau"
        assert kernel.override(gpu) == ("nouveau" if "pinned" in kept else "(null)")
    else:
        assert kernel.driver(gpu) == VFIO_DRIVER
        assert gpu not in kernel.addresses_written()
    assert kernel.driver(audio) == "snd_hda_intel"
    # What is left moved: the third T4's audio function, moved in this run.
    third_audio = Move(PciAddress.parse("0000:d8:00.1"), "snd_hda_intel", 216)
    for _ in range(100):
        if read_moves(state / MOVES_FILE) == (third_audio,):
            break
        await asyncio.sleep(0.05)
    assert read_moves(state / MOVES_FILE) == (third_audio,)


async def test_what_dp_moves_is_kept_in_the_state_directory(harness: Harness) -> None:
    kernel = gpu_group_on_host_drivers(harness)
    state = harness.root / "state"
    harness.start_kubelet()
    runtime = await harness.start_server(
        parse_config(GROUP_CONFIG, "<test>"),
        binder=Binder(str(harness.sysfs), kernel.write),
        state_dir=str(state),
    )
    expected = (
        Move(PciAddress.parse("0000:3b:00.0"), "nouveau", 59),
        Move(PciAddress.parse("0000:3b:00.1"), "snd_hda_intel", 59),
        Move(PciAddress.parse("0000:d8:00.1"), "snd_hda_intel", 216),
    )
    for _ in range(200):
        if (state / MOVES_FILE).exists() and read_moves(state / MOVES_FILE) == expected:
            break
        await asyncio.sleep(0.05)
    assert read_moves(state / MOVES_FILE) == expected
    assert runtime.node.bind_book.moves() == expected


async def test_a_move_that_ends_while_dp_stops_is_kept_in_the_file(harness: Harness) -> None:
    """SIGTERM during a bind: the thread finishes the write anyway, so dp
    waits for it and records the move; else a restarted dp could not give it back."""
    kernel = gpu_group_on_host_drivers(harness)
    entered, release = threading.Event(), threading.Event()
    held: list[str] = []

    def slow_write(path: str, text: str) -> None:
        if path.endswith("drivers_probe") and not held:
            held.append(text)
            entered.set()
            release.wait(10)
        kernel.write(path, text)

    state = harness.root / "state"
    harness.start_kubelet()
    runtime = await harness.start_server(
        parse_config(GROUP_CONFIG, "<test>"),
        binder=Binder(str(harness.sysfs), slow_write),
        state_dir=str(state),
    )
    assert await asyncio.to_thread(entered.wait, 10)
    runtime.stop()
    await asyncio.sleep(0.2)
    release.set()
    assert harness._serving is not None
    await asyncio.wait_for(harness._serving, 10)
    assert kernel.driver(held[0]) == VFIO_DRIVER
    assert [str(m.address) for m in read_moves(state / MOVES_FILE)] == [held[0]]


async def test_a_give_back_cut_short_by_a_stop_keeps_the_move(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restarted dp gives back the T4 an earlier run moved; SIGTERM comes
    while vfio-pci's unbind hangs past the stop wait (a VM outside Kubernetes
    holds the device). The T4 is still on vfio-pci and the outcome unknown, so
    the moves file still names it, for the next dp to give back."""
    monkeypatch.setattr(bind_queue, "STOP_WAIT", 0.3)
    gpu, audio = "0000:3b:00.0", "0000:3b:00.1"
    kernel = gpu_on_vfio_audio_on_host(harness)
    kernel.busy.add(audio)
    state = harness.root / "state"
    write_moves(state / MOVES_FILE, (Move(PciAddress.parse(gpu), "nouveau", 59),))
    entered, release = threading.Event(), threading.Event()

    def slow_write(path: str, text: str) -> None:
        if path.endswith(f"drivers/{VFIO_DRIVER}/unbind") and text == gpu:
            entered.set()
            release.wait(10)
            raise OSError(errno.EBUSY, "device or resource busy")
        kernel.write(path, text)

    harness.start_kubelet()
    runtime = await harness.start_server(
        parse_config(GROUP_CONFIG, "<test>"),
        binder=Binder(str(harness.sysfs), slow_write),
        state_dir=str(state),
    )
    try:
        assert await asyncio.to_thread(entered.wait, 10)
        runtime.stop()
        assert harness._serving is not None
        await asyncio.wait_for(asyncio.shield(harness._serving), 5)
        assert kernel.driver(gpu) == VFIO_DRIVER
        assert gpu in [str(m.address) for m in read_moves(state / MOVES_FILE)]
    finally:
        release.set()
