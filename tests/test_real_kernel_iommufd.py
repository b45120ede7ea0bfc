"""dp on Linux 6.12 with iommufd, VFIO character devices and real mdevs, under QEMU.

tests/test_real_kernel.py boots Debian's 6.1, which has no iommufd: there
dp offers the group interface only. This module boots a 6.12 kernel built
with `IOMMUFD`, `VFIO_DEVICE_CDEV`, the legacy container, `vfio-pci`,
`VFIO_MDEV` with the kernel's sample mdev drivers (`mtty`, `mdpy`), NVMe with
SR-IOV and e1000/e1000e, all built in (qemu_guest.iommufd_kernel: CI's
../shared/kernels/linux-6.12-iommufd, $DP_TEST_KERNEL_DIR, or
scripts/build-test-kernel.sh). One boot per scenario:

1. `vmm`: `dp-server scan` (table and JSON) against the kernel's own word on
   `/dev/iommu`, each vfio-pci function's character device, and the mtty and
   mdpy mdevs (their parents are virtual devices, not PCI functions); then,
   for each `vfio.interface`, what dp's Allocate answer and its CDI spec name
   for a function and for an mdev, made into a container's /dev as a runtime
   makes it, driven as a VMM drives it (tests/guest_vmm.py: the group
   interface, and iommufd with the character device); and mdevs removed and
   created while dp serves.
2. `lifecycle`: dp moves a function from its host driver to vfio-pci itself
   (`binding`), which gives it its character device; then the operator takes
   it from vfio-pci and gives it back, which the grpc-go kubelet sees as
   Unhealthy and Healthy again.
3. `sriov`: QEMU's NVMe controller's SR-IOV: VFs made while dp serves, moved
   to vfio-pci by dp and handed out with their character devices, withdrawn
   with `sriov_numvfs=0`; and the binding plan refusing to move the PF.
4. `dra`: the DRA front end (tests/guest_dra.py) with `vfio.interface:
   iommufd`, then `group+cdev`: the claim's CDI spec names the character
   device (with `/dev/iommu`, or with the group nodes), and a VMM uses the
   function with those nodes alone.

Every kubelet here is gokubelet (grpc-go), driven by its events
(tests/go_kubelet.py StreamingKubelet); dp serves with `--rescan-interval
3600`, so every change reaches it by the kernel's own events. Each boot's
time and the time each change took to reach the kubelet are printed.

Without QEMU and the other Debian packages these tests are skipped, and so
they are without the kernel (the reason says where it was looked for and how
to build one), unless DP_REQUIRE_QEMU=1 (as in CI), where that is a failure.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from test_real_kernel import DRA_CONFIG, DRA_STEP, TRUTH, bind_to_vfio, machine

from tests.cdi_reader import read_spec, resolve

import qemu_guest

TESTS = Path(__file__).parent
DISABLED_SHARED = """
sharedDevices:
  devices.kubevirt.io/kvm: {enabled: false}
  devices.kubevirt.io/tun: {enabled: false}
  devices.kubevirt.io/vhost-net: {enabled: false}
"""
NIC_AND_MDEVS = (
    """
vfio: {interface: %s}
permittedHostDevices:
  pciHostDevices:
    - {pciVendorSelector: "8086:10D3", resourceName: example.com/nic}
  mediatedDevices:
    - {mdevNameSelector: "Dual port serial", resourceName: example.com/serial}
    - {mdevNameSelector: "mdpy-vga", resourceName: example.com/display}
"""
    + DISABLED_SHARED
)
INTERFACES = ("group", "group+cdev", "iommufd")
CONFIGS = {f"config-{i}.yaml": NIC_AND_MDEVS % i for i in INTERFACES}
GUEST_FILES = ("guest_plugin.py", "guest_vmm.py", "go_kubelet.py", "cdi_reader.py")

# The kernel's word, read in the guest with nothing of dp's.
KERNEL_VIEW = """
import json, os

def name(path):
    return os.path.basename(os.readlink(path)) if os.path.islink(path) else None

def rdev(path):
    info = os.stat(path)
    return [os.major(info.st_rdev), os.minor(info.st_rdev)]

def cdev(base):
    if not os.path.isdir(base + "/vfio-dev"):
        return None
    (entry,) = os.listdir(base + "/vfio-dev")
    dev = base + f"/vfio-dev/{entry}/dev"
    return {"name": entry, "dev": open(dev).read().strip() if os.path.exists(dev) else None}

