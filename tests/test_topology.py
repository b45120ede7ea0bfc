"""Host descriptions: the fixture node, the committed tree, generators and strategies."""

from __future__ import annotations

import importlib.util
import os
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import given, settings

from dp_core import VFIO_DRIVER, HostSnapshot, PciAddress
from dp_testing.generator import (
    Bridged,
    Function,
    MdevParent,
    Multifunction,
    Sriov,
    build_topology,
    generate_topology,
)
from dp_testing.strategies import snapshots, topologies
from dp_testing.topology import (
    SHARED_DEV_PATHS,
    FakeMdev,
    FakeMdevType,
    FakePci,
    Topology,
    fixture_topology,
    to_snapshot,
    write_sysfs,
)

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "sysfs"
A = PciAddress.parse


def _load_build_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fixture_build", FIXTURE / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tree(root: Path) -> dict[str, tuple[str, str | bytes]]:
    """Every entry under `root`: ("dir", ""), ("link", target) or ("file", content)."""
    entries: dict[str, tuple[str, str | bytes]] = {}
    for directory, subdirs, files in os.walk(root):
        for name in subdirs + files:
            path = Path(directory) / name
            key = str(path.relative_to(root))
            if path.is_symlink():
                entries[key] = ("link", os.readlink(path))
            elif path.is_dir():
                entries[key] = ("dir", "")
            else:
                entries[key] = ("file", path.read_bytes())
    return entries


# --------------------------------------------------------------------------
# The committed fixture


def test_committed_fixture_tree_is_what_build_py_writes(tmp_path: Path) -> None:
    _load_build_script().build(tmp_path)
    for top in ("sys", "dev"):
        committed = _tree(FIXTURE / top)
        fresh = _tree(tmp_path / top)
        assert sorted(committed) == sorted(fresh), f"{top}/: run fixtures/sysfs/build.py"
        for key, value in fresh.items():
            assert committed[key] == value, f"{top}/{key} differs: run fixtures/sysfs/build.py"


def test_fixture_symlinks_are_relative_and_resolve() -> None:
    for key, (kind, target) in _tree(FIXTURE / "sys").items():
        if kind == "link":
            assert isinstance(target, str) and not target.startswith("/"), key
            assert (FIXTURE / "sys" / key).exists(), f"{key} -> {target} dangles"


def test_fixture_links_look_like_kernfs() -> None:
    sysfs = FIXTURE / "sys"
    assert os.readlink(sysfs / "bus/pci/devices/0000:3b:00.0") == (
        "../../../devices/pci0000:3b/0000:3b:00.0"
    )
    gpu = sysfs / "devices/pci0000:3b/0000:3b:00.0"
    assert os.readlink(gpu / "driver") == "../../../bus/pci/drivers/vfio-pci"
    assert os.readlink(gpu / "iommu_group") == "../../../kernel/iommu_groups/59"
    vf = sysfs / "devices/pci0000:6b/0000:6b:00.1"
    assert os.readlink(vf / "physfn") == "../0000:6b:00.0"
    assert os.readlink(sysfs / "devices/pci0000:6b/0000:6b:00.0/virtfn3") == "../0000:6b:00.4"
    drive = sysfs / "devices/pci0000:5d/0000:5d:00.0/0000:5e:01.0"
    assert drive.is_dir()  # nested under its bridge
    assert (sysfs / "kernel/iommu_groups/93/devices/0000:5e:01.0").resolve() == drive.resolve()
    assert (sysfs / "bus/pci/drivers/snd_hda_intel/0000:d8:00.1").exists()
    mdev = "4b20d080-1b54-4048-85b3-a6a62d165c01"
    assert os.readlink(sysfs / "devices/pci0000:86/0000:86:00.0" / mdev / "mdev_type") == (
        "../mdev_supported_types/nvidia-259"
    )
    assert (sysfs / "kernel/iommu_groups/300/devices" / mdev).exists()
    assert (sysfs / "devices/pci0000:03/0000:03:00.0/boot_vga").read_text() == "1\n"
    assert (sysfs / "devices/pci0000:86/0000:86:00.0/boot_vga").read_text() == "0\n"


