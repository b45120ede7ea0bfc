"""dp on a real kernel's sysfs and /dev, under QEMU (docs/design.md §8).

The fixture trees are written by our own generator; this checks the scanner
and the IOMMU rules against what Linux itself lays out: a q35 machine with
an emulated Intel IOMMU and devices in the shapes docs/design.md §5 cares about.
The guest's init binds devices to vfio-pci as an operator would (dp never
does), then runs the scan, and asks the kernel itself, through the VFIO API
(VFIO_GROUP_GET_STATUS), which groups are viable. A second boot serves the
grpc-go kubelet (tests/gokubelet) from the guest and unbinds a device under it.
A third boot, on Debian's generic kernel (the cloud one has no e1000e or
bochs-drm), lets dp move an e1000e from its host driver to vfio-pci itself
(`binding`) and refuse the boot display. A fourth boot runs dp as a DRA
driver in the guest (tests/guest_dra.py, with the API-server and grpcio DRA
kubelet emulators): the real vfio devices in its ResourceSlices, a claim
prepared with a CDI spec naming the guest's own /dev/vfio nodes, the claim
for its group sibling refused, and Unprepare freeing the group.

The guest is emulated (about 10 s per boot here). Without QEMU and the other
Debian packages these tests are skipped, unless DP_REQUIRE_QEMU=1 (as in CI),
where that is a failure.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dp_testing.apiserver import Validator
from tests.cdi_reader import read_spec, resolve

import qemu_guest

CONFIG = """
permittedHostDevices:
  pciHostDevices:
    - {pciVendorSelector: "8086:10D3", resourceName: example.com/e1000e}
    - {pciVendorSelector: "8086:100E", resourceName: example.com/e1000}
    - {pciVendorSelector: "1B36:0005", resourceName: example.com/testdev}
    - {pciVendorSelector: "1B36:0010", resourceName: example.com/nvme}
sharedDevices:
  devices.kubevirt.io/kvm: {enabled: false}
  devices.kubevirt.io/tun: {enabled: false}
  devices.kubevirt.io/vhost-net: {enabled: false}
"""

# What the kernel says, read in the guest with nothing of dp's.
TRUTH = """
import fcntl, json, os, struct

VFIO_GROUP_GET_STATUS = (ord(";") << 8) | (100 + 3)  # _IO(VFIO_TYPE, VFIO_BASE + 3)
VFIO_GROUP_FLAGS_VIABLE = 1


def link(path):
    return os.path.basename(os.readlink(path)) if os.path.islink(path) else None


devices = {}
for address in sorted(os.listdir("/sys/bus/pci/devices")):
    base = f"/sys/bus/pci/devices/{address}/"
    group = link(base + "iommu_group")
    vendor, device = (open(base + name).read().strip()[2:] for name in ("vendor", "device"))
    numa = int(open(base + "numa_node").read())
    devices[address] = {
        "id": f"{vendor}:{device}",
        "driver": link(base + "driver"),
        "group": None if group is None else int(group),
        "numa": None if numa < 0 else numa,
        "override": open(base + "driver_override").read().strip(),
    }
    if os.path.exists(base + "boot_vga"):  # VGA devices only
        devices[address]["boot_vga"] = int(open(base + "boot_vga").read())
viable = {}
for name in os.listdir("/dev/vfio"):
    if not name.isdigit():  # the container, and devices/ where the kernel has cdevs
        continue
    fd = os.open(f"/dev/vfio/{name}", os.O_RDWR)
    status = bytearray(struct.pack("II", 8, 0))
    fcntl.ioctl(fd, VFIO_GROUP_GET_STATUS, status)
    os.close(fd)
    viable[name] = bool(struct.unpack("II", status)[1] & VFIO_GROUP_FLAGS_VIABLE)
print(json.dumps({"devices": devices, "viable": viable}))
"""


def bind_to_vfio(ids: str) -> str:
    """The operator's part, for every device with one of `ids`: driver_override,
    unbind, drivers_probe."""
    return f"""