functions = {}
for address in sorted(os.listdir("/sys/bus/pci/devices")):
    base = f"/sys/bus/pci/devices/{address}"
    ids = ":".join(open(f"{base}/{n}").read().strip()[2:] for n in ("vendor", "device"))
    numa = int(open(f"{base}/numa_node").read())
    group = name(f"{base}/iommu_group")
    functions[address] = {
        "id": ids, "driver": name(f"{base}/driver"), "numa": None if numa < 0 else numa,
        "group": None if group is None else int(group), "cdev": cdev(base),
    }
parents = {}
for parent in sorted(os.listdir("/sys/class/mdev_bus")):
    base = f"/sys/class/mdev_bus/{parent}"
    types = {}
    for kind in sorted(os.listdir(f"{base}/mdev_supported_types")):
        where = f"{base}/mdev_supported_types/{kind}"
        types[kind] = {
            "name": open(f"{where}/name").read().strip(),
            "available_instances": int(open(f"{where}/available_instances").read()),
            "device_api": open(f"{where}/device_api").read().strip(),
        }
    parents[parent] = {
        "device": os.path.realpath(base),
        "numa_node_file": os.path.exists(f"{base}/numa_node"),
        "types": types,
    }
mdevs = {}
for uuid in sorted(os.listdir("/sys/bus/mdev/devices")):
    base = f"/sys/bus/mdev/devices/{uuid}"
    group = name(f"{base}/iommu_group")
    mdevs[uuid] = {
        "parent": os.path.basename(os.path.dirname(os.path.realpath(base))),
        "type": name(f"{base}/mdev_type"),
        "group": int(group),
        "group_members": sorted(os.listdir(f"{base}/iommu_group/devices")),
        "cdev": cdev(base),
    }
nodes = {"/dev/iommu": rdev("/dev/iommu") if os.path.exists("/dev/iommu") else None}
for directory in ("/dev/vfio", "/dev/vfio/devices"):
    for entry in sorted(os.listdir(directory)) if os.path.isdir(directory) else ():
        path = f"{directory}/{entry}"
        if not os.path.isdir(path):
            nodes[path] = rdev(path)
print(json.dumps({"kernel": os.uname().release, "functions": functions, "parents": parents,
                  "mdevs": mdevs, "nodes": nodes}))
