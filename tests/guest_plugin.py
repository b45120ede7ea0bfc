"""The device-plugin scenarios in the Linux 6.12 guest (tests/test_real_kernel_iommufd.py).

Run in the guest by `py`, with dp and its dependencies from the python
image and, from /scenario, gokubelet (grpc-go, in its stream mode), its
client (go_kubelet.py), a CDI reader written from the CDI spec alone
(cdi_reader.py) and the VMM's calls (guest_vmm.py). Each scenario runs
`dp-server serve` as the DaemonSet would, with `--rescan-interval 3600`, so
that every change it follows reaches it by the kernel's own events (a
/dev/vfio node, a uevent), and changes the host as an operator or the
kernel would. Waits are on the kubelet's events. Nothing is judged here:
what is seen is printed as one JSON document for the host side to check
against the kernel's word.

Usage: guest_plugin.py SCENARIO (vmm, lifecycle, sriov)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, "/scenario")

import guest_vmm  # noqa: E402

import go_kubelet  # noqa: E402

WAIT = 120.0  # emulated, dp's start alone takes seconds
GOKUBELET = "/scenario/gokubelet"

Obj = dict[str, Any]
Devices = list[Obj]


def pci_functions(vendor_device: str) -> list[str]:
    """Addresses of the functions with `vendor:device` (hex, no 0x), in order."""
    found = []
    for address in sorted(os.listdir("/sys/bus/pci/devices")):
        base = f"/sys/bus/pci/devices/{address}"
        ids = ":".join(Path(base, n).read_text().strip()[2:] for n in ("vendor", "device"))
        if ids == vendor_device:
            found.append(address)
    return found


def write(path: str, text: str) -> None:
    with open(path, "w") as out:
        out.write(text)


def driver(address: str) -> str | None:
    link = f"/sys/bus/pci/devices/{address}/driver"
    return os.path.basename(os.readlink(link)) if os.path.islink(link) else None


def cdev_name(sysfs_dir: str) -> str | None:
    try:
        (name,) = os.listdir(f"{sysfs_dir}/vfio-dev")
    except (FileNotFoundError, ValueError):
        return None
    return name


def cdev_nodes() -> list[str]:
    """The VFIO character devices in /dev (devtmpfs removes the folder once empty)."""
    directory = "/dev/vfio/devices"
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


def all_healthy(devices: Devices) -> bool:
    return bool(devices) and all(d["health"] == "Healthy" for d in devices)


def health(devices: Devices) -> dict[str, str]:
    return {d["id"]: d["health"] for d in devices}


class Served:
    """`dp-server serve` with CDI specs, to gokubelet in its stream mode."""

    def __init__(self, name: str, config: str, *, pod_resources: bool = False) -> None:
        self.root = Path("/tmp") / name
        self.cdi = self.root / "cdi"
        for directory in (self.cdi, self.root / "state"):
            directory.mkdir(parents=True)
        plugin_dir = self.root / "dp"
        pod_socket = self.root / "pod-resources.sock"
        self.kubelet = go_kubelet.StreamingKubelet(
            GOKUBELET, plugin_dir, pod_resources=pod_socket if pod_resources else None
        )
        self.log_path = self.root / "server.log"
        self.log = self.log_path.open("w")
        self.started = time.time()
        self.server = subprocess.Popen(
            [
                *(sys.executable, "-m", "dp_server", "serve", "--config", config),
                *("--device-plugin-dir", str(plugin_dir), "--cdi-spec-dir", str(self.cdi)),
                *(
                    "--pod-resources-socket",
                    str(pod_socket),
                    "--state-dir",
                    str(self.root / "state"),
                ),
                *("--rescan-interval", "3600", "--log-format", "json"),
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def ready(self) -> None:
        """Wait until dp has seen the kubelet: its first scan is done, and it
        follows the host's changes (as its `kubelet-started` line says)."""
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            for line in self.log_path.read_text().splitlines():
                if '"event": "kubelet-started"' in line:
                    return
            if self.server.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"dp never saw the kubelet: {self.log_path.read_text()[-2000:]}")

    def listed(self, resource: str, check: Callable[[Devices], bool]) -> Obj:
        """The first list of `resource` that satisfies `check`; raises if none comes."""
        event = self.kubelet.wait_list(resource, check, WAIT)
        if event is None:
            raise AssertionError(
                f"{resource}: no list as wanted within {WAIT} s; last: "
                f"{self.kubelet.devices(resource)}"
            )
        return event

    def change(
        self, resource: str, act: Callable[[], None], check: Callable[[Devices], bool]
    ) -> Obj:
        """Do `act`, then wait for a list of `resource` that satisfies `check`;
        the list, its devices and the seconds from the act to its arrival."""
        before = len(self.kubelet.events)
        acted = time.time()
        act()
        event = self.kubelet.wait(
            lambda e: (
                e["event"] == "list" and e["resource"] == resource and check(e["devices"] or [])
            ),
            WAIT,
            after=before,
        )
        if event is None:
            raise AssertionError(
                f"{resource}: no list as wanted within {WAIT} s of the change; last: "
                f"{self.kubelet.devices(resource)}"
            )
        return {"devices": event["devices"] or [], "seconds": round(event["at"] - acted, 3)}

    def allocate(self, resource: str, ids: list[str]) -> Obj:
        answer = self.kubelet.allocate(resource, ids, WAIT)
        if answer["error"]:
            raise AssertionError(f"Allocate({resource}, {ids}): {answer['error']}")
        (container,) = answer["containers"]
        return dict(container)

    def stop(self) -> Obj:
        self.server.send_signal(signal.SIGTERM)
        try:
            code: int | str = self.server.wait(60)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait()
            code = "killed after 60 s"
        end = self.kubelet.close()
        self.log.close()
        return {
            "server_exit": code,
            "server_log": self.log_path.read_text().splitlines(),
            "kubelet_errors": None if end is None else end["errors"],
        }


