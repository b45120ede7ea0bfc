"""The sysfs scanner: the fixture node, malformed trees, generated hosts, the real /sys."""

from __future__ import annotations

import gc
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
from hypothesis import given, settings

from dp_core import HostSnapshot, PciAddress, ScanProblem, VfioDevEntry
from dp_server.host import scanner
from dp_server.host.scanner import UNKNOWN_CLASS, UNKNOWN_DRIVER, scan_host
from dp_testing.generator import generate_topology
from dp_testing.strategies import topologies
from dp_testing.topology import (
    SHARED_DEV_PATHS,
    Topology,
    fixture_topology,
    iommufd_guest_topology,
    to_snapshot,
    write_sysfs,
)

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "sysfs"
A = PciAddress.parse


def _expected() -> HostSnapshot:
    return to_snapshot(fixture_topology(), SHARED_DEV_PATHS)


@pytest.fixture(scope="module")
def fixture_scan() -> HostSnapshot:
    return scan_host(FIXTURE / "sys", FIXTURE / "dev", SHARED_DEV_PATHS)


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    """A private copy of the committed fixture, to break."""
    shutil.copytree(FIXTURE / "sys", tmp_path / "sys", symlinks=True)
    shutil.copytree(FIXTURE / "dev", tmp_path / "dev", symlinks=True)
    return tmp_path / "sys", tmp_path / "dev"


def _dir(sysfs: Path, address: str) -> Path:
    """The real directory of a function (what its bus/pci/devices link points at)."""
    link = sysfs / "bus" / "pci" / "devices" / address
    return link.parent / os.readlink(link)


def _scan(tree: tuple[Path, Path]) -> HostSnapshot:
    return scan_host(tree[0], tree[1], SHARED_DEV_PATHS)


def _problem_paths(snapshot: HostSnapshot) -> set[str]:
    return {p.path for p in snapshot.problems}


def _without(
    snapshot: HostSnapshot, addresses: set[str], groups: frozenset[int] | set[int] = frozenset()
) -> HostSnapshot:
    """`snapshot` minus some functions (and whole groups), for "everything else intact"."""
    gone = {A(a) for a in addresses}
    return attrs.evolve(
        snapshot,
        pci_devices=[d for d in snapshot.pci_devices if d.address not in gone],
        iommu_groups=[g for g in snapshot.iommu_groups if g.number not in groups],
        problems=(),
    )