"""
VIEW_STEP = "py /scenario/kernel_view.py"


MTTY = "/sys/class/mdev_bus/mtty/mdev_supported_types/mtty-2/create"
MDPY = "/sys/class/mdev_bus/mdpy/mdev_supported_types/mdpy-vga/create"
SERIALS = ("83b8f4f2-509f-382f-3c1e-e6bfe0fa1001", "83b8f4f2-509f-382f-3c1e-e6bfe0fa1002")
DISPLAY = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1003"
CREATE_MDEVS = f"""
echo {SERIALS[0]} > {MTTY}
echo {SERIALS[1]} > {MTTY}
echo {DISPLAY} > {MDPY}
"""


@pytest.fixture(scope="module")
def guest(request: pytest.FixtureRequest) -> qemu_guest.Guest:
    qemu_guest.require()
    kernel = qemu_guest.iommufd_kernel()
    if isinstance(kernel, str):
        if os.environ.get("DP_REQUIRE_QEMU") == "1":
            pytest.fail(f"DP_REQUIRE_QEMU=1 but the kernel with iommufd is missing: {kernel}")
        pytest.skip(kernel)
    # Asked for only now: without the kernel there is no image to build.
    image: Path = request.getfixturevalue("guest_python_image")
    # One vCPU: under TCG with two, this kernel's boot-time code patching (a
    # static key switched while the other vCPU runs the code, text_poke_bp's
    # int3) now and then meets a stale translation and oopses before /init.
    return qemu_guest.Guest(kernel, image, cpus=1)


def run(
    guest: qemu_guest.Guest,
    tmp_path: Path,
    name: str,
    machine: list[str],
    steps: list[str],
    files: dict[str, str],
    binaries: dict[str, Path] | None = None,
) -> list[tuple[int, str]]:
    sources = {f: (TESTS / f).read_text() for f in GUEST_FILES}
    found = guest.run(
        tmp_path,
        machine,
        steps,
        files={**sources, "kernel_view.py": KERNEL_VIEW, **files},
        binaries=binaries,
    )
    print(f"boot `{name}` on Linux 6.12: {guest.boots[-1]} s (QEMU start to exit, TCG)")
    return found


def parsed(step: tuple[int, str]) -> Any:
    code, output = step
    assert code == 0, output
    # The document is the output's first top-level object; kernel messages may come before it.
    start = output.index("{\n") if "{\n" in output else output.index("{")
    return json.loads(output[start:])


def on_root_port(port: int, device: str) -> list[str]:
    return [
        "-device",
        f"pcie-root-port,id=rp{port},chassis={port}",
        "-device",
        f"{device},bus=rp{port}",
    ]


# --------------------------------------------------------------------------
# 1. Discovery, the VMM's view of each interface, real mdevs


def test_scan_each_interface_as_a_vmm_uses_it_and_real_mdevs(
    guest: qemu_guest.Guest, gokubelet: Path, tmp_path: Path
) -> None:
    steps = run(
        guest,
        tmp_path,
        "vmm",
        [*on_root_port(1, "e1000e,romfile="), *on_root_port(2, "e1000e,romfile=")],
        [
            bind_to_vfio("0x8086:0x10d3") + CREATE_MDEVS,
            "py -m dp_server scan --config /scenario/config-group+cdev.yaml --format json",
            "py -m dp_server scan --config /scenario/config-group+cdev.yaml",
            VIEW_STEP,
            "py /scenario/guest_plugin.py vmm",
        ],
        CONFIGS,
        {"gokubelet": gokubelet},
    )
    assert steps[0][0] == 0, steps[0][1]
    view = parsed(steps[3])
    check_discovery(parsed(steps[1]), steps[2][1], view)
    report = parsed(steps[4])
    nics = [a for a, f in view["functions"].items() if f["id"] == "8086:10d3"]
    assert report["nic"] == nics[0]
    for interface in INTERFACES:
        check_interface(interface, report["interfaces"][interface], view)
    check_mdev_changes(report["interfaces"]["group+cdev"]["changes"], view)


def check_discovery(scan: dict[str, Any], table: str, view: dict[str, Any]) -> None:
    """Item 1: what scan reports, against what the kernel laid out."""
    print("the kernel's view:", json.dumps(view))
    assert view["kernel"].startswith("6.12")
    assert view["nodes"]["/dev/iommu"] == [10, 257]
    assert scan["iommufd"] == {"path": "/dev/iommu", "present": True}
    assert scan["problems"] == []
    assert "/dev/iommu: present (the kernel has iommufd)" in table
    resources = {r["name"]: r for r in scan["resources"]}
    assert sorted(resources) == ["example.com/display", "example.com/nic", "example.com/serial"]

    # Each function on vfio-pci, with the character device the kernel gave it.
    on_vfio = {a: f for a, f in view["functions"].items() if f["driver"] == "vfio-pci"}
    assert len(on_vfio) == 2
    for device in resources["example.com/nic"]["devices"]:
        facts = on_vfio.pop(device["id"])
        node = f"/dev/vfio/devices/{facts['cdev']['name']}"
        major, minor = view["nodes"][node]
        assert facts["cdev"]["dev"] == f"{major}:{minor}"  # sysfs's dev is the node's
        assert (device["health"], device["iommu_group"], device["cdev"]) == (
            "Healthy",
            facts["group"],
            node,
        )
        assert device["host_paths"] == ["/dev/vfio/vfio", f"/dev/vfio/{facts['group']}", node]
        line = next(line for line in table.splitlines() if line.startswith(f"  {device['id']}"))
        assert f"cdev={facts['cdev']['name']}" in line.split(), line
    assert on_vfio == {}

    # The sample drivers' parents are virtual devices, with no NUMA node.
    parents = view["parents"]
    assert sorted(parents) == ["mdpy", "mtty"]
    assert parents["mtty"]["device"] == "/sys/devices/virtual/mtty/mtty"
    assert not parents["mtty"]["numa_node_file"]
    assert parents["mtty"]["types"]["mtty-2"]["name"] == "Dual port serial"
    # Each mdev, of its type, in a group of its own that holds it alone.
    wanted = {"example.com/serial": ("mtty", "mtty-2"), "example.com/display": ("mdpy", "mdpy-vga")}
    for name, (parent, kind) in wanted.items():
        mdevs = {u: m for u, m in view["mdevs"].items() if m["type"] == kind}
        assert sorted(d["id"] for d in resources[name]["devices"]) == sorted(mdevs)
        for device in resources[name]["devices"]:
            facts = mdevs[device["id"]]
            assert facts["parent"] == parent and facts["group_members"] == [device["id"]]
            node = f"/dev/vfio/devices/{facts['cdev']['name']}"
            assert device == {
                "id": device["id"],
                "health": "Healthy",
                "numa_node": None,
                "iommu_group": facts["group"],
                "host_paths": ["/dev/vfio/vfio", f"/dev/vfio/{facts['group']}", node],
                "mdev_type": kind,
                "parent": parent,
                "cdev": node,
            }
            line = next(line for line in table.splitlines() if line.startswith(f"  {device['id']}"))
            assert line.split() == [
                device["id"],
                "Healthy",
                "numa=-",
                f"group={facts['group']}",
                f"cdev={facts['cdev']['name']}",
                f"type={kind}",
                f"parent={parent}",
            ]


def paths_for(interface: str, group: int, cdev: str) -> list[str]:
    """What dp hands out for a device of `group` with character device `cdev`."""
    group_nodes = ["/dev/vfio/vfio", f"/dev/vfio/{group}"]
    return {
        "group": group_nodes,
        "group+cdev": [*group_nodes, f"/dev/vfio/devices/{cdev}"],
        "iommufd": ["/dev/iommu", f"/dev/vfio/devices/{cdev}"],
    }[interface]


def check_vmm(vmm: dict[str, Any], nodes: list[str], interface: str) -> None:
    """The VMM's calls on a container /dev made of `nodes` alone all succeeded, and
    used each of those nodes."""
    assert vmm["nodes"] == nodes
    flows = {"group": ("group",), "group+cdev": ("group", "iommufd"), "iommufd": ("iommufd",)}
    assert sorted(k for k in vmm if k != "nodes") == sorted(flows[interface])
    opened: list[str] = []
    for flow in flows[interface]:
        steps = vmm[flow]
        assert steps["ok"] is True, (flow, steps)
        info = steps["VFIO_DEVICE_GET_INFO"]
        assert info["pci"] is True and info["num_regions"] >= 9 and info["num_irqs"] == 5, info
        opened += steps["opened"]
    if interface == "group+cdev":
        # /dev/iommu came as a descriptor, as KubeVirt's iommufd plugin passes it.
        assert vmm["iommufd"]["iommufd"] == "passed as a descriptor"
    if "group" in vmm:
        assert vmm["group"]["VFIO_GROUP_GET_STATUS"] == {"viable": True}
        assert vmm["group"]["VFIO_GET_API_VERSION"] == 0
    if "iommufd" in vmm:
        assert vmm["iommufd"]["IOMMU_IOAS_MAP"] == "ok"
    assert sorted(opened) == sorted(nodes)  # every node handed out, and nothing else


def check_handed_out(
    allocated: dict[str, Any], interface: str, group: int, cdev: str, env: tuple[str, str]
) -> None:
    """An Allocate answer and its CDI devices name the same nodes, which a VMM can use."""
    want = paths_for(interface, group, cdev)
    answer = allocated["answer"]
    assert answer["devices"] == [
        {"container_path": p, "host_path": p, "permissions": "mrw"} for p in want
    ]
    assert answer["envs"] == {env[0]: env[1]}
    assert [list(node) for node in allocated["cdi_nodes"]] == [[p, p] for p in want]
    assert allocated["cdi_env"] == []  # the variable comes with Allocate alone (docs/config.md)
    check_vmm(allocated["vmm_allocate"], want, interface)
    check_vmm(allocated["vmm_cdi"], want, interface)


def check_interface(interface: str, run: dict[str, Any], view: dict[str, Any]) -> None:
    """Items 2 and 3: what dp hands out under `interface` works for a VMM."""
    assert "failure" not in run, run.get("failure")
    assert run["server_exit"] == 0, run["server_log"]
    assert run["kubelet_errors"] == []
    log = [json.loads(line) for line in run["server_log"]]  # every line JSON: no traceback
    assert not [e for e in log if e["level"] in ("error", "critical")], log
    functions, mdevs = view["functions"], view["mdevs"]
    # Listed: no NUMA node for the e1000e (q35 has one node) nor for the mdevs.
    for name, devices in run["lists"].items():
        assert all(d["health"] == "Healthy" and not d["numa"] for d in devices), (name, devices)
    nic = functions[run["nic"]["answer"]["envs"]["PCI_RESOURCE_EXAMPLE_COM_NIC"]]
    check_handed_out(
        run["nic"],
        interface,
        nic["group"],
        nic["cdev"]["name"],
        (
            "PCI_RESOURCE_EXAMPLE_COM_NIC",
            run["nic"]["answer"]["envs"]["PCI_RESOURCE_EXAMPLE_COM_NIC"],
        ),
    )
    serial = run["serial"]["answer"]["envs"]["MDEV_PCI_RESOURCE_EXAMPLE_COM_SERIAL"]
    facts = mdevs[serial]
    check_handed_out(
        run["serial"],
        interface,
        facts["group"],
        facts["cdev"]["name"],
        ("MDEV_PCI_RESOURCE_EXAMPLE_COM_SERIAL", serial),
    )


def check_mdev_changes(changes: dict[str, Any], view: dict[str, Any]) -> None:
    """Item 3: an mdev removed leaves the kubelet's list, one created joins it."""
    print(
        f"mdev removed -> listed without it: {changes['after_remove']['seconds']} s; "
        f"created -> listed Healthy: {changes['after_create']['seconds']} s"
    )
    removed, created = changes["removed"], changes["created"]
    assert removed in SERIALS
    assert removed not in {d["id"] for d in changes["after_remove"]["devices"]}
    after = {d["id"]: d["health"] for d in changes["after_create"]["devices"]}
    assert after == {created: "Healthy", **{u: "Healthy" for u in SERIALS if u != removed}}
    kernel = changes["kernel"]
    # The kernel hands out the lowest free group number: the removed mdev's
    # again, so the same /dev/vfio/<n> now stands for another device.
    assert kernel["group"] == view["mdevs"][removed]["group"]
    check_handed_out(
        changes["allocated"],
        "group+cdev",
        kernel["group"],
        kernel["cdev"],
        ("MDEV_PCI_RESOURCE_EXAMPLE_COM_SERIAL", created),
    )


