"""The DRA part of `dp-server demo`: slices, a prepared claim, a refused split, Unprepare.

The fixture node's T4 GPUs and NVMe pair are offered through DRA; the GPUs'
audio functions stay on the device-plugin front end, so both front ends meet
in one IOMMU group. The runtime is served to the grpcio DRA kubelet emulator,
the device-plugin kubelet emulator and the API-server emulator, all in the
demo's temporary directory.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import grpc

from dp_server.config.loader import parse_config
from dp_server.runtime.runtime import Runtime, Settings
from dp_testing.apiserver import ApiServerEmulator
from dp_testing.dra_kubelet import Claim, DraKubeletEmulator
from dp_testing.emulator import KubeletEmulator

__all__ = ["DRA_DEMO_CONFIG", "demo_dra"]

DRIVER = "vfio.dp.example.com"
NODE = "demo-node"
AUDIO = "nvidia.com/TU104_HDA"
DRA_DEMO_CONFIG = f"""
dra:
  driverName: {DRIVER}
permittedHostDevices:
  pciHostDevices:
    - pciVendorSelector: "10DE:1EB8"
      resourceName: "nvidia.com/TU104GL_Tesla_T4"
      frontend: dra
    - pciVendorSelector: "10DE:10F8"
      resourceName: "{AUDIO}"
    - pciVendorSelector: "144D:A808"
      resourceName: "devices.kubevirt.io/nvme"
      frontend: dra