def _assert_logged_once(
    caplog: pytest.LogCaptureFixture, tree: tuple[Path, Path], path: str
) -> HostSnapshot:
    """Scan twice; the problem at `path` is in both results but logged only once."""
    caplog.set_level(logging.WARNING, logger="dp.scanner")
    first = _scan(tree)
    second = _scan(tree)
    assert path in _problem_paths(first)
    assert first.problems == second.problems
    lines = [r for r in caplog.records if r.name == "dp.scanner" and path in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    return first


# --------------------------------------------------------------------------
# The committed fixture node


def test_fixture_scan_equals_the_description(fixture_scan: HostSnapshot) -> None:
    expected = _expected()
    assert fixture_scan.problems == ()
    assert fixture_scan.pci_devices == expected.pci_devices
    assert fixture_scan.iommu_groups == expected.iommu_groups
    assert fixture_scan.mdev_types == expected.mdev_types
    assert fixture_scan.mdevs == expected.mdevs
    assert fixture_scan.dev_nodes == expected.dev_nodes
    assert fixture_scan == expected
    assert len(fixture_scan.pci_devices) == 17


def test_fixture_misconfigured_gpu_group_is_not_viable(fixture_scan: HostSnapshot) -> None:
    group = fixture_scan.group(216)
    assert group is not None
    assert [str(m.address) for m in group.members] == ["0000:d8:00.0", "0000:d8:00.1"]
    viability = group.viability
    assert not viability.viable
    assert viability.blockers == ((A("0000:d8:00.1"), "snd_hda_intel"),)
    assert "snd_hda_intel" in viability.reason
    assert fixture_scan.has_dev_node("/dev/vfio/216")  # the node exists all the same
    for number in (59, 175):
        assert fixture_scan.group(number).viability.viable  # type: ignore[union-attr]


def test_fixture_bridge_group_has_three_members_two_endpoints(
    fixture_scan: HostSnapshot,
) -> None:
    group = fixture_scan.group(93)
    assert group is not None
    assert [str(m.address) for m in group.members] == [
        "0000:5d:00.0",
        "0000:5e:00.0",
        "0000:5e:01.0",
    ]
    assert [str(m.address) for m in group.endpoints] == ["0000:5e:00.0", "0000:5e:01.0"]
    assert group.members[0].is_bridge and group.members[0].driver is None
    assert group.viability.viable


def test_fixture_qat_sriov_links(fixture_scan: HostSnapshot) -> None:
    pf = fixture_scan.device(A("0000:6b:00.0"))
    assert pf is not None and pf.driver == "4xxx" and pf.physfn is None
    assert [str(v) for v in pf.virtfns] == [f"0000:6b:00.{n}" for n in range(1, 5)]
    for n, vf_address in enumerate(pf.virtfns, start=1):
        vf = fixture_scan.device(vf_address)
        assert vf is not None
        assert vf.physfn == pf.address and vf.is_virtual_function
        assert (vf.vendor, vf.device, vf.driver) == (0x8086, 0x4941, "vfio-pci")
        assert vf.iommu_group == 107 + n
        assert [m.address for m in fixture_scan.group(vf.iommu_group).members] == [vf_address]  # type: ignore[union-attr]
    assert not fixture_scan.has_dev_node("/dev/vfio/111")
    assert fixture_scan.has_dev_node("/dev/vfio/110")


def test_fixture_mdev_types_and_mdevs(fixture_scan: HostSnapshot) -> None:
    parent = A("0000:86:00.0")
    types = fixture_scan.mdev_types
    # The parent by its device name, as class/mdev_bus lists it, and its address.
    assert [
        (t.parent, t.parent_address, t.type_id, t.name, t.available_instances) for t in types
    ] == [
        ("0000:86:00.0", parent, "nvidia-259", "GRID RTX6000-4Q", 2),
        ("0000:86:00.0", parent, "nvidia-260", "GRID RTX6000-8Q", 1),
    ]
    assert [
        (m.uuid, m.parent, m.parent_address, m.type_id, m.iommu_group) for m in fixture_scan.mdevs
    ] == [
        ("4b20d080-1b54-4048-85b3-a6a62d165c01", "0000:86:00.0", parent, "nvidia-259", 300),
        ("9d9bfc6e-2f41-4a34-a2d4-3a0c9e0b7d02", "0000:86:00.0", parent, "nvidia-259", 301),
        ("c5e1f7a2-8b3d-4e6f-9a1c-2d4b6f8e0a03", "0000:86:00.0", parent, "nvidia-260", 302),
    ]
    names = [fixture_scan.mdev_type_name(m) for m in fixture_scan.mdevs]
    assert names == ["GRID RTX6000-4Q", "GRID RTX6000-4Q", "GRID RTX6000-8Q"]
    for mdev in fixture_scan.mdevs:
        group = fixture_scan.group(mdev.iommu_group)
        assert group is not None and group.members == ()  # an mdev group has no PCI member
        assert fixture_scan.has_dev_node(f"/dev/vfio/{mdev.iommu_group}")
    quadro = fixture_scan.device(parent)
    assert quadro is not None and quadro.driver == "nvidia" and not quadro.boot_vga


def test_fixture_boot_vga(fixture_scan: HostSnapshot) -> None:
    boot = [d for d in fixture_scan.pci_devices if d.boot_vga]
    assert [(str(d.address), d.vendor, d.device, d.driver) for d in boot] == [
        ("0000:03:00.0", 0x1A03, 0x2000, "ast")
    ]


def test_fixture_dev_nodes(fixture_scan: HostSnapshot) -> None:
    groups = {59, 93, 108, 109, 110, 175, 216, 300, 301, 302}
    # The VFIO character device of 0000:6b:00.1 and iommufd's node, since issue 19.
    cdev = {"/dev/vfio/devices/vfio0", "/dev/iommu"}
    assert fixture_scan.dev_nodes == frozenset(
        {"/dev/vfio/vfio", *SHARED_DEV_PATHS} | {f"/dev/vfio/{g}" for g in groups} | cdev
    )
    # Only asked-for shared paths are reported; VFIO nodes always are.
    only_kvm = scan_host(FIXTURE / "sys", FIXTURE / "dev", ["/dev/kvm", "/dev/nope"])
    assert only_kvm.dev_nodes == frozenset(
        {"/dev/vfio/vfio", "/dev/kvm"} | {f"/dev/vfio/{g}" for g in groups} | cdev
    )


def test_scan_accepts_str_roots_and_is_stable(fixture_scan: HostSnapshot) -> None:
    again = scan_host(str(FIXTURE / "sys"), str(FIXTURE / "dev"), SHARED_DEV_PATHS)
    assert again == fixture_scan


# --------------------------------------------------------------------------
# Malformed trees: the scan completes, the bad function is skipped or degraded,
# everything else is intact, a ScanProblem names the path, logged once.


def test_missing_vendor_skips_the_function_and_its_group(
    tree: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    vendor = _dir(tree[0], "0000:6b:00.2") / "vendor"
    vendor.unlink()
    path = str(tree[0] / "bus/pci/devices/0000:6b:00.2/vendor")
    result = _assert_logged_once(caplog, tree, path)
    assert result.device(A("0000:6b:00.2")) is None
    # Group 109 lists a member that could not be read: its viability is unknown,
    # so the group is left out rather than reported viable.
    assert result.group(109) is None
    assert any("/kernel/iommu_groups/109/devices/0000:6b:00.2" in p for p in _problem_paths(result))
    assert _without(result, set()) == _without(_expected(), {"0000:6b:00.2"}, {109})


def test_garbage_numa_node_is_unknown(
    tree: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    (_dir(tree[0], "0000:3b:00.0") / "numa_node").write_text("banana\n")
    path = str(tree[0] / "bus/pci/devices/0000:3b:00.0/numa_node")
    result = _assert_logged_once(caplog, tree, path)
    gpu = result.device(A("0000:3b:00.0"))
    assert gpu is not None and gpu.numa_node is None and gpu.driver == "vfio-pci"
    assert [p.path for p in result.problems] == [path]
    expected = _expected()
    fixed = [
        attrs.evolve(d, numa_node=None) if str(d.address) == "0000:3b:00.0" else d
        for d in expected.pci_devices
    ]
    assert result.pci_devices == tuple(fixed)


@pytest.mark.parametrize("garbage", ["0xzzzzzz", "", "0x1000000", "-0x1"])
def test_garbage_class_is_unknown_endpoint(
    tree: tuple[Path, Path], caplog: pytest.LogCaptureFixture, garbage: str
) -> None:
    (_dir(tree[0], "0000:5d:00.0") / "class").write_text(garbage + "\n")
    path = str(tree[0] / "bus/pci/devices/0000:5d:00.0/class")
    result = _assert_logged_once(caplog, tree, path)
    bridge = result.device(A("0000:5d:00.0"))
    assert bridge is not None and bridge.class_code == UNKNOWN_CLASS and not bridge.is_bridge
    # It now counts as an endpoint; with no driver it still does not block.
    group = result.group(93)
    assert group is not None and len(group.endpoints) == 3 and group.viability.viable
    assert [p.path for p in result.problems] == [path]


def test_dangling_driver_link_blocks_the_group(
    tree: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    link = _dir(tree[0], "0000:5e:00.0") / "driver"
    link.unlink()
    link.symlink_to("../../../../bus/pci/drivers/vanished")
    path = str(tree[0] / "bus/pci/devices/0000:5e:00.0/driver")
    result = _assert_logged_once(caplog, tree, path)
    drive = result.device(A("0000:5e:00.0"))
    assert drive is not None and drive.driver == UNKNOWN_DRIVER
    # Unknown is not "no driver": the group must not be reported viable.
    group = result.group(93)
    assert group is not None and not group.viability.viable
    assert [p.path for p in result.problems] == [path]
    assert "dangling" in result.problems[0].reason


def test_dangling_iommu_group_link(
    tree: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    link = _dir(tree[0], "0000:6b:00.3") / "iommu_group"
    link.unlink()
    link.symlink_to("../../../kernel/iommu_groups/999")
    path = str(tree[0] / "bus/pci/devices/0000:6b:00.3/iommu_group")
    result = _assert_logged_once(caplog, tree, path)
    vf = result.device(A("0000:6b:00.3"))
    assert vf is not None and vf.iommu_group is None and vf.driver == "vfio-pci"
    # The kernel still lists the VF in group 110, which now disagrees with the VF.
    assert result.group(110) is None
    assert result.group(999) is None
    assert result.group(109) is not None and result.group(111) is not None


def test_function_disappearing_mid_scan(
    tree: tuple[Path, Path], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hot-unplug between listing bus/pci/devices and reading the function."""
    victim = _dir(tree[0], "0000:af:00.1")
    real_scandir = os.scandir

    class _Listing(list[os.DirEntry[str]]):
        def __enter__(self) -> _Listing:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

    def racing_scandir(path: str) -> _Listing:
        with real_scandir(path) as it:
            entries = _Listing(it)
        if str(path).endswith("bus/pci/devices") and victim.exists():
            shutil.rmtree(victim)
        return entries

    monkeypatch.setattr(os, "scandir", racing_scandir)
    caplog.set_level(logging.WARNING, logger="dp.scanner")
    result = _scan(tree)
    path = str(tree[0] / "bus/pci/devices/0000:af:00.1")
    assert path in _problem_paths(result)
    assert result.device(A("0000:af:00.1")) is None
    assert result.device(A("0000:af:00.0")) is not None
    assert result.group(175) is None  # lists a member that is gone
    assert _without(result, set()) == _without(_expected(), {"0000:af:00.1"}, {175})
    # Second scan: the function is gone for good, but its bus/pci/devices link
    # and its group entry still dangle: same problem, not logged again.
    second = _scan(tree)
    assert second.device(A("0000:af:00.1")) is None and second.group(175) is None
    lines = [r for r in caplog.records if path in r.getMessage()]
    assert len(lines) == 1


@pytest.mark.parametrize(
    ("name", "address", "check"),
    [
        ("vendor", "0000:6b:00.1", "skipped"),
        ("boot_vga", "0000:86:00.0", "boot_vga"),
        ("numa_node", "0000:d8:00.0", "numa"),
    ],
)
def test_unreadable_file(
    tree: tuple[Path, Path],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    address: str,
    check: str,
) -> None:
    """PermissionError on one attribute (tests run as root, so chmod would not stop a read)."""
    path = str(tree[0] / "bus/pci/devices" / address / name)
    real_read = scanner._read_attribute

    def guarded(attribute_path: str, dir_fd: int | None = None) -> str:
        if attribute_path == path:
            raise PermissionError(13, "Permission denied", attribute_path)
        return real_read(attribute_path, dir_fd)

    monkeypatch.setattr(scanner, "_read_attribute", guarded)
    result = _assert_logged_once(caplog, tree, path)
    assert "permission denied" in next(p.reason for p in result.problems if p.path == path)
    dev = result.device(A(address))
    if check == "skipped":
        assert dev is None
        assert _without(result, set()) == _without(_expected(), {address}, {108})
    elif check == "boot_vga":
        # Unknown boot_vga reads as True: the server then never rebinds it.
        assert dev is not None and dev.boot_vga
    else:
        assert dev is not None and dev.numa_node is None


def test_non_address_directory_name(
    tree: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    odd = tree[0] / "bus" / "pci" / "devices" / "not-a-function"
    odd.mkdir()
    (odd / "vendor").write_text("0x8086\n")
    (odd / "device").write_text("0x1572\n")
    result = _assert_logged_once(caplog, tree, str(odd))
    assert _without(result, set()) == _without(_expected(), set())
    assert [p.path for p in result.problems] == [str(odd)]


def test_group_member_that_is_not_a_device(tree: tuple[Path, Path]) -> None:
    members = tree[0] / "kernel" / "iommu_groups" / "59" / "devices"
    (members / "0000:3b:00.2").symlink_to("../../../../devices/pci0000:3b/0000:3b:00.2")
    result = _scan(tree)
    assert result.group(59) is None
    assert str(members / "0000:3b:00.2") in _problem_paths(result)
    assert result.device(A("0000:3b:00.0")) is not None


def test_function_claiming_a_group_that_does_not_list_it(tree: tuple[Path, Path]) -> None:
    (tree[0] / "kernel" / "iommu_groups" / "216" / "devices" / "0000:d8:00.1").unlink()
    result = _scan(tree)
    group = result.group(216)
    # Counted as a member all the same (the safer reading), and reported.
    assert group is not None and len(group.members) == 2 and not group.viability.viable
    assert str(tree[0] / "bus/pci/devices/0000:d8:00.1/iommu_group") in _problem_paths(result)


def test_mdev_oddities(tree: tuple[Path, Path]) -> None:
    mdevs = tree[0] / "bus" / "mdev" / "devices"
    (mdevs / "not-a-uuid").symlink_to("../../../devices/pci0000:86/0000:86:00.0")
    type_dir = tree[0] / "class/mdev_bus/0000:86:00.0/mdev_supported_types"
    (type_dir / "nvidia-260" / "available_instances").write_text("lots\n")
    (type_dir / "nvidia-259" / "name").unlink()
    result = _scan(tree)
    assert [m.uuid for m in result.mdevs] == [m.uuid for m in _expected().mdevs]
    assert [(t.type_id, t.available_instances) for t in result.mdev_types] == [("nvidia-260", None)]
    assert {str(mdevs / "not-a-uuid"), str(type_dir / "nvidia-259" / "name")} <= _problem_paths(
        result
    )


def test_dev_paths_outside_dev_are_refused(tree: tuple[Path, Path]) -> None:
    result = scan_host(tree[0], tree[1], ["/etc/passwd", "/dev/../etc/passwd", "/dev/kvm"])
    assert "/dev/kvm" in result.dev_nodes
    assert {"/etc/passwd", "/dev/../etc/passwd"} <= _problem_paths(result)
    assert not any("passwd" in node for node in result.dev_nodes)


def test_empty_and_missing_roots_do_not_raise_and_are_named(tmp_path: Path) -> None:
    """A root that is not one is a host with nothing on it, and a problem that says so."""
    nothing, none = tmp_path / "nothing", tmp_path / "none"
    assert scan_host(nothing, none) == HostSnapshot(
        pci_drivers=(),
        problems=(
            ScanProblem(str(none), "does not exist; --dev must be /dev or a copy of it"),
            ScanProblem(str(nothing), "does not exist; --sysfs must be /sys or a copy of it"),
        ),
    )
    (tmp_path / "sys" / "bus" / "pci").mkdir(parents=True)
    (tmp_path / "sys" / "bus" / "pci" / "devices").write_text("not a directory")
    (tmp_path / "dev" / "vfio").mkdir(parents=True)
    result = scan_host(tmp_path / "sys", tmp_path / "dev")
    assert result.pci_devices == () and len(result.problems) == 1
    # One level too high: the roots below are named.
    result = scan_host(tmp_path, tmp_path)
    assert {(p.path, p.reason) for p in result.problems} >= {
        (
            str(tmp_path),
            f"is not /sys or a copy of it, but {tmp_path / 'sys'} is: "
            f"did you mean --sysfs {tmp_path / 'sys'}?",
        ),
        (
            str(tmp_path),
            f"is not /dev or a copy of it, but {tmp_path / 'dev'} is: "
            f"did you mean --dev {tmp_path / 'dev'}?",
        ),
    }


def test_scan_of_a_linux_6_12_guest(tmp_path: Path) -> None:
    """mdev parents that are no PCI function, as Linux 6.12's sample drivers
    lay them out: types from `class/mdev_bus/<name>`, each mdev in its own group."""
    topology = iommufd_guest_topology()
    sysfs, dev = write_sysfs(topology, tmp_path)
    assert os.readlink(sysfs / "class/mdev_bus/mtty") == "../../devices/virtual/mtty/mtty"
    mdev = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1001"
    assert os.readlink(sysfs / "bus/mdev/devices" / mdev) == (
        f"../../../devices/virtual/mtty/mtty/{mdev}"
    )
    result = scan_host(sysfs, dev, SHARED_DEV_PATHS)
    assert result == to_snapshot(topology, SHARED_DEV_PATHS)
    assert result.problems == ()
    assert [(t.parent, t.parent_address, t.type_id) for t in result.mdev_types][:2] == [
        ("mdpy", None, "mdpy-hd"),
        ("mdpy", None, "mdpy-vga"),
    ]
    by_uuid = {m.uuid: m for m in result.mdevs}
    assert (by_uuid[mdev].parent, by_uuid[mdev].iommu_group) == ("mtty", 6)
    assert result.mdev_type_name(by_uuid[mdev]) == "Dual port serial"
    # An mdev's group has no PCI member, and is kept (the kernel lists the mdev in it).
    group = result.group(6)
    assert group is not None and group.members == ()
    nic = result.device(A("0000:02:00.0"))
    assert nic is not None and nic.vfio_dev == VfioDevEntry("vfio0", has_dev=True)
    assert result.has_iommufd


def test_mdev_parent_oddities(tmp_path: Path) -> None:
    """A class/mdev_bus entry or an mdev link that names no device is reported, not fatal."""
    sysfs, dev = write_sysfs(iommufd_guest_topology(), tmp_path)
    (sysfs / "class/mdev_bus/.hidden").symlink_to("../../devices/virtual/mtty/mtty")
    (sysfs / "bus/mdev/devices/83b8f4f2-509f-382f-3c1e-e6bfe0fa1003").symlink_to("..")
    result = scan_host(sysfs, dev, SHARED_DEV_PATHS)
    assert [m.uuid for m in result.mdevs] == [
        "83b8f4f2-509f-382f-3c1e-e6bfe0fa1001",
        "83b8f4f2-509f-382f-3c1e-e6bfe0fa1002",
    ]
    assert len(result.mdev_types) == 5
    assert {str(sysfs / "class/mdev_bus/.hidden")} | {
        str(sysfs / "bus/mdev/devices/83b8f4f2-509f-382f-3c1e-e6bfe0fa1003")
    } == _problem_paths(result)


# --------------------------------------------------------------------------
# Generated hosts


def _scan_written(topology: Topology) -> HostSnapshot:
    with tempfile.TemporaryDirectory(prefix="dp-scan-") as workdir:
        sysfs, dev = write_sysfs(topology, Path(workdir))
        return scan_host(sysfs, dev, SHARED_DEV_PATHS)


@settings(max_examples=25)
@given(topologies(max_devices=60))
def test_scan_of_any_written_topology_equals_its_snapshot(topology: Topology) -> None:
    assert _scan_written(topology) == to_snapshot(topology, SHARED_DEV_PATHS)


@pytest.mark.parametrize("iommu", [True, False])
def test_scan_of_generated_host(iommu: bool) -> None:
    topology = generate_topology(150, seed=7, iommu=iommu)
    result = _scan_written(topology)
    assert result == to_snapshot(topology, SHARED_DEV_PATHS)
    assert result.problems == ()
    if not iommu:
        assert all(d.iommu_group is None for d in result.pci_devices)


@pytest.mark.parametrize("collecting", [True, False])
def test_scan_leaves_the_collector_as_it_found_it(
    tree: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, collecting: bool
) -> None:
    """A scan pauses automatic collection; it must not leave it paused (or resume it)."""
    was = gc.isenabled()
    try:
        gc.enable() if collecting else gc.disable()
        _scan(tree)
        assert gc.isenabled() is collecting

        def broken(path: str, dir_fd: int | None = None) -> str:
            raise RuntimeError("not a problem the scanner knows")

        monkeypatch.setattr(scanner, "_read_attribute", broken)
        with pytest.raises(RuntimeError):
            _scan(tree)
        assert gc.isenabled() is collecting
    finally:
        gc.enable() if was else gc.disable()


# --------------------------------------------------------------------------
# This machine


@pytest.fixture
def real_pci() -> Iterator[None]:
    if not os.path.isdir("/sys/bus/pci/devices") or not os.listdir("/sys/bus/pci/devices"):
        pytest.skip("no PCI bus visible in /sys")
    yield


@pytest.mark.usefixtures("real_pci")
def test_real_sys_smoke() -> None:
    """Read-only scan of this machine's /sys and /dev: devices found, nothing raised."""
    result = scan_host("/sys", "/dev", SHARED_DEV_PATHS)
    assert len(result.pci_devices) == len(os.listdir("/sys/bus/pci/devices"))
    for dev in result.pci_devices:
        assert dev.vendor not in (0x0000, 0xFFFF)
        if dev.iommu_group is not None:
            assert result.group(dev.iommu_group) is not None
    vfio = set()
    if os.path.isdir("/dev/vfio"):
        vfio = {f"/dev/vfio/{n}" for n in os.listdir("/dev/vfio") if n == "vfio" or n.isdigit()}
    shared = {p for p in SHARED_DEV_PATHS if os.path.exists(p)}
    assert result.dev_nodes == frozenset(vfio | shared)


@pytest.mark.parametrize(
    "spoil",
    ["garbage sriov_numvfs", "unreadable virtfn link"],
)
def test_virtual_functions_that_cannot_be_read_are_unknown(
    tree: tuple[Path, Path], caplog: pytest.LogCaptureFixture, spoil: str
) -> None:
    """Unknown is never read as "none": unbinding a physical function's driver
    would destroy VFs the scan could not see (dp_core.binding refuses it)."""
    pf = _dir(tree[0], "0000:6b:00.0")
    entry = "sriov_numvfs" if spoil == "garbage sriov_numvfs" else "virtfn3"
    if entry == "sriov_numvfs":
        (pf / entry).write_text("four\n")
    else:
        (pf / entry).unlink()
        (pf / entry).symlink_to("nowhere")
    path = str(tree[0] / "bus/pci/devices/0000:6b:00.0" / entry)
    result = _assert_logged_once(caplog, tree, path)
    found = result.device(A("0000:6b:00.0"))
    assert found is not None and found.sriov_numvfs is None
    assert [p.path for p in result.problems] == [path]


def test_fixture_pf_counts_its_enabled_virtual_functions(fixture_scan: HostSnapshot) -> None:
    pf = fixture_scan.device(A("0000:6b:00.0"))
    assert pf is not None and pf.sriov_numvfs == 4
    gpu = fixture_scan.device(A("0000:3b:00.0"))
    assert gpu is not None and gpu.sriov_numvfs == 0  # no SR-IOV at all


def _groups_directory_unlistable(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kernel/iommu_groups` fails to list (EIO, or EACCES for a lesser user)."""
    real = os.listdir

    def listdir(path: str) -> list[str]:
        if isinstance(path, str) and path.endswith("/kernel/iommu_groups"):
            raise OSError(5, "Input/output error", path)
        return real(path)

    monkeypatch.setattr(scanner.os, "listdir", listdir)


def test_unlistable_groups_are_asked_one_by_one(
    tree: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _groups_directory_unlistable(monkeypatch)
    result = _scan(tree)
    assert result.iommu_groups == _expected().iommu_groups  # each from its own listing
    assert _problem_paths(result) == {str(tree[0] / "kernel/iommu_groups")}


def test_unlistable_groups_still_see_a_member_the_scan_skipped(
    tree: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The audio function beside a T4 is unreadable: without the kernel's list
    of group 216 the T4 would look alone in it, and viable. Asked for, the
    list names the audio, so the group is left out (viability unknown)."""
    (_dir(tree[0], "0000:d8:00.1") / "vendor").write_text("0xZZZZ\n")
    _groups_directory_unlistable(monkeypatch)
    result = _scan(tree)
    assert result.group(216) is None
    assert str(tree[0] / "kernel/iommu_groups/216/devices/0000:d8:00.1") in _problem_paths(result)


# --------------------------------------------------------------------------
# VFIO character devices: vfio-dev/ entries, /dev/vfio/devices, /dev/iommu (issue 19)


def test_fixture_vfio_dev_shapes(fixture_scan: HostSnapshot) -> None:
    entries = {str(d.address): d.vfio_dev for d in fixture_scan.pci_devices}
    assert entries["0000:6b:00.1"] == VfioDevEntry("vfio0", has_dev=True)
    assert entries["0000:6b:00.2"] == VfioDevEntry("vfio1", has_dev=True)
    assert entries["0000:6b:00.3"] == VfioDevEntry("vfio2", has_dev=False)
    assert entries["0000:3b:00.0"] is None  # no vfio-dev/ at all
    assert "/dev/vfio/devices/vfio0" in fixture_scan.dev_nodes
    assert "/dev/vfio/devices/vfio1" not in fixture_scan.dev_nodes
    assert fixture_scan.has_iommufd


def _vfio_dev(sysfs: Path, address: str) -> Path:
    return _dir(sysfs, address) / "vfio-dev"


def test_missing_dev_iommu_and_cdev_directory(tree: tuple[Path, Path]) -> None:
    sysfs, dev = tree
    (dev / "iommu").unlink()
    shutil.rmtree(dev / "vfio" / "devices")
    result = _scan(tree)
    assert not result.has_iommufd
    assert not any(n.startswith("/dev/vfio/devices/") for n in result.dev_nodes)
    assert result.problems == ()  # a kernel without them is no problem


def test_cdev_directory_ignores_names_that_are_not_vfio_nodes(tree: tuple[Path, Path]) -> None:
    _, dev = tree
    (dev / "vfio" / "devices" / "vfioX").write_text("")
    (dev / "vfio" / "devices" / "vfio7").write_text("")
    nodes = _scan(tree).dev_nodes
    assert "/dev/vfio/devices/vfio7" in nodes and "/dev/vfio/devices/vfioX" not in nodes


@pytest.mark.parametrize(
    ("breakage", "reason"),
    [
        ("file", "cannot list: Not a directory"),
        ("dangling", "cannot list: missing (or gone during the scan)"),
        ("empty", "holds nothing, not one vfio<N> entry"),
        ("two", "holds 'vfio0', 'vfio9', not one vfio<N> entry"),
        ("stray", "holds 'vfio0', 'x', not one vfio<N> entry"),
    ],
)
def test_odd_vfio_dev_keeps_the_group_interface(
    tree: tuple[Path, Path], breakage: str, reason: str
) -> None:
    sysfs, _ = tree
    entry = _vfio_dev(sysfs, "0000:6b:00.1")
    if breakage in ("file", "dangling", "empty"):
        shutil.rmtree(entry)
        if breakage == "file":
            entry.write_text("")
        elif breakage == "dangling":
            entry.symlink_to("nowhere")
        else:
            entry.mkdir()
    elif breakage == "two":
        (entry / "vfio9").mkdir()
    else:
        (entry / "x").write_text("")
    result = _scan(tree)
    (vf,) = [d for d in result.pci_devices if str(d.address) == "0000:6b:00.1"]
    assert vf.vfio_dev is not None and vf.vfio_dev.problem == reason
    assert vf.vfio_dev.host_path is None
    (problem,) = result.problems
    assert problem.path == f"{sysfs}/bus/pci/devices/0000:6b:00.1/vfio-dev"
    assert (
        problem.reason
        == f"{reason}; no VFIO character device is offered; the group interface stays"
    )
    # Everything else about the function is read as before.
    assert attrs.evolve(vf, vfio_dev=None) == attrs.evolve(
        _expected().device(A("0000:6b:00.1")), vfio_dev=None
    )


def test_unlistable_vfio_dev_entry(
    tree: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    sysfs, _ = tree
    real = os.listdir

    def listdir(path: str | int = ".") -> list[str]:
        if isinstance(path, str) and path.endswith("/vfio-dev/vfio1"):
            raise PermissionError(13, "Permission denied")
        return real(path)

    monkeypatch.setattr(scanner.os, "listdir", listdir)
    result = _scan(tree)
    (vf,) = [d for d in result.pci_devices if str(d.address) == "0000:6b:00.2"]
    assert vf.vfio_dev == VfioDevEntry("vfio1", problem="cannot list vfio1: permission denied")
    (problem,) = result.problems
    assert problem.path.endswith("0000:6b:00.2/vfio-dev/vfio1")
    assert problem.reason.startswith("cannot list: permission denied; ")