for d in /sys/bus/pci/devices/*; do
  case "$(cat $d/vendor):$(cat $d/device)" in {ids})
    echo vfio-pci > $d/driver_override
    if [ -e $d/driver ]; then echo ${{d##*/}} > $d/driver/unbind; fi
    echo ${{d##*/}} > /sys/bus/pci/drivers_probe;;
  esac
done
"""


SCAN = "py -m dp_server scan --config /scenario/config.yaml --format json"
TRUTH_STEP = "py /scenario/truth.py"


@pytest.fixture(scope="module")
def guest(
    tmp_path_factory: pytest.TempPathFactory, guest_python_image: Path
) -> Iterator[qemu_guest.Guest]:
    """Debian's cloud kernel (6.1), unpacked for this module and removed after it."""
    directory = tmp_path_factory.mktemp("cloud-kernel")
    try:
        yield qemu_guest.Guest(qemu_guest.debian_kernel(directory), guest_python_image)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def machine(tmp_path: Path, cpus: int = 2) -> list[str]:
    """q35 with two NUMA nodes and: an e1000e alone on a root port; a
    two-function e1000e on another; an e1000e behind a PCIe expander bridge
    on NUMA node 1; a pci-testdev (no driver exists for it); an NVMe drive
    (the kernel's nvme driver takes it); and a conventional PCI bridge with an
    e1000 and a virtio disk behind it, which share one IOMMU group. With one
    vCPU, node 1 has memory and no CPU."""
    disks = {name: qemu_guest.disk(tmp_path / f"{name}.img") for name in ("nvme", "scratch")}
    return [
        *("-object", "memory-backend-ram,id=m0,size=384M"),
        *("-numa", "node,nodeid=0,cpus=0,memdev=m0"),
        *("-object", "memory-backend-ram,id=m1,size=384M"),
        *("-numa", "node,nodeid=1,memdev=m1" + (",cpus=1" if cpus > 1 else "")),
        *("-device", "pcie-root-port,id=rp1,chassis=1", "-device", "e1000e,bus=rp1,romfile="),
        *("-device", "pcie-root-port,id=rp2,chassis=2"),
        *("-device", "e1000e,bus=rp2,addr=0x0.0,multifunction=on,romfile="),
        *("-device", "e1000e,bus=rp2,addr=0x0.1,romfile="),
        *("-device", "pxb-pcie,id=pxb1,bus_nr=128,numa_node=1,bus=pcie.0"),
        *("-device", "pcie-root-port,id=rp9,chassis=9,bus=pxb1"),
        *("-device", "e1000e,bus=rp9,romfile="),
        *("-device", "pcie-root-port,id=rp3,chassis=3", "-device", "pci-testdev,bus=rp3"),
        *("-drive", f"file={disks['nvme']},if=none,id=nv,format=raw"),
        *("-device", "pcie-root-port,id=rp4,chassis=4"),
        *("-device", "nvme,serial=dp1,drive=nv,bus=rp4"),
        *("-device", "pci-bridge,id=br1,bus=pcie.0,addr=0x10,chassis_nr=6"),
        *("-device", "e1000,bus=br1,addr=1,romfile="),
        *("-drive", f"file={disks['scratch']},if=none,id=sc,format=raw"),
        *("-device", "virtio-blk-pci,drive=sc,bus=br1,addr=2"),
    ]


def parsed(step: tuple[int, str]) -> dict[str, Any]:
    code, output = step
    assert code == 0, output
    # The JSON document is the output's last top-level object; the console
    # may carry kernel messages before it.
    start = output.index("{\n") if "{\n" in output else output.index("{")
    document: dict[str, Any] = json.loads(output[start:])
    return document


def check_against_kernel(scan: dict[str, Any], truth: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """dp's word on every device against the kernel's; returns dp's devices by address."""
    kernel = truth["devices"]
    seen: dict[str, dict[str, Any]] = {}
    for resource in scan["resources"]:
        for device in resource["devices"]:
            facts = kernel[device["id"]]
            assert device["iommu_group"] == facts["group"], device
            assert device.get("driver") == facts["driver"], device
            assert device["numa_node"] == facts["numa"], device
            group_viable = truth["viable"].get(str(facts["group"]))
            # Healthy exactly when the kernel would let a VM open the group.
            healthy = facts["driver"] == "vfio-pci" and group_viable is True
            assert (device["health"] == "Healthy") is healthy, (device, facts, group_viable)
            if facts["driver"] is None:
                assert "not bound to any driver" in device["reason"]
            seen[device["id"]] = device | {"resource": resource["name"]}
    for skipped in scan["skipped"]:
        assert skipped["driver"] == kernel[skipped["id"]]["driver"] != "vfio-pci"
        seen[skipped["id"]] = skipped
    selected = {"8086:10d3", "8086:100e", "1b36:0005", "1b36:0010"}
    # Every selected function is accounted for, and nothing else is.
    assert set(seen) == {a for a, f in kernel.items() if f["id"] in selected}
    return seen


def test_scan_agrees_with_the_kernel_on_groups_drivers_and_viability(
    guest: qemu_guest.Guest, tmp_path: Path
) -> None:
    steps = guest.run(
        tmp_path,
        machine(tmp_path),
        [
            bind_to_vfio("0x8086:0x10d3|0x8086:0x100e"),
            SCAN,
            TRUTH_STEP,
            # The operator moves the bridge group's disk to vfio-pci as well.
            bind_to_vfio("0x1af4:0x1001"),
            SCAN,
            TRUTH_STEP,
            CDEV_STEP,
        ],
        files={"config.yaml": CONFIG, "truth.py": TRUTH, "cdev.py": CDEV},
    )
    assert steps[0][0] == 0, steps[0][1]
    before = check_against_kernel(parsed(steps[1]), parsed(steps[2]))
    kernel = parsed(steps[2])["devices"]
    by_resource: dict[str, list[dict[str, Any]]] = {}
    for device in before.values():
        by_resource.setdefault(device.get("resource", "skipped"), []).append(device)

    # Four e1000e functions, all usable; the two functions of one card share a
    # group; the one behind the expander bridge is on NUMA node 1.
    e1000e = by_resource["example.com/e1000e"]
    assert [d["health"] for d in e1000e] == ["Healthy"] * 4
    groups = [d["iommu_group"] for d in e1000e]
    assert len(set(groups)) == 3
    assert sorted(d["numa_node"] for d in e1000e if d["numa_node"] is not None) == [1]
    # The e1000 behind the bridge shares its group with a disk on virtio-pci.
    (e1000,) = by_resource["example.com/e1000"]
    sibling = next(
        a
        for a, f in kernel.items()
        if f["group"] == e1000["iommu_group"] and f["id"] == "1af4:1001"
    )
    assert e1000["health"] == "Unhealthy"
    assert e1000["reason"] == (
        f"IOMMU group {e1000['iommu_group']} is not viable: {sibling} is bound to virtio-pci"
    )
    # No driver in this kernel for the test device: advertised, Unhealthy.
    (testdev,) = by_resource["example.com/testdev"]
    assert testdev["health"] == "Unhealthy"
    # The NVMe drive stays with the host's driver and is not advertised.
    (nvme,) = by_resource["skipped"]
    assert nvme["driver"] == "nvme" and nvme["resource_name"] == "example.com/nvme"

    # Once the disk is on vfio-pci too, the kernel and dp both call the group usable.
    after = check_against_kernel(parsed(steps[4]), parsed(steps[5]))
    assert parsed(steps[5])["viable"][str(e1000["iommu_group"])] is True
    assert after[e1000["id"]]["health"] == "Healthy"

    # Debian's kernel has no iommufd: dp offers no character device and every
    # device stays on the group interface, Healthy as the kernel's word says.
    check_group_interface_only(parsed(steps[4]), parsed(steps[6]))


# What the kernel shows of VFIO character devices, read with nothing of dp's.
CDEV = """
import json, os

entries = {}
for address in sorted(os.listdir("/sys/bus/pci/devices")):
    base = f"/sys/bus/pci/devices/{address}/vfio-dev"
    if os.path.isdir(base):
        entries[address] = {n: sorted(os.listdir(f"{base}/{n}")) for n in os.listdir(base)}
print(json.dumps({
    "vfio_dev": entries,
    "cdev_nodes": os.listdir("/dev/vfio/devices") if os.path.isdir("/dev/vfio/devices") else None,
    "dev_iommu": os.path.exists("/dev/iommu"),
    "kernel": os.uname().release,
}, indent=1))
"""
CDEV_STEP = "py /scenario/cdev.py"


def check_group_interface_only(scan: dict[str, Any], cdev: dict[str, Any]) -> None:
    print("VFIO character devices in the guest:", json.dumps(cdev))
    assert cdev["dev_iommu"] is False and scan["iommufd"] == {
        "path": "/dev/iommu",
        "present": False,
    }
    assert not cdev["cdev_nodes"]
    # Without CONFIG_VFIO_DEVICE_CDEV no entry has a `dev` file.
    assert not any("dev" in files for e in cdev["vfio_dev"].values() for files in e.values())
    for resource in scan["resources"]:
        for device in resource["devices"]:
            assert device["cdev"] is None, device
            assert not any(p.startswith("/dev/vfio/devices/") for p in device["host_paths"])
            if device["health"] == "Healthy":
                group = f"/dev/vfio/{device['iommu_group']}"
                assert device["host_paths"] == ["/dev/vfio/vfio", group], device
            entry = cdev["vfio_dev"].get(device["id"])
            if entry is None:
                assert device["cdev_reason"].startswith("no vfio-dev entry in sysfs"), device
            else:
                (name,) = entry
                assert device["cdev_reason"].startswith(f"vfio-dev/{name} has no dev file"), device
    # Every function on vfio-pci has its vfio-dev entry from Linux 6.1 on.
    on_vfio = [
        d["id"] for r in scan["resources"] for d in r["devices"] if d.get("driver") == "vfio-pci"
    ]
    assert on_vfio and all(a in cdev["vfio_dev"] for a in on_vfio), (on_vfio, cdev)


SERVE = """
mkdir -p /py/tmp/dp
chroot /py /scenario/gokubelet -dir /tmp/dp -expect 3 -await-change 60s -timeout 120s \\
  > /py/tmp/report.json 2> /py/tmp/gokubelet.err &
kubelet=$!
# A simple command, not `py`, so that $! is the server itself (chroot execs python).
PYTHONPATH=/site PYTHONDONTWRITEBYTECODE=1 chroot /py /usr/bin/python3.11 -m dp_server serve \\
  --config /scenario/config.yaml --device-plugin-dir /tmp/dp \\
  --pod-resources-socket /tmp/pod-resources.sock --rescan-interval 3600 > /py/tmp/server.log 2>&1 &
server=$!
for i in $(seq 600); do grep -q awaiting-change /py/tmp/gokubelet.err && break; sleep 0.2; done
# The operator takes the e1000e that is alone in its group back from vfio-pci:
# the kernel removes its /dev/vfio node, nothing else tells the server.
for d in /sys/bus/pci/devices/*; do
  [ "$(cat $d/vendor):$(cat $d/device)" = 0x8086:0x10d3 ] || continue
  [ "$(ls $d/iommu_group/devices | wc -l)" = 1 ] || continue
  echo "taken back: ${d##*/} group $(basename $(readlink $d/iommu_group))"
  echo ${d##*/} > /sys/bus/pci/drivers/vfio-pci/unbind
  break
done
wait $kubelet
echo "gokubelet exit $?"
kill -TERM $server
wait $server
echo "server exit $?"
echo "sockets left: $(ls /py/tmp/dp | grep -vx kubelet_internal_checkpoint | wc -l)"
grep -c Traceback /py/tmp/server.log
echo "=== report"
cat /py/tmp/report.json
"""


def test_serve_on_a_real_kernel_to_a_grpc_go_kubelet(
    guest: qemu_guest.Guest, gokubelet: Path, tmp_path: Path
) -> None:
    steps = guest.run(
        tmp_path,
        machine(tmp_path),
        [bind_to_vfio("0x8086:0x10d3|0x8086:0x100e"), SCAN, TRUTH_STEP, SERVE],
        files={"config.yaml": CONFIG, "truth.py": TRUTH},
        binaries={"gokubelet": gokubelet},
    )
    scan, truth = parsed(steps[1]), parsed(steps[2])
    code, output = steps[3]
    log, _, report_text = output.partition("=== report\n")
    assert code == 0 and "gokubelet exit 0" in log and "server exit 0" in log, output
    assert "sockets left: 0" in log
    assert log.rstrip().endswith("\n0"), log  # no traceback in the server's log
    report = json.loads(report_text)
    assert report["errors"] == []

    # The kubelet's lists are what the scan showed.
    listed = {r["resource"]: r for r in report["resources"]}
    assert sorted(listed) == sorted(r["name"] for r in scan["resources"])
    taken = log.split("taken back: ", 1)[1].split()[0]
    for resource in scan["resources"]:
        want = [
            (d["id"], None if d["numa_node"] is None else [d["numa_node"]])
            for d in resource["devices"]
        ]
        got = [(d["id"], d["numa"]) for d in listed[resource["name"]]["devices"]]
        assert got == want  # NUMA topology included

    # The sample Allocate of the first e1000e names its real VFIO group node.
    first = next(d for d in scan["resources"] if d["name"] == "example.com/e1000e")["devices"][0]
    (container,) = report["samples"]["example.com/e1000e"]
    group = truth["devices"][first["id"]]["group"]
    assert [s["host_path"] for s in container["devices"]] == [
        "/dev/vfio/vfio",
        f"/dev/vfio/{group}",
    ]
    assert container["envs"] == {"PCI_RESOURCE_EXAMPLE_COM_E1000E": first["id"]}
    # Nothing healthy to sample in the other two resources.
    assert sorted(report["samples"]) == ["example.com/e1000e"]

    # The kernel removed the node of the device taken back; the server saw it
    # and re-sent that resource's list alone, with the device Unhealthy.
    assert list(report["changed"]) == ["example.com/e1000e"]
    health = {d["id"]: d["health"] for d in report["changed"]["example.com/e1000e"]}
    assert health[taken] == "Unhealthy"
    assert sorted(h for i, h in health.items() if i != taken) == ["Healthy"] * 3


# Debian's generic kernel has the host drivers the cloud one lacks; the guest's
# /init loads them with the rest (there is no udev to do it).
GENERIC_KERNEL = "linux-image-amd64"
GENERIC_MODULES = (*qemu_guest.MODULES, "ext4", "e1000e", "bochs")

BINDING_CONFIG = """
permittedHostDevices:
  pciHostDevices:
    - {pciVendorSelector: "8086:10D3", resourceName: example.com/nic}
    - {pciVendorSelector: "1234:1111", resourceName: example.com/display}
binding:
  replaceDrivers: [e1000e, bochs-drm]
sharedDevices:
  devices.kubevirt.io/kvm: {enabled: false}
  devices.kubevirt.io/tun: {enabled: false}
  devices.kubevirt.io/vhost-net: {enabled: false}
"""

SERVE_BINDING = """
mkdir -p /py/tmp/dp
# The kubelet's PodResources API first: binds wait until it has said which
# IOMMU groups pods hold (here: none).
chroot /py /scenario/gokubelet -pod-resources /tmp/pod-resources.sock -pod-resources-only &
podresources=$!
PYTHONPATH=/site PYTHONDONTWRITEBYTECODE=1 chroot /py /usr/bin/python3.11 -m dp_server serve \\
  --config /scenario/config.yaml --device-plugin-dir /tmp/dp --log-format json \\
  --pod-resources-socket /tmp/pod-resources.sock --rescan-interval 3600 \\
  --state-dir /tmp/state > /py/tmp/server.log 2>&1 &
server=$!
# The kubelet comes once the server has moved the e1000e and looked at it again.
for i in $(seq 600); do
  grep -qE '"health": "Healthy"|"bind-failed"|Traceback' /py/tmp/server.log && break
  sleep 0.2
done
chroot /py /scenario/gokubelet -dir /tmp/dp -expect 1 -timeout 60s \\
  > /py/tmp/report.json 2> /py/tmp/gokubelet.err
echo "gokubelet exit $?"
kill -TERM $server
wait $server
echo "server exit $?"
kill $podresources
echo "=== log"
cat /py/tmp/server.log
echo "=== report"
cat /py/tmp/report.json
echo "=== moves"
cat /py/tmp/state/moves.json
"""


@pytest.fixture(scope="module")
def generic_guest(
    tmp_path_factory: pytest.TempPathFactory, guest_python_image: Path
) -> Iterator[qemu_guest.Guest]:
    directory = tmp_path_factory.mktemp("generic-kernel")
    try:
        kernel = qemu_guest.debian_kernel(directory, GENERIC_KERNEL, GENERIC_MODULES)
        yield qemu_guest.Guest(kernel, guest_python_image)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_serve_binds_an_e1000e_to_vfio_pci_and_leaves_the_boot_display(
    generic_guest: qemu_guest.Guest, gokubelet: Path, tmp_path: Path
) -> None:
    steps = generic_guest.run(
        tmp_path,
        [
            *("-device", "pcie-root-port,id=rp1,chassis=1", "-device", "e1000e,bus=rp1,romfile="),
            *("-device", "VGA"),  # the q35 default display: boot_vga is 1
        ],
        ["ls /sys/bus/pci/drivers", SCAN, TRUTH_STEP, SERVE_BINDING, TRUTH_STEP, SCAN],
        files={"config.yaml": BINDING_CONFIG, "truth.py": TRUTH},
        binaries={"gokubelet": gokubelet},
    )
    code, drivers = steps[0]
    assert code == 0 and {"e1000e", "bochs-drm", "vfio-pci"} <= set(drivers.split()), drivers
    before = parsed(steps[2])["devices"]
    (nic,) = (a for a, f in before.items() if f["id"] == "8086:10d3")
    (vga,) = (a for a, f in before.items() if f["id"] == "1234:1111")
    group = before[nic]["group"]
    assert before[nic]["driver"] == "e1000e" and before[nic]["override"] == "(null)"
    assert [a for a, f in before.items() if f["group"] == group] == [nic]  # alone in its group
    assert before[vga]["driver"] == "bochs-drm" and before[vga]["boot_vga"] == 1
    assert str(group) not in parsed(steps[2])["viable"]

    # The scan shows the plan and changes nothing (the truth was read after it).
    scan = parsed(steps[1])
    boot_display = "drives the boot display (boot_vga is 1); dp never rebinds it"
    assert {d["id"]: d for d in scan["binding"]} == {
        nic: {"id": nic, "driver": "e1000e", "action": "bind"},
        vga: {"id": vga, "driver": "bochs-drm", "action": "refused", "reason": boot_display},
    }
    (resource,) = scan["resources"]
    assert resource["name"] == "example.com/nic"
    (device,) = resource["devices"]
    assert device["id"] == nic and device["health"] == "Unhealthy"
    assert (
        device["reason"]
        == "bound to host driver e1000e; the config's binding has dp move it to vfio-pci"
    )
    (skipped,) = scan["skipped"]
    assert skipped["id"] == vga and skipped["driver"] == "bochs-drm"
    assert skipped["resource_name"] == "example.com/display"
    assert (
        skipped["reason"]
        == f"bound to host driver bochs-drm; not moved to vfio-pci: {boot_display}"
    )

    # serve moved the e1000e, and only it.
    code, output = steps[3]
    head, _, report_text = output.partition("=== report\n")
    report_text, _, moves_text = report_text.partition("=== moves\n")
    outcome, _, log_text = head.partition("=== log\n")
    assert code == 0 and "gokubelet exit 0" in outcome and "server exit 0" in outcome, output
    assert "Traceback" not in log_text, log_text
    log = [json.loads(line) for line in log_text.splitlines() if line.startswith("{")]
    binding = [
        (e["event"], e["device"], e.get("driver"), e.get("reason"))
        for e in log
        if e["event"] in ("bind", "bound", "bind-refused", "bind-failed")
    ]
    # Logged once each, the refusal in any place, `bound` after `bind`.
    assert sorted(binding) == [
        ("bind", nic, "e1000e", None),
        ("bind-refused", vga, None, boot_display),
        ("bound", nic, "vfio-pci", None),
    ], log_text
    assert [e for e, *_ in binding if e != "bind-refused"] == ["bind", "bound"]
    # Advertised Unhealthy while it moved, then Healthy.
    assert [(e["health"], e["reason"]) for e in log if e["event"] == "health-changed"] == [
        (
            "Unhealthy",
            "bound to host driver e1000e; the config's binding has dp move it to vfio-pci",
        ),
        ("Healthy", ""),
    ]
    after = parsed(steps[4])
    assert after["devices"][nic]["driver"] == "vfio-pci"
    assert after["devices"][nic]["override"] == "vfio-pci"
    # /dev/vfio/<group> is there, and the kernel calls the group viable.
    assert after["viable"] == {str(group): True}
    # The boot display is where it was; its driver_override was never written.
    assert after["devices"][vga]["driver"] == "bochs-drm"
    assert after["devices"][vga]["override"] == "(null)"

    # What it moved is kept in --state-dir, for a restarted dp.
    assert json.loads(moves_text) == {
        "version": 1,
        "moves": [{"address": nic, "driver": "e1000e", "iommu_group": group, "pinned": False}],
    }

    # The kubelet was sent the e1000e Healthy, and Allocate names its group's node.
    report = json.loads(report_text)
    assert report["errors"] == []
    listed = {r["resource"]: r for r in report["resources"]}
    assert sorted(listed) == ["example.com/nic"]
    assert [(d["id"], d["health"]) for d in listed["example.com/nic"]["devices"]] == [
        (nic, "Healthy")
    ]
    (container,) = report["samples"]["example.com/nic"]
    assert [s["host_path"] for s in container["devices"]] == [
        "/dev/vfio/vfio",
        f"/dev/vfio/{group}",
    ]

    # Scanned again: the e1000e is served as it is, the display still refused.
    again = parsed(steps[5])
    assert again["binding"] == [
        {"id": vga, "driver": "bochs-drm", "action": "refused", "reason": boot_display}
    ]
    assert [(d["id"], d["health"]) for d in again["resources"][0]["devices"]] == [(nic, "Healthy")]


# The DRA front end in the guest: the e1000e functions, the e1000 and the
# bridge group's disk on vfio-pci by the operator's hand; the pci-testdev has no
# driver, so it is unhealthy. With the emulator, which keeps device taints, dp
# taints what the scheduler must not have rather than leaving it out.
DRA_DRIVER = "vfio.dp.example.com"
DRA_NODE = "guest"
DRA_CONFIG = f"""
dra:
  driverName: {DRA_DRIVER}
permittedHostDevices:
  pciHostDevices:
    - {{pciVendorSelector: "8086:10D3", resourceName: example.com/e1000e, frontend: dra}}
    - {{pciVendorSelector: "8086:100E", resourceName: example.com/e1000, frontend: dra}}
    - {{pciVendorSelector: "1AF4:1001", resourceName: example.com/disk, frontend: dra}}
    - {{pciVendorSelector: "1B36:0005", resourceName: example.com/testdev, frontend: dra}}
sharedDevices:
  devices.kubevirt.io/kvm: {{enabled: false}}
  devices.kubevirt.io/tun: {{enabled: false}}
  devices.kubevirt.io/vhost-net: {{enabled: false}}
"""
# The guest has no network but loopback, which the API-server emulator listens on.
DRA_STEP = f"ip link set lo up && py /scenario/guest_dra.py {DRA_DRIVER} {DRA_NODE}"
SCHEMA = Path(__file__).parent / "data" / "k8s" / "resource.k8s.io-v1.schema.json"


def test_dra_publishes_prepares_and_unprepares_real_vfio_devices(
    guest: qemu_guest.Guest, tmp_path: Path
) -> None:
    steps = guest.run(
        tmp_path,
        machine(tmp_path),
        [bind_to_vfio("0x8086:0x10d3|0x8086:0x100e|0x1af4:0x1001"), TRUTH_STEP, DRA_STEP],
        files={
            "config.yaml": DRA_CONFIG,
            "truth.py": TRUTH,
            "guest_dra.py": (Path(__file__).parent / "guest_dra.py").read_text(),
        },
    )
    assert steps[0][0] == 0, steps[0][1]
    kernel = parsed(steps[1])["devices"]
    report = parsed(steps[2])
    assert "failure" not in report and None not in report["waited"].values(), report
    assert report["server_exit"] == 0, report["server_log"]
    log = [json.loads(line) for line in report["server_log"] if line.startswith("{")]
    assert len(log) == len(report["server_log"]), report["server_log"]  # no traceback
    assert not [e for e in log if e["level"] == "error"], log
    assert report["registered"] == ["v1.DRAPlugin"]

    def name(address: str) -> str:
        return "pci-" + address.replace(":", "-").replace(".", "-")

    # The kernel's word: the e1000 and the disk behind the bridge share a group
    # that VFIO calls viable, both on vfio-pci.
    nic, disk, group = (report["kernel"][k] for k in ("nic", "disk", "group"))
    assert kernel[nic]["group"] == kernel[disk]["group"] == group
    assert kernel[nic]["driver"] == kernel[disk]["driver"] == "vfio-pci"
    assert parsed(steps[1])["viable"][str(group)] is True

    # The pool lists every selected function with the kernel's address, IDs,
    # group and NUMA node; the pci-testdev, which no driver holds, is tainted.
    resources = {
        "8086:10d3": "e1000e",
        "8086:100e": "e1000",
        "1af4:1001": "disk",
        "1b36:0005": "testdev",
    }
    selected = {a: f for a, f in kernel.items() if f["id"] in resources}
    (testdev,) = (a for a, f in selected.items() if f["id"] == "1b36:0005")
    assert selected.pop(testdev)["driver"] is None
    assert all(f["driver"] == "vfio-pci" for f in selected.values())
    unhealthy = [{"effect": "NoSchedule", "key": f"{DRA_DRIVER}/unhealthy"}]
    slices = report["slices"]
    validator = Validator(SCHEMA)
    for piece in slices:
        validator.check("resourceslices", piece)  # what a real API server would take
        assert piece["spec"]["driver"] == DRA_DRIVER and piece["spec"]["nodeName"] == DRA_NODE
        assert piece["spec"]["pool"]["name"] == DRA_NODE
        (owner,) = piece["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"]) == ("Node", DRA_NODE)
    everyone = {d["name"]: d for s in slices for d in s["spec"].get("devices") or ()}
    wholes = {n: d for n, d in everyone.items() if n.startswith("iommu-group-")}
    devices = {n: d for n, d in everyone.items() if n not in wholes}
    assert sorted(devices) == sorted(name(a) for a in [*selected, testdev])
    for device in devices.values():
        taints = [
            {k: v for k, v in t.items() if k != "timeAdded"} for t in device.get("taints", ())
        ]
        assert taints == (unhealthy if device["name"] == name(testdev) else []), device
    members: dict[int, list[str]] = {}
    for address, facts in [*selected.items(), (testdev, kernel[testdev])]:
        device = devices[name(address)]
        vendor, product = facts["id"].split(":")
        want = {
            "resource.kubernetes.io/pciBusID": {"string": address},
            "vendorID": {"string": vendor},
            "deviceID": {"string": product},
            "iommuGroup": {"int": facts["group"]},
            "resourceName": {"string": f"example.com/{resources[facts['id']]}"},
        }
        if facts["numa"] is not None:
            want["numaNode"] = {"int": facts["numa"]}
        attributes = device["attributes"]
        assert {k: attributes[k] for k in want} == want, device
        assert attributes.keys() - want.keys() == {"classID"}, device
        members.setdefault(facts["group"], []).append(device["name"])
    # Each group of two published functions (the bridge's, and the two-function
    # e1000e's) is one counter that each member takes whole.
    shared = {g for g, names in members.items() if len(names) > 1}
    assert shared == {group, kernel[next(a for a in selected if a.endswith(".1"))]["group"]}
    counter_sets = [c for s in slices for c in s["spec"].get("sharedCounters") or ()]
    assert {c["name"]: c["counters"] for c in counter_sets} == {
        f"iommu-group-{g}": {"slot": {"value": "1"}} for g in shared
    }
    for g, names in members.items():
        for device_name in names:
            consumed = devices[device_name].get("consumesCounters")
            if g in shared:
                assert consumed == [
                    {"counterSet": f"iommu-group-{g}", "counters": {"slot": {"value": "1"}}}
                ]
            else:
                assert consumed is None, device_name
    # Each such group is offered whole too, on the same counter, led by its
    # lowest function (the one KubeVirt would pass to a VM).
    assert sorted(wholes) == sorted(f"iommu-group-{g}" for g in shared)
    for g in shared:
        whole = wholes[f"iommu-group-{g}"]
        addresses = sorted(a for a in [*selected, testdev] if name(a) in members[g])
        assert whole["consumesCounters"] == [
            {"counterSet": f"iommu-group-{g}", "counters": {"slot": {"value": "1"}}}
        ]
        assert whole["attributes"]["resourceName"] == {"string": "iommu-group"}
        assert whole["attributes"]["members"] == {"string": ",".join(addresses)}
        assert whole["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": addresses[0]}

    # The e1000's claim, prepared: its CDI spec names the nodes the guest has.
    uid = report["uids"]["vm-nic"]
    claim_id = f"{DRA_DRIVER}/claim={uid}-{name(nic)}"
    meta_id = f"{DRA_DRIVER}/metadata={uid}_nic"
    assert report["prepare"] == {
        "vm-nic": {"error": "", "devices": [[DRA_NODE, name(nic), [claim_id, meta_id]]]}
    }
    spec_name = f"{DRA_DRIVER}_claim_{uid}.json"
    meta_spec_name = f"{DRA_DRIVER}_metadata_{uid}_nic.json"
    assert sorted(report["cdi_prepared"]) == [spec_name, meta_spec_name]
    edits = resolve([read_spec(report["cdi_prepared"][spec_name], spec_name)], claim_id)
    nodes = [(n.path, n.host_path, n.permissions) for n in edits.device_nodes]
    assert nodes == [
        ("/dev/vfio/vfio", "/dev/vfio/vfio", "mrw"),
        (f"/dev/vfio/{group}", f"/dev/vfio/{group}", "mrw"),
    ]
    # Character devices in the guest: VFIO's own (10:196) and the group's.
    for _, host_path, _ in nodes:
        assert report["dev_vfio"][host_path]["char"] is True, report["dev_vfio"]
    assert report["dev_vfio"]["/dev/vfio/vfio"]["rdev"] == [10, 196]
    # KEP-5304 metadata names the real PCI address, mounted by its own spec.
    meta_spec = json.loads(report["cdi_prepared"][meta_spec_name])
    assert meta_spec["kind"] == f"{DRA_DRIVER}/metadata"
    (mount,) = meta_spec["devices"][0]["containerEdits"]["mounts"]
    metadata_file = "dra-device-metadata/default_vm-nic/nic/metadata.json"
    assert mount["hostPath"] == f"/tmp/dra/plugins/{DRA_DRIVER}/{metadata_file}"
    streamed = report["metadata_prepared"][metadata_file].splitlines()
    for document in map(json.loads, streamed):
        (request,) = document["requests"]
        (meta_device,) = request["devices"]
        assert meta_device["name"] == name(nic)
        assert meta_device["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": nic}
    # The checkpoint holds the claim and its group, for a restarted dp.
    (kept,) = report["checkpoint"]["claims"]
    assert kept["claim"]["uid"] == uid
    assert [d["iommu_group"] for d in kept["devices"]] == [group]

    # While the group is held the pool stays as it was (the claim's device
    # consumes the group's one counter, which the scheduler counts), and a
    # claim for the other member anyway is refused, naming the group and the
    # claim that holds it.
    everything = {a: [] for a in selected} | {testdev: [unhealthy[0]["key"]]}
    assert report["pool_held"] == everything
    (refused,) = report["prepare_sibling"].values()
    assert refused["devices"] == [] and f"IOMMU group {group}" in refused["error"]
    assert "default/vm-nic" in refused["error"], refused
    assert report["cdi_refused"] == [spec_name, meta_spec_name]

    # Unprepare removes the files and frees the group at once: the disk is
    # offered again, and its claim is prepared, then unprepared.
    assert report["unprepare"] == {"vm-nic": ""}
    assert report["cdi_unprepared"] == [] and report["metadata_unprepared"] == []
    assert report["pool_freed"] == everything
    disk_uid = report["uids"]["vm-disk"]
    (again,) = report["prepare_sibling_again"]["vm-disk"]["devices"]
    assert report["prepare_sibling_again"]["vm-disk"]["error"] == ""
    assert again[:2] == [DRA_NODE, name(disk)]
    assert report["cdi_sibling"] == [
        f"{DRA_DRIVER}_claim_{disk_uid}.json",
        f"{DRA_DRIVER}_metadata_{disk_uid}_disk.json",
    ]
    assert report["unprepare_sibling"] == {"vm-disk": ""}
    assert report["cdi_end"] == [] and report["pool_end"] == everything