# --------------------------------------------------------------------------
# 2. Binding on the new kernel, and health following the character device

BINDING = (
    """
permittedHostDevices:
  pciHostDevices:
    - {pciVendorSelector: "8086:10D3", resourceName: example.com/nic}
binding:
  replaceDrivers: [e1000e]
"""
    + DISABLED_SHARED
)


def test_binding_gives_the_cdev_and_health_follows_it(
    guest: qemu_guest.Guest, gokubelet: Path, tmp_path: Path
) -> None:
    steps = run(
        guest,
        tmp_path,
        "lifecycle",
        on_root_port(1, "e1000e,romfile="),
        [VIEW_STEP, "py /scenario/guest_plugin.py lifecycle", VIEW_STEP],
        {
            "config-binding.yaml": BINDING,
            "config-group+cdev.yaml": CONFIGS["config-group+cdev.yaml"],
        },
        {"gokubelet": gokubelet},
    )
    before, report, after = parsed(steps[0]), parsed(steps[1]), parsed(steps[2])
    nic = report["nic"]
    group = before["functions"][nic]["group"]
    assert report["before"] == {"driver": "e1000e", "cdev": None}

    # Item 5: scan's plan says dp will move it; serve moves it, and the
    # function gets its character device, which Allocate hands out.
    assert report["plan"]["binding"] == [{"id": nic, "driver": "e1000e", "action": "bind"}]
    (planned,) = report["plan"]["resources"][0]["devices"]
    assert planned["health"] == "Unhealthy" and "e1000e" in planned["reason"], planned
    moved = report["binding"]
    assert "failure" not in moved, moved.get("failure")
    assert moved["server_exit"] == 0 and moved["kubelet_errors"] == []
    log = [json.loads(line) for line in moved["server_log"]]
    events = [(e["event"], e.get("device")) for e in log if e["event"] in ("bind", "bound")]
    assert events == [("bind", nic), ("bound", nic)], moved["server_log"]
    assert moved["kernel"]["driver"] == "vfio-pci"
    cdev = moved["kernel"]["cdev"]
    assert cdev is not None
    check_handed_out(
        moved["allocated"], "group+cdev", group, cdev, ("PCI_RESOURCE_EXAMPLE_COM_NIC", nic)
    )

    # Item 4: the operator takes it from vfio-pci, its character device goes,
    # and the grpc-go kubelet is told Unhealthy; given back, Healthy.
    followed = report["health"]
    assert "failure" not in followed, followed.get("failure")
    assert followed["server_exit"] == 0 and followed["kubelet_errors"] == []
    print(
        f"unbound -> Unhealthy: {followed['unbound']['seconds']} s; "
        f"bound -> Healthy: {followed['bound']['seconds']} s"
    )
    assert {d["id"]: d["health"] for d in followed["first"]} == {nic: "Healthy"}
    assert {d["id"]: d["health"] for d in followed["unbound"]["devices"]} == {nic: "Unhealthy"}
    assert followed["unbound_kernel"] == {"driver": None, "cdev": None, "cdev_nodes": []}
    assert {d["id"]: d["health"] for d in followed["bound"]["devices"]} == {nic: "Healthy"}
    back = followed["bound_kernel"]
    assert back["driver"] == "vfio-pci" and back["cdev"] is not None
    check_handed_out(
        followed["allocated"],
        "group+cdev",
        group,
        back["cdev"],
        ("PCI_RESOURCE_EXAMPLE_COM_NIC", nic),
    )
    assert after["functions"][nic]["driver"] == "vfio-pci"


