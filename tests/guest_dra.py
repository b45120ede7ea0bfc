"""The DRA path in the real-kernel guest (tests/test_real_kernel.py), run there by `py`.

It runs in the guest with dp's dependencies from the python image: the
API-server emulator (h11, on this loop), the grpcio DRA kubelet emulator, and
`dp-server serve` as the DaemonSet would run it, with the DRA config in
/scenario/config.yaml. The devices are whatever the kernel shows: the e1000
behind the PCI bridge and the virtio disk beside it (one IOMMU group, both on
vfio-pci by the operator's hand) are found in sysfs and claimed through the
device names dp published for their PCI addresses, as a scheduler would pick
them. Nothing is judged here: everything seen is printed as one JSON
document for the host side of the test to check against the kernel's word.

Usage: guest_dra.py DRIVER NODE [vmm]
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dp_testing.apiserver import ApiServerEmulator
from dp_testing.dra_kubelet import Claim, DraKubeletEmulator

DRIVER, NODE = sys.argv[1], sys.argv[2]
# With `vmm`, the prepared claim's nodes are driven as a VMM does (guest_vmm.py).
VMM = sys.argv[3:] == ["vmm"]
ROOT = Path("/tmp/dra")
CDI, STATE = ROOT / "cdi", ROOT / "state"
REGISTRY, PLUGINS = ROOT / "registry", ROOT / "plugins"
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
# Emulated, every step is slow: dp's start alone takes seconds.
WAIT = 120.0

Obj = dict[str, Any]


def sysfs_devices() -> dict[str, Obj]:
    devices = {}
    for address in sorted(os.listdir("/sys/bus/pci/devices")):
        base = Path("/sys/bus/pci/devices", address)
        vendor, device = ((base / n).read_text().strip()[2:] for n in ("vendor", "device"))
        group = base / "iommu_group"
        devices[address] = {
            "id": f"{vendor}:{device}",
            "group": int(os.path.basename(os.readlink(group))) if group.exists() else None,
        }
    return devices


def pool(api: ApiServerEmulator) -> list[Obj]:
    """The slices of this node's newest complete pool generation (none while incomplete)."""
    ours = [s for s in api.slices() if s["spec"].get("nodeName") == NODE]
    if not ours:
        return []
    top = max(s["spec"]["pool"]["generation"] for s in ours)
    current = [s for s in ours if s["spec"]["pool"]["generation"] == top]
    if len(current) != current[0]["spec"]["pool"]["resourceSliceCount"]:
        return []
    return current


def functions(api: ApiServerEmulator) -> list[Obj]:
    """The pool's devices that are one function each (not a whole IOMMU group)."""
    return [
        d
        for s in pool(api)
        for d in s["spec"].get("devices") or ()
        if d["attributes"]["resourceName"]["string"] != "iommu-group"
    ]


def published(api: ApiServerEmulator) -> dict[str, list[str]]:
    """The pool's functions: PCI address -> the keys of the device's taints."""
    return {
        d["attributes"][PCI_BUS_ID]["string"]: sorted(t["key"] for t in d.get("taints") or ())
        for d in functions(api)
    }


def offered(api: ApiServerEmulator, address: str) -> bool:
    """Whether the scheduler may allocate the device: published, and untainted."""
    return published(api).get(address) == []


def names(api: ApiServerEmulator) -> dict[str, str]:
    """The pool's functions: PCI address -> device name."""
    return {d["attributes"][PCI_BUS_ID]["string"]: d["name"] for d in functions(api)}


async def until(check: Callable[[], bool], timeout: float = WAIT) -> float | None:
    """Seconds until `check` held, or None if it never did within `timeout`."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            return None
        await asyncio.sleep(0.1)
    return round(time.monotonic() - start, 2)


def files(directory: Path) -> dict[str, str]:
    """Every file under `directory`, by path relative to it, with its text."""
    if not directory.is_dir():
        return {}
    return {
        str(p.relative_to(directory)): p.read_text()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def dev_vfio() -> dict[str, Obj]:
    """What /dev/vfio (and /dev/iommu) holds: each node's type and numbers."""
    nodes = {}
    iommu = [Path("/dev/iommu")] if os.path.exists("/dev/iommu") else []
    for path in [*sorted(Path("/dev/vfio").rglob("*")), *iommu]:
        info = path.lstat()
        nodes[str(path)] = {
            "char": stat.S_ISCHR(info.st_mode),
            "rdev": [os.major(info.st_rdev), os.minor(info.st_rdev)],
        }
    return nodes


def claim(api: ApiServerEmulator, name: str, request: str, device: str) -> Claim:
    """A claim in the API server, allocated `device` of this node's pool, as the scheduler would."""
    obj = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "devices": {"requests": [{"name": request, "exactly": {"deviceClassName": "vfio"}}]}
        },
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": request, "driver": DRIVER, "pool": NODE, "device": device}
                    ]
                }
            }
        },
    }
    created = api.store.create("resourceclaims", "default", obj)
    return Claim("default", created["metadata"]["uid"], name)


