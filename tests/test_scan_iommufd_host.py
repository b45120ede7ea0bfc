"""`dp-server scan` on a host shaped as Linux 6.12 with iommufd lays it out.

The shape is `iommufd_guest_topology()`, what the real-kernel tier's guest
showed (tests/test_real_kernel_iommufd.py checks the same report against the
kernel itself): `/dev/iommu`, a function on vfio-pci with its character
device, and mdevs of the kernel's sample drivers, whose parents are virtual
devices rather than PCI functions.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dp_server.cli.main import main
from dp_testing.topology import iommufd_guest_topology, write_sysfs

CONFIG = """
vfio: {interface: %s}
permittedHostDevices:
  pciHostDevices:
    - {pciVendorSelector: "8086:10D3", resourceName: example.com/nic}
  mediatedDevices:
    - {mdevNameSelector: "Dual port serial", resourceName: example.com/serial}
    - {mdevNameSelector: "mdpy-vga", resourceName: example.com/display}
sharedDevices:
  devices.kubevirt.io/kvm: {enabled: false}
  devices.kubevirt.io/tun: {enabled: false}
  devices.kubevirt.io/vhost-net: {enabled: false}
"""
NIC, SERIAL, DISPLAY = (
    "0000:02:00.0",
    "83b8f4f2-509f-382f-3c1e-e6bfe0fa1001",
    ("83b8f4f2-509f-382f-3c1e-e6bfe0fa1002"),
)


def _scan(tmp_path: Path, interface: str, fmt: str, capsys: pytest.CaptureFixture[str]) -> str:
    sysfs, dev = write_sysfs(iommufd_guest_topology(), tmp_path / "host")
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG % interface)
    arguments = ["scan", "--sysfs", str(sysfs), "--dev", str(dev), "--config", str(config)]
    assert main([*arguments, "--format", fmt]) == 0
    return capsys.readouterr().out


def _paths(interface: str, group: int, cdev: str) -> list[str]:
    """The nodes `interface` gives a device in `group` with character device `cdev`."""
    group_nodes = ["/dev/vfio/vfio", f"/dev/vfio/{group}"]
    return {
        "group": group_nodes,
        "group+cdev": [*group_nodes, f"/dev/vfio/devices/{cdev}"],
        "iommufd": ["/dev/iommu", f"/dev/vfio/devices/{cdev}"],
    }[interface]


@pytest.mark.parametrize("interface", ["group", "group+cdev", "iommufd"])
def test_scan_json(tmp_path: Path, capsys: pytest.CaptureFixture[str], interface: str) -> None:
    document = json.loads(_scan(tmp_path, interface, "json", capsys))
    assert document["iommufd"] == {"path": "/dev/iommu", "present": True}
    assert document["problems"] == []
    resources = {r["name"]: r for r in document["resources"]}
    assert sorted(resources) == ["example.com/display", "example.com/nic", "example.com/serial"]
    (nic,) = resources["example.com/nic"]["devices"]
    assert (nic["id"], nic["health"], nic["cdev"], nic["host_paths"]) == (
        NIC,
        "Healthy",
        "/dev/vfio/devices/vfio0",
        _paths(interface, 5, "vfio0"),
    )
    # An mdev is a VFIO device of its own: its nodes follow the interface as a
    # function's do. It has no NUMA node: its parent is a virtual device.
    for name, uuid, mdev_type, parent, group, cdev in [
        ("example.com/serial", SERIAL, "mtty-2", "mtty", 6, "vfio1"),
        ("example.com/display", DISPLAY, "mdpy-vga", "mdpy", 7, "vfio2"),
    ]:
        (device,) = resources[name]["devices"]
        assert device == {
            "id": uuid,
            "health": "Healthy",
            "numa_node": None,
            "iommu_group": group,
            "host_paths": _paths(interface, group, cdev),
            "mdev_type": mdev_type,
            "parent": parent,
            "cdev": f"/dev/vfio/devices/{cdev}",
        }


def test_scan_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    table = _scan(tmp_path, "group+cdev", "table", capsys).splitlines()
    assert "/dev/iommu: present (the kernel has iommufd)" in table
    (nic,) = [line for line in table if line.startswith(f"  {NIC}")]
    assert nic.split() == [NIC, "Healthy", "numa=-", "group=5", "cdev=vfio0"]
    (serial,) = [line for line in table if line.startswith(f"  {SERIAL}")]
    assert serial.split() == [
        SERIAL,
        "Healthy",
        "numa=-",
        "group=6",
        "cdev=vfio1",
        "type=mtty-2",
        "parent=mtty",
    ]