def test_fixture_readme_mentions_every_function_and_group() -> None:
    readme = (FIXTURE / "README.md").read_text()
    topology = fixture_topology()
    for fn in topology.pci:
        assert str(fn.address) in readme
        assert f"| {fn.group} |" in readme
    for mdev in topology.mdevs:
        assert mdev.uuid in readme


def test_fixture_topology_facts() -> None:
    topology = fixture_topology()
    snapshot = to_snapshot(topology)
    drivers = Counter(fn.driver for fn in topology.pci)
    assert drivers[VFIO_DRIVER] == 11 and drivers["snd_hda_intel"] == 1
    assert {g.number for g in snapshot.iommu_groups if not g.viability.viable} == {
        3,
        18,
        107,
        134,
        216,
    }
    assert "/dev/vfio/111" not in topology.dev_nodes
    vfio_groups = {fn.group for fn in topology.pci if fn.driver == VFIO_DRIVER}
    assert {f"/dev/vfio/{g}" for g in vfio_groups - {111}} <= topology.dev_nodes
    assert topology.shared_dev_paths == tuple(sorted(SHARED_DEV_PATHS))


# --------------------------------------------------------------------------
# The description and its snapshot


def test_to_snapshot_dev_paths_filter_only_non_vfio_nodes() -> None:
    topology = fixture_topology()
    snapshot = to_snapshot(topology, ["/dev/kvm"])
    assert "/dev/kvm" in snapshot.dev_nodes and "/dev/net/tun" not in snapshot.dev_nodes
    assert "/dev/vfio/59" in snapshot.dev_nodes and "/dev/vfio/vfio" in snapshot.dev_nodes