"""


def _claim(api: ApiServerEmulator, name: str, request: str, device: str) -> Claim:
    result = {"request": request, "driver": DRIVER, "pool": NODE, "device": device}
    obj = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": request}]}},
        "status": {"allocation": {"devices": {"results": [result]}}},
    }
    created = api.store.create("resourceclaims", "default", obj)
    return Claim("default", created["metadata"]["uid"], name)


def _slice_lines(api: ApiServerEmulator) -> list[str]:
    lines = [f"ResourceSlices of {NODE} (driver {DRIVER}):"]
    for obj in sorted(api.slices(), key=lambda s: s["metadata"]["name"]):
        spec = obj["spec"]
        pool = spec["pool"]
        lines.append(f"  {obj['metadata']['name']}  pool {pool['name']} gen {pool['generation']}")
        for counter in spec.get("sharedCounters") or ():
            lines.append(f"    counter set {counter['name']} (one member of the group at a time)")
        for device in spec.get("devices") or ():
            attributes: dict[str, Any] = device.get("attributes", {})
            bus = attributes.get("resource.kubernetes.io/pciBusID", {}).get("string", "")
            group = attributes.get("iommuGroup", {}).get("int", "")
            taints = ", ".join(f"{t['key']}:{t['effect']}" for t in device.get("taints") or ())
            tainted = f"  tainted {taints}" if taints else ""
            lines.append(f"    {device['name']}  {bus}  IOMMU group {group}{tainted}")
    return lines


def _until(check: Any, timeout: float = 10.0) -> Any:
    async def wait() -> None:
        async with asyncio.timeout(timeout):
            while not check():
                await asyncio.sleep(0.02)

    return wait()


async def demo_dra(workdir: Path, sysfs: Path, dev: Path) -> list[str]:
    """Serve the fixture node's DRA devices and walk one claim through; the report's lines."""
    api = ApiServerEmulator()
    await api.start()
    api.add_node(NODE)
    root = workdir / "dra"
    plugin_dir = root / "device-plugins"
    kubelet = KubeletEmulator(plugin_dir, pod_resources_socket=root / "pr.sock")
    dra_kubelet = DraKubeletEmulator(root / "plugins_registry")
    await asyncio.to_thread(kubelet.start)
    await asyncio.to_thread(dra_kubelet.start)
    cdi = root / "cdi"
    cdi.mkdir(parents=True)
    settings = Settings(
        sysfs=str(sysfs),
        dev=str(dev),
        device_plugin_dir=str(plugin_dir),
        pod_resources_socket=str(root / "pr.sock"),
        cdi_spec_dir=str(cdi),
        state_dir=str(root / "state"),
        node_name=NODE,
        plugins_registry_dir=str(root / "plugins_registry"),
        plugins_dir=str(root / "plugins"),
        kube_api_server=api.url,
    )
    runtime = Runtime(settings, parse_config(DRA_DEMO_CONFIG, "<demo>"))
    serving = asyncio.create_task(runtime.run())
    try:
        await runtime.ready.wait()
        await asyncio.to_thread(dra_kubelet.wait_for, "registered", DRIVER)
        await asyncio.to_thread(kubelet.wait_registered, (AUDIO,), 10.0, listed=True)
        await _until(lambda: any(s["spec"].get("devices") for s in api.slices()))
        lines = [
            "",
            "The DRA path: GPUs and NVMe drives through DRA, the GPUs' audio functions "
            "through the device plugin",
            "",
        ]
        lines += _slice_lines(api)

        gpu = _claim(api, "vm-gpu", "gpu", "pci-0000-3b-00-0")
        (prepared,) = (await asyncio.to_thread(dra_kubelet.prepare, DRIVER, [gpu])).values()
        lines += ["", "Claim default/vm-gpu (device pci-0000-3b-00-0) prepared; CDI IDs:"]
        lines += [f"  {cdi_id}" for d in prepared.devices for cdi_id in d.cdi_device_ids]
        spec = json.loads((cdi / f"{DRIVER}_claim_{gpu.uid}.json").read_text())
        for node in spec["devices"][0]["containerEdits"]["deviceNodes"]:
            lines.append(f"  CDI device node  {node['path']} ({node.get('permissions', '')})")
        meta_spec = json.loads((cdi / f"{DRIVER}_metadata_{gpu.uid}_gpu.json").read_text())
        (mount,) = meta_spec["devices"][0]["containerEdits"]["mounts"]
        lines.append(f"  metadata mounted at {mount['containerPath']}")
        stream = Path(mount["hostPath"]).read_text().splitlines()
        oldest = json.loads(stream[-1])  # v1alpha1, what KubeVirt 1.9 reads
        (device,) = oldest["requests"][0]["devices"]
        bus = device["attributes"]["resource.kubernetes.io/pciBusID"]["string"]
        lines.append(f"  metadata ({oldest['apiVersion']}): {device['name']} pciBusID {bus}")

        lines += ["", "The split refused, on both front ends:"]
        try:
            await asyncio.to_thread(kubelet.allocate, AUDIO, ["0000:3b:00.1"])
            lines.append("  Allocate(0000:3b:00.1) was accepted (unexpected)")
        except grpc.RpcError as error:
            lines.append(f"  Allocate(0000:3b:00.1) -> {error.code().name}: {error.details()}")
        nvme_a = _claim(api, "nvme-a", "disk", "pci-0000-5e-00-0")
        nvme_b = _claim(api, "nvme-b", "disk", "pci-0000-5e-01-0")
        replies = await asyncio.to_thread(dra_kubelet.prepare, DRIVER, [nvme_a, nvme_b])
        lines.append(f"  claim nvme-a: {replies[nvme_a.uid].error or 'prepared'}")
        lines.append(f"  claim nvme-b: {replies[nvme_b.uid].error or 'prepared (unexpected)'}")

        await asyncio.to_thread(dra_kubelet.unprepare, DRIVER, [gpu, nvme_a])
        lines += ["", "Unprepare of vm-gpu and nvme-a frees their groups at once:"]
        await asyncio.to_thread(
            kubelet.wait_for,
            lambda e: e.resources()[AUDIO].devices["0000:3b:00.1"].healthy,
            5.0,
        )
        response = await asyncio.to_thread(kubelet.allocate, AUDIO, ["0000:3b:00.1"])
        nodes = ", ".join(d.host_path for d in response.devices)
        lines.append(f"  Allocate(0000:3b:00.1) -> {nodes}")
        replies = await asyncio.to_thread(dra_kubelet.prepare, DRIVER, [nvme_b])
        lines.append(f"  claim nvme-b: {replies[nvme_b.uid].error or 'prepared'}")
        return lines
    finally:
        runtime.stop()
        await serving
        await asyncio.to_thread(dra_kubelet.stop)
        await asyncio.to_thread(kubelet.stop)
        await api.stop()