# --------------------------------------------------------------------------
# 3. Real SR-IOV VFs: QEMU's NVMe controller

SRIOV = (
    """
permittedHostDevices:
  pciHostDevices:
    - {pciVendorSelector: "1B36:0010", resourceName: example.com/nvme-vf}
binding:
  bindUnbound: true
"""
    + DISABLED_SHARED
)
# The same, with the PF's driver replaceable: the plan must still leave the PF.
SRIOV_PF = SRIOV.replace("  bindUnbound: true\n", "  bindUnbound: true\n  replaceDrivers: [nvme]\n")


def nvme_with_sriov(tmp_path: Path) -> list[str]:
    """QEMU 7.2's NVMe controller with two VFs to offer (qemu's docs/system/devices/nvme.rst)."""
    disk = qemu_guest.disk(tmp_path / "nvme.img")
    return [
        *("-device", "pcie-root-port,id=rp1,chassis=1", "-device", "nvme-subsys,id=subsys0"),
        *("-drive", f"file={disk},if=none,id=nv0,format=raw"),
        "-device",
        "nvme,id=nvme0,bus=rp1,subsys=subsys0,serial=dp1,sriov_max_vfs=2,"
        "sriov_vq_flexible=4,sriov_vi_flexible=2,max_ioqpairs=6,msix_qsize=4",
        *("-device", "nvme-ns,drive=nv0,bus=nvme0"),
    ]