@pytest.mark.parametrize(
    ("pci", "message"),
    [
        ([FakePci(A("0000:01:00.0"), 1, 1, 0x020000)] * 2, "twice"),
        (
            [FakePci(A("0000:01:00.1"), 1, 1, 0x020000, physfn=A("0000:01:00.0"))],
            "physfn",
        ),
        (
            [
                FakePci(A("0000:01:00.0"), 1, 1, 0x020000),
                FakePci(A("0000:02:00.0"), 1, 1, 0x020000, upstream=A("0000:01:00.0")),
            ],
            "not a bridge",
        ),
        ([FakePci(A("0000:01:00.0"), 1, 1, 0x020000, numa=-1)], "numa"),
    ],
)
def test_topology_rejects_impossible_hosts(pci: list[FakePci], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Topology(pci=pci)


def test_topology_rejects_inconsistent_mdevs() -> None:
    gpu = FakePci(A("0000:01:00.0"), 0x10DE, 0x1E30, 0x030000, "nvidia")
    kind = FakeMdevType(gpu.address, "nvidia-259", "GRID RTX6000-4Q")
    with pytest.raises(ValueError, match="no parent"):
        Topology(mdev_types=[kind])
    with pytest.raises(ValueError, match="offers no"):
        Topology(pci=[gpu], mdev_types=[kind], mdevs=[FakeMdev("u", gpu.address, "nvidia-1")])


def test_build_topology_places_units_like_the_kernel() -> None:
    nic = Function(0x8086, 0x1572, 0x020000, "i40e")
    vf = Function(0x8086, 0x154C, 0x020000, VFIO_DRIVER)
    drive = Function(0x144D, 0xA808, 0x010802, VFIO_DRIVER)
    gpu = Function(0x10DE, 0x1E30, 0x030000, "nvidia")
    topology = build_topology(
        [
            Multifunction((nic, nic), numa=0),
            Sriov(nic, [vf] * 10, numa=1),
            Bridged(Function(0x10B5, 0x8747, 0x060400), [drive, drive], numa=None),
            MdevParent(gpu, [("nvidia-259", "GRID RTX6000-4Q", 2)], [0, 0]),
        ],
        omit_group_nodes={3},
    )
    by_address = {str(fn.address): fn for fn in topology.pci}
    assert by_address["0000:01:00.0"].group == by_address["0000:01:00.1"].group == 0
    assert by_address["0000:02:00.0"].group == 1
    # ARI: VF 8 is function 0 of slot 1.
    assert by_address["0000:02:01.0"].physfn == A("0000:02:00.0")
    assert {by_address[f"0000:02:00.{n}"].group for n in range(1, 8)} == set(range(2, 9))
    bridge = by_address["0000:03:00.0"]
    assert bridge.is_bridge
    assert by_address["0000:04:01.0"].upstream == bridge.address
    assert by_address["0000:04:01.0"].group == bridge.group
    assert [m.group for m in topology.mdevs] == [14, 15]  # after every PCI group
    assert "/dev/vfio/3" not in topology.dev_nodes and "/dev/vfio/4" in topology.dev_nodes
    assert "/dev/vfio/0" not in topology.dev_nodes  # NICs on i40e: no VFIO node
    no_iommu = build_topology([Multifunction((drive,))], iommu=False)
    assert no_iommu.pci[0].group is None and "/dev/vfio/vfio" not in no_iommu.dev_nodes


@pytest.mark.parametrize("n", [0, 1, 2, 3, 17, 500])
def test_generate_topology_has_exactly_n_functions(n: int) -> None:
    topology = generate_topology(n, seed=n)
    assert len(topology.pci) == n


def test_generate_topology_is_deterministic_and_varied() -> None:
    assert generate_topology(300, seed=3) == generate_topology(300, seed=3)
    assert generate_topology(300, seed=3) != generate_topology(300, seed=4)
    topology = generate_topology(2000, seed=1)
    snapshot = to_snapshot(topology)
    drivers = Counter(fn.driver for fn in topology.pci)
    assert drivers[VFIO_DRIVER] > 0 and drivers[None] > 0 and len(drivers) > 5
    assert {fn.numa for fn in topology.pci} == {None, 0, 1, 2, 3}
    assert any(fn.physfn is not None for fn in topology.pci)
    assert any(fn.is_bridge for fn in topology.pci)
    assert sum(fn.boot_vga for fn in topology.pci) == 1
    assert topology.mdevs and topology.mdev_types
    assert any(len(g.members) > 2 for g in snapshot.iommu_groups)
    assert any(not g.viability.viable for g in snapshot.iommu_groups)
    vfio_groups = {fn.group for fn in topology.pci if fn.driver == VFIO_DRIVER}
    present = {p for p in topology.dev_nodes if p.startswith("/dev/vfio/")}
    assert 0 < len(present) and len(present) < len(vfio_groups) + len(topology.mdevs) + 1


def test_write_sysfs_returns_roots_and_rejects_nodes_outside_dev(tmp_path: Path) -> None:
    sysfs, dev = write_sysfs(fixture_topology(), tmp_path)
    assert (sysfs, dev) == (tmp_path / "sys", tmp_path / "dev")
    assert (dev / "net" / "tun").is_file()
    with pytest.raises(ValueError, match="not under /dev/"):
        write_sysfs(Topology(dev_nodes={"/etc/kvm"}), tmp_path / "other")


# --------------------------------------------------------------------------
# Strategies


@settings(max_examples=40)
@given(topologies(max_devices=30))
def test_topologies_are_valid_and_within_budget(topology: Topology) -> None:
    assert len(topology.pci) <= 30
    snapshot = to_snapshot(topology)
    for group in snapshot.iommu_groups:
        assert all(member.iommu_group == group.number for member in group.members)
    for mdev in snapshot.mdevs:
        assert snapshot.mdev_type_name(mdev) is not None
        assert mdev.iommu_group is not None


@settings(max_examples=20)
@given(snapshots(max_devices=20))
def test_snapshots_strategy_yields_snapshots(snapshot: HostSnapshot) -> None:
    assert isinstance(snapshot, HostSnapshot)
    assert snapshot.problems == ()
    addresses = [d.address for d in snapshot.pci_devices]
    assert addresses == sorted(addresses) and len(set(addresses)) == len(addresses)