def scan(config: str) -> Obj:
    found = subprocess.run(
        [sys.executable, "-m", "dp_server", "scan", "--config", config, "--format", "json"],
        capture_output=True,
        text=True,
    )
    if found.returncode != 0:
        raise AssertionError(f"scan failed ({found.returncode}): {found.stderr}")
    document: Obj = json.loads(found.stdout)
    return document


# -- what a VMM does with what dp handed out ---------------------------------------


def handed_out(served: Served, resource: str, device: str) -> Obj:
    """Allocate `device` alone; the answer, its CDI devices, and the VMM's
    calls on the nodes of each."""
    container = served.allocate(resource, [device])
    nodes = [(d["container_path"], d["host_path"]) for d in container["devices"]]
    from_cdi, cdi_env = guest_vmm.cdi_nodes(served.cdi, container.get("cdi_devices") or [])
    return {
        "answer": container,
        "cdi_nodes": from_cdi,
        "cdi_env": cdi_env,
        "vmm_allocate": guest_vmm.as_vmm(nodes, device),
        "vmm_cdi": guest_vmm.as_vmm(from_cdi, device),
    }


# -- scenarios -------------------------------------------------------------------


def vmm() -> Obj:
    """Items 2 and 3: each interface, as a VMM uses it, on a function and mdevs;
    mdevs removed and created while dp serves."""
    nic = pci_functions("8086:10d3")[0]
    serial = sorted(os.listdir("/sys/class/mdev_bus/mtty/mdev_supported_types/mtty-2/devices"))
    (display,) = os.listdir("/sys/class/mdev_bus/mdpy/mdev_supported_types/mdpy-vga/devices")
    report: Obj = {"nic": nic, "serial": serial, "display": display, "interfaces": {}}
    for interface in ("group", "iommufd", "group+cdev"):
        served = Served(f"vmm-{interface}", f"/scenario/config-{interface}.yaml")
        run: Obj = report["interfaces"].setdefault(interface, {})
        try:
            run["lists"] = {
                name: served.listed(name, all_healthy)["devices"]
                for name in ("example.com/nic", "example.com/serial", "example.com/display")
            }
            run["nic"] = handed_out(served, "example.com/nic", nic)
            run["serial"] = handed_out(served, "example.com/serial", serial[0])
            if interface == "group+cdev":
                run["changes"] = mdev_changes(served, serial)
        except Exception as failure:  # reported with all that came before
            run["failure"] = f"{type(failure).__name__}: {failure}"
        finally:
            run.update(served.stop())
    return report


NEW_MDEV = "83b8f4f2-509f-382f-3c1e-e6bfe0fa10ff"


def mdev_changes(served: Served, serial: list[str]) -> Obj:
    resource = "example.com/serial"
    removed = serial[-1]
    gone = served.change(
        resource,
        lambda: write(f"/sys/bus/mdev/devices/{removed}/remove", "1"),
        lambda devices: removed not in health(devices),
    )
    create = "/sys/class/mdev_bus/mtty/mdev_supported_types/mtty-2/create"
    made = served.change(
        resource,
        lambda: write(create, NEW_MDEV),
        lambda devices: health(devices).get(NEW_MDEV) == "Healthy",
    )
    base = f"/sys/bus/mdev/devices/{NEW_MDEV}"
    return {
        "removed": removed,
        "after_remove": gone,
        "created": NEW_MDEV,
        "after_create": made,
        "kernel": {
            "group": int(os.path.basename(os.readlink(f"{base}/iommu_group"))),
            "cdev": cdev_name(base),
        },
        "allocated": handed_out(served, resource, NEW_MDEV),
    }