def test_vfs_made_while_dp_serves(guest: qemu_guest.Guest, gokubelet: Path, tmp_path: Path) -> None:
    steps = run(
        guest,
        tmp_path,
        "sriov",
        nvme_with_sriov(tmp_path),
        ["py /scenario/guest_plugin.py sriov", VIEW_STEP],
        {"config-sriov.yaml": SRIOV, "config-sriov-pf.yaml": SRIOV_PF},
        {"gokubelet": gokubelet},
    )
    report, after = parsed(steps[0]), parsed(steps[1])
    assert "failure" not in report, report.get("failure")
    assert report["server_exit"] == 0 and report["kubelet_errors"] == []
    pf = report["pf"]
    assert report["pf_driver"] == "nvme" and report["totalvfs"] == "2"
    print(
        f"sriov_numvfs=2 -> both VFs listed Healthy: {report['made']['seconds']} s; "
        f"sriov_numvfs=0 -> withdrawn: {report['withdrawn']['seconds']} s"
    )

    # Made while dp served, seen by the kernel's uevents, moved to vfio-pci by
    # dp, each alone in its group with its character device.
    vfs = report["vfs"]
    assert sorted(d["id"] for d in report["made"]["devices"]) == sorted(vfs)
    groups = {facts["group"] for facts in vfs.values()}
    assert len(groups) == 2
    for vf, facts in vfs.items():
        assert facts["physfn"] == pf and facts["driver"] == "vfio-pci", (vf, facts)
        assert re.fullmatch(r"vfio[0-9]+", facts["cdev"] or ""), facts
    log = [json.loads(line) for line in report["server_log"]]
    bound = sorted(e["device"] for e in log if e["event"] == "bound")
    assert bound == sorted(vfs), report["server_log"]
    first = sorted(vfs)[0]
    check_handed_out(
        report["allocated"],
        "group+cdev",
        vfs[first]["group"],
        vfs[first]["cdev"],
        ("PCI_RESOURCE_EXAMPLE_COM_NVME-VF", first),
    )

    # With nvme replaceable, the plan still leaves the PF: its VFs are enabled.
    plan = {d["id"]: d for d in report["plan_with_vfs"]["binding"]}
    assert plan == {
        pf: {
            "id": pf,
            "driver": "nvme",
            "action": "refused",
            "reason": "has 2 virtual functions enabled; unbinding nvme would remove them",
        }
    }

    # sriov_numvfs=0: the VFs are gone, and so is every character device.
    assert report["withdrawn"]["devices"] == [], report["withdrawn"]
    assert report["after"] == {"vfs": [], "cdev_nodes": []}
    assert after["functions"][pf]["driver"] == "nvme"