async def scenario(api: ApiServerEmulator, kubelet: DraKubeletEmulator, report: Obj) -> None:
    kernel = sysfs_devices()
    (nic,) = (a for a, d in kernel.items() if d["id"] == "8086:100e")
    group = kernel[nic]["group"]
    (disk,) = (a for a, d in kernel.items() if d["id"] == "1af4:1001" and d["group"] == group)
    report["kernel"] = {"nic": nic, "disk": disk, "group": group}

    start = time.monotonic()
    registered = await asyncio.to_thread(kubelet.wait_for, "registered", DRIVER, timeout=WAIT)
    # How long dp took to start and register under emulation, for whoever wonders.
    report["waited"]["registered"] = round(time.monotonic() - start, 2)
    report["registered"] = [e.detail for e in registered]
    report["waited"]["pool"] = await until(lambda: offered(api, nic) and offered(api, disk))
    report["slices"] = pool(api)
    device = names(api)

    async def prepare(*claims: Claim) -> Obj:
        results = await asyncio.to_thread(kubelet.prepare, DRIVER, claims)
        return {
            c.name: {
                "error": results[c.uid].error,
                "devices": [
                    [d.pool_name, d.device_name, list(d.cdi_device_ids)]
                    for d in results[c.uid].devices
                ],
            }
            for c in claims
        }

    async def unprepare(*claims: Claim) -> Obj:
        results = await asyncio.to_thread(kubelet.unprepare, DRIVER, claims)
        return {c.name: results[c.uid] for c in claims}

    # The e1000's claim, prepared: its CDI spec, metadata and checkpoint.
    held = claim(api, "vm-nic", "nic", device[nic])
    report["uids"] = {"vm-nic": held.uid}
    report["prepare"] = await prepare(held)
    report["cdi_prepared"] = files(CDI)
    report["metadata_prepared"] = files(PLUGINS / DRIVER)
    report["checkpoint"] = json.loads((STATE / "claims.json").read_text())
    report["dev_vfio"] = dev_vfio()
    if VMM:
        # What a VMM does with the nodes the claim's CDI devices name, and only those.
        sys.path.insert(0, "/scenario")
        import guest_vmm

        (prepared,) = report["prepare"]["vm-nic"]["devices"]
        # The claim's devices; the metadata's CDI device only mounts a file.
        devices = [name for name in prepared[2] if "/metadata=" not in name]
        nodes, _ = guest_vmm.cdi_nodes(CDI, devices)
        report["vmm"] = guest_vmm.as_vmm(nodes, nic)
    # The group is held: the claim's device consumes the group's counter, so the
    # scheduler counts the group taken, and the pool is not written for it.
    await asyncio.sleep(1.0)
    report["pool_held"] = published(api)

    # The disk beside it, claimed anyway: refused, naming the group and its holder.
    sibling = claim(api, "vm-disk", "disk", device[disk])
    report["uids"]["vm-disk"] = sibling.uid
    report["prepare_sibling"] = await prepare(sibling)
    report["cdi_refused"] = sorted(files(CDI))

    # Unprepare: the files go, the group is free, the disk is offered and can be had.
    report["unprepare"] = await unprepare(held)
    report["cdi_unprepared"] = sorted(files(CDI))
    report["metadata_unprepared"] = sorted(files(PLUGINS / DRIVER))
    report["waited"]["disk_back"] = await until(lambda: offered(api, disk), 30)
    report["pool_freed"] = published(api)
    report["prepare_sibling_again"] = await prepare(sibling)
    report["cdi_sibling"] = sorted(files(CDI))
    report["unprepare_sibling"] = await unprepare(sibling)
    report["cdi_end"] = sorted(files(CDI))
    report["waited"]["nic_back"] = await until(lambda: offered(api, nic), 30)
    report["pool_end"] = published(api)


async def main() -> None:
    for directory in (CDI, STATE, REGISTRY, PLUGINS, ROOT / "dp"):
        directory.mkdir(parents=True, exist_ok=True)
    api = ApiServerEmulator()
    await api.start()
    api.add_node(NODE)
    kubeconfig = ROOT / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "guest", "cluster": {"server": api.url}}],
                "users": [{"name": "guest", "user": {}}],
                "contexts": [{"name": "guest", "context": {"cluster": "guest", "user": "guest"}}],
                "current-context": "guest",
            }
        )
    )
    kubelet = DraKubeletEmulator(REGISTRY, poll_interval=0.2).start()
    log = (ROOT / "server.log").open("w")
    # `dp-server serve` as the DaemonSet runs it, this python and this image.
    server = subprocess.Popen(
        [
            *(sys.executable, "-m", "dp_server", "serve", "--config", "/scenario/config.yaml"),
            *("--node-name", NODE, "--kubeconfig", str(kubeconfig)),
            *("--plugins-registry-dir", str(REGISTRY), "--plugins-dir", str(PLUGINS)),
            *("--cdi-spec-dir", str(CDI), "--state-dir", str(STATE)),
            *("--device-plugin-dir", str(ROOT / "dp"), "--rescan-interval", "3600"),
            *("--pod-resources-socket", str(ROOT / "pod-resources.sock"), "--log-format", "json"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    report: Obj = {"waited": {}}
    try:
        await scenario(api, kubelet, report)
    except Exception as failure:  # reported, for the host to show with all that came before
        report["failure"] = f"{type(failure).__name__}: {failure}"
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            report["server_exit"] = await asyncio.to_thread(server.wait, 60)
        except subprocess.TimeoutExpired:
            server.kill()
            report["server_exit"] = "killed after 60 s"
        kubelet.stop()
        await api.stop()
        log.close()
    report["server_log"] = (ROOT / "server.log").read_text().splitlines()
    report["kubelet_events"] = [[e.kind, e.driver, e.detail] for e in kubelet.events()]
    report["api_requests"] = sorted(f"{verb} {what}" for verb, what in api.requests)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