def lifecycle() -> Obj:
    """Items 5 and 4: dp moves a function from its host driver to vfio-pci (it
    gets its cdev); then, on a config without binding, the operator takes it
    from vfio-pci (its cdev goes) and gives it back."""
    (nic,) = pci_functions("8086:10d3")
    base = f"/sys/bus/pci/devices/{nic}"
    report: Obj = {"nic": nic, "before": {"driver": driver(nic), "cdev": cdev_name(base)}}
    report["plan"] = scan("/scenario/config-binding.yaml")
    served = Served("binding", "/scenario/config-binding.yaml", pod_resources=True)
    moved: Obj = report.setdefault("binding", {})
    try:
        moved["healthy"] = served.listed(
            "example.com/nic", lambda devices: health(devices).get(nic) == "Healthy"
        )["devices"]
        moved["kernel"] = {"driver": driver(nic), "cdev": cdev_name(base)}
        moved["allocated"] = handed_out(served, "example.com/nic", nic)
    except Exception as failure:
        moved["failure"] = f"{type(failure).__name__}: {failure}"
    finally:
        moved.update(served.stop())

    served = Served("health", "/scenario/config-group+cdev.yaml")
    followed: Obj = report.setdefault("health", {})
    try:
        resource = "example.com/nic"
        followed["first"] = served.listed(resource, lambda d: health(d).get(nic) == "Healthy")[
            "devices"
        ]
        followed["unbound"] = served.change(
            resource,
            lambda: write("/sys/bus/pci/drivers/vfio-pci/unbind", nic),
            lambda devices: health(devices).get(nic) == "Unhealthy",
        )
        followed["unbound_kernel"] = {
            "driver": driver(nic),
            "cdev": cdev_name(base),
            "cdev_nodes": cdev_nodes(),
        }
        followed["bound"] = served.change(
            resource,
            lambda: write("/sys/bus/pci/drivers_probe", nic),  # driver_override is vfio-pci
            lambda devices: health(devices).get(nic) == "Healthy",
        )
        followed["bound_kernel"] = {"driver": driver(nic), "cdev": cdev_name(base)}
        followed["allocated"] = handed_out(served, resource, nic)
    except Exception as failure:
        followed["failure"] = f"{type(failure).__name__}: {failure}"
    finally:
        followed.update(served.stop())
    return report


def sriov() -> Obj:
    """Item 7: VFs made while dp serves, moved to vfio-pci by its binding
    policy, handed out with their cdevs, and withdrawn with sriov_numvfs=0;
    the plan refuses to move a PF whose VFs are enabled."""
    (pf,) = [
        a
        for a in pci_functions("1b36:0010")
        if not os.path.exists(f"/sys/bus/pci/devices/{a}/physfn")
    ]
    base = f"/sys/bus/pci/devices/{pf}"
    report: Obj = {
        "pf": pf,
        "pf_driver": driver(pf),
        "totalvfs": Path(base, "sriov_totalvfs").read_text().strip(),
    }
    # As an operator readies VFs for passthrough: no host driver probes them.
    write(f"{base}/sriov_drivers_autoprobe", "0")
    served = Served("sriov", "/scenario/config-sriov.yaml", pod_resources=True)
    resource = "example.com/nvme-vf"
    try:
        served.ready()
        report["made"] = served.change(
            resource,
            lambda: write(f"{base}/sriov_numvfs", "2"),
            lambda devices: len(devices) == 2 and all(d["health"] == "Healthy" for d in devices),
        )
        vfs = sorted(os.path.basename(os.readlink(f"{base}/virtfn{i}")) for i in range(2))
        report["vfs"] = {
            vf: {
                "driver": driver(vf),
                "physfn": os.path.basename(os.readlink(f"/sys/bus/pci/devices/{vf}/physfn")),
                "group": int(
                    os.path.basename(os.readlink(f"/sys/bus/pci/devices/{vf}/iommu_group"))
                ),
                "cdev": cdev_name(f"/sys/bus/pci/devices/{vf}"),
            }
            for vf in vfs
        }
        report["allocated"] = handed_out(served, resource, vfs[0])
        report["plan_with_vfs"] = scan("/scenario/config-sriov-pf.yaml")
        report["withdrawn"] = served.change(
            resource,
            lambda: write(f"{base}/sriov_numvfs", "0"),
            lambda devices: not devices,
        )
        report["after"] = {
            "vfs": [a for a in pci_functions("1b36:0010") if a != pf],
            "cdev_nodes": cdev_nodes(),
        }
    except Exception as failure:
        report["failure"] = f"{type(failure).__name__}: {failure}"
    finally:
        report.update(served.stop())
    return report


if __name__ == "__main__":
    scenario = {"vmm": vmm, "lifecycle": lifecycle, "sriov": sriov}[sys.argv[1]]
    print(json.dumps(scenario(), indent=1))