# --------------------------------------------------------------------------
# 4. DRA on the new kernel

DRA_DRIVER = "vfio.dp.example.com"
# The DRA flow again, on a fresh state, with the next interface's config.
DRA_AGAIN = "rm -rf /py/tmp/dra && cp /scenario/config-group+cdev.yaml /scenario/config.yaml"


def test_dra_claims_name_the_cdev_and_a_vmm_can_use_them(
    guest: qemu_guest.Guest, tmp_path: Path
) -> None:
    steps = run(
        guest,
        tmp_path,
        "dra",
        machine(tmp_path, cpus=guest.cpus),
        [
            bind_to_vfio("0x8086:0x10d3|0x8086:0x100e|0x1af4:0x1001"),
            "py /scenario/truth.py",
            VIEW_STEP,
            DRA_STEP + " vmm",
            DRA_AGAIN,
            DRA_STEP + " vmm",
        ],
        {
            "config.yaml": "vfio: {interface: iommufd}\n" + DRA_CONFIG,
            "config-group+cdev.yaml": "vfio: {interface: group+cdev}\n" + DRA_CONFIG,
            "truth.py": TRUTH,
            "guest_dra.py": (TESTS / "guest_dra.py").read_text(),
        },
    )
    assert steps[0][0] == 0 and steps[4][0] == 0, (steps[0][1], steps[4][1])
    truth, view = parsed(steps[1]), parsed(steps[2])
    for interface, report in (("iommufd", parsed(steps[3])), ("group+cdev", parsed(steps[5]))):
        check_dra(interface, report, truth, view)


def check_dra(
    interface: str, report: dict[str, Any], truth: dict[str, Any], view: dict[str, Any]
) -> None:
    assert "failure" not in report and None not in report["waited"].values(), report
    assert report["server_exit"] == 0, report["server_log"]
    nic, group = report["kernel"]["nic"], report["kernel"]["group"]
    assert truth["viable"][str(group)] is True
    cdev = view["functions"][nic]["cdev"]["name"]

    # The claim's CDI spec names the function's character device, and
    # /dev/iommu in iommufd mode, the group nodes in group+cdev.
    uid = report["uids"]["vm-nic"]
    name = "pci-" + nic.replace(":", "-").replace(".", "-")
    claim_id = f"{DRA_DRIVER}/claim={uid}-{name}"
    assert report["prepare"]["vm-nic"]["error"] == ""
    spec_name = f"{DRA_DRIVER}_claim_{uid}.json"
    edits = resolve([read_spec(report["cdi_prepared"][spec_name], spec_name)], claim_id)
    nodes = [(n.path, n.host_path, n.permissions) for n in edits.device_nodes]
    want = paths_for(interface, group, cdev)
    assert nodes == [(p, p, "mrw") for p in want], interface
    for path in want:
        assert report["dev_vfio"][path]["char"] is True, (path, report["dev_vfio"])
    if interface == "iommufd":
        assert report["dev_vfio"]["/dev/iommu"]["rdev"] == [10, 257]
    # A VMM given those nodes alone uses the function through them.
    check_vmm(report["vmm"], want, interface)

    # The group is still kept whole: its other member's claim is refused.
    (refused,) = report["prepare_sibling"].values()
    assert refused["devices"] == [] and f"IOMMU group {group}" in refused["error"]
    assert report["unprepare"] == {"vm-nic": ""} and report["cdi_end"] == []
