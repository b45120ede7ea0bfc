"""The DRA half of `dp-server demo`: slices, a prepared claim, a refused split, Unprepare.

It follows the config it is given: the devices its `frontend: dra` entries
select are published, the first one that can be allocated is claimed, and
a split of its IOMMU group is tried on both front ends where the node has
one to try. Without `--config` it runs on `DRA_DEMO_CONFIG`: the fixture's
T4 GPUs and NVMe pair through DRA, the GPUs' audio functions through the
device plugin, so both front ends meet in one IOMMU group.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from dp_core import Config, DevicePluginFrontend
from dp_core.dra import MEMBER_COUNT, MEMBERS, PCI_BUS_ID
from dp_server.cli.demo_node import NODE, Served
from dp_testing.apiserver import ApiServerEmulator
from dp_testing.dra_kubelet import Claim

__all__ = ["DRA_DEMO_CONFIG", "dra_lines"]

BUS_ID = PCI_BUS_ID
DRA_DEMO_CONFIG = """
dra:
  driverName: vfio.dp.example.com
permittedHostDevices:
  pciHostDevices:
    - pciVendorSelector: "10DE:1EB8"
      resourceName: "nvidia.com/TU104GL_Tesla_T4"
      frontend: dra
    - pciVendorSelector: "10DE:10F8"
      resourceName: "nvidia.com/TU104_HD_Audio"
    - pciVendorSelector: "144D:A808"
      resourceName: "devices.kubevirt.io/nvme"
      frontend: dra
"""


def _claim(api: ApiServerEmulator, driver: str, name: str, request: str, device: str) -> Claim:
    result = {"request": request, "driver": driver, "pool": NODE, "device": device}
    obj = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": request}]}},
        "status": {"allocation": {"devices": {"results": [result]}}},
    }
    created = api.store.create("resourceclaims", "default", obj)
    return Claim("default", created["metadata"]["uid"], name)


def _devices(api: ApiServerEmulator) -> list[dict[str, Any]]:
    found = [d for s in api.slices() for d in s["spec"].get("devices") or ()]
    return sorted(found, key=lambda d: d["name"])


def _attribute(device: dict[str, Any], name: str) -> Any:
    value = device.get("attributes", {}).get(name, {})
    return next(iter(value.values()), None)


def _addresses(device: dict[str, Any]) -> str:
    """What a device holds: a whole group's every member, else its own address."""
    count = _attribute(device, MEMBER_COUNT)
    if count is None:
        return str(_attribute(device, BUS_ID) or "")
    # The members' list is left out of the slice past 64 characters.
    members = _attribute(device, MEMBERS)
    return str(members) if members else f"{count} functions"


def _slice_lines(api: ApiServerEmulator, driver: str) -> list[str]:
    lines = [f"ResourceSlices of {NODE} (driver {driver}):"]
    for obj in sorted(api.slices(), key=lambda s: s["metadata"]["name"]):
        spec = obj["spec"]
        pool = spec["pool"]
        lines.append(f"  {obj['metadata']['name']}  pool {pool['name']} gen {pool['generation']}")
        for counter in spec.get("sharedCounters") or ():
            lines.append(f"    counter set {counter['name']} (one member of the group at a time)")
        for device in spec.get("devices") or ():
            taints = ", ".join(f"{t['key']}:{t['effect']}" for t in device.get("taints") or ())
            tainted = f"  tainted {taints}" if taints else ""
            group = _attribute(device, "iommuGroup")
            lines.append(
                f"    {device['name']}  {_addresses(device)}  IOMMU group {group}{tainted}"
            )
    return lines


def _until(check: Callable[[], object], timeout: float = 10.0) -> Any:
    async def wait() -> None:
        async with asyncio.timeout(timeout):
            while not check():
                await asyncio.sleep(0.02)

    return wait()


def _prepared_lines(
    served: Served, driver: str, claim: Claim, request: str, prepared: Any
) -> list[str]:
    lines = [f"  CDI IDs: {', '.join(i for d in prepared.devices for i in d.cdi_device_ids)}"]
    cdi = served.root / "cdi"
    spec = json.loads((cdi / f"{driver}_claim_{claim.uid}.json").read_text())
    for node in spec["devices"][0]["containerEdits"]["deviceNodes"]:
        lines.append(f"  CDI device node  {node['path']} ({node.get('permissions', '')})")
    meta_spec = json.loads((cdi / f"{driver}_metadata_{claim.uid}_{request}.json").read_text())
    (mount,) = meta_spec["devices"][0]["containerEdits"]["mounts"]
    lines.append(f"  metadata mounted at {mount['containerPath']}")
    stream = Path(mount["hostPath"]).read_text().splitlines()
    oldest = json.loads(stream[-1])  # v1alpha1, what KubeVirt 1.9 reads
    (device,) = oldest["requests"][0]["devices"]
    bus = device["attributes"].get(BUS_ID, {}).get("string", "-")
    lines.append(f"  metadata ({oldest['apiVersion']}): {device['name']} pciBusID {bus}")
    return lines


def _sibling(served: Served, group: object) -> tuple[str, str] | None:
    """A device-plugin device in IOMMU group `group`: (resource, device ID)."""
    for resource in served.runtime.node.frontend(DevicePluginFrontend).describe().resources:
        for device in resource.devices:
            if device.iommu_group == group and device.iommu_group is not None:
                return resource.name, device.id
    return None


def _first_claimed(served: Served, free: list[dict[str, Any]]) -> dict[str, Any]:
    """The device the demo claims first: a single function whose IOMMU group a
    device-plugin device shares, where there is one (both front ends meet in
    it), else the first that can be claimed."""
    for device in free:
        whole_group = _attribute(device, MEMBER_COUNT) is not None
        if not whole_group and _sibling(served, _attribute(device, "iommuGroup")) is not None:
            return device
    return free[0]


def _pair(devices: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Two devices that can be allocated and share an IOMMU group."""
    by_group: dict[object, list[dict[str, Any]]] = {}
    for device in devices:
        if not device.get("taints"):
            by_group.setdefault(_attribute(device, "iommuGroup"), []).append(device)
    for members in by_group.values():
        if len(members) > 1:
            return members[0], members[1]
    return None


async def dra_lines(served: Served, config: Config) -> list[str]:
    """Walk a claim through the DRA front end `served` runs; the report's lines."""
    assert config.dra is not None and served.api is not None and served.dra_kubelet is not None
    driver, api, kubelet = config.dra.driver_name, served.api, served.dra_kubelet
    await asyncio.to_thread(kubelet.wait_for, "registered", driver)
    await _until(lambda: api.slices())
    lines = ["", f"The DRA front end, driver {driver}:", ""]
    devices = _devices(api)
    if not devices:
        return [*lines, "  no device is published: no frontend: dra entry selects one here"]
    lines += _slice_lines(api, driver)
    free = [d for d in devices if not d.get("taints")]
    if not free:
        return [*lines, "", "Every published device is tainted: none can be claimed now."]
    first = _first_claimed(served, free)
    group, bus = _attribute(first, "iommuGroup"), _attribute(first, BUS_ID) or first["name"]
    claim = _claim(api, driver, "vm-a", "dev", first["name"])
    (prepared,) = (await asyncio.to_thread(kubelet.prepare, driver, [claim])).values()
    lines += ["", f"Claim default/vm-a (device {first['name']}, {bus}) prepared:"]
    if prepared.error:
        return [*lines, f"  refused: {prepared.error}"]
    lines += _prepared_lines(served, driver, claim, "dev", prepared)

    lines += ["", f"IOMMU group {group} is held whole, on both front ends:"]
    sibling = _sibling(served, group)
    if sibling is None:
        lines.append(f"  (no device-plugin device shares IOMMU group {group})")
    else:
        name, device_id = sibling
        what = f"Allocate({device_id} of {name}, in IOMMU group {group} with {bus})"
        try:
            await asyncio.to_thread(served.kubelet.allocate, name, [device_id])
            lines.append(f"  {what} was accepted (unexpected)")
        except grpc.RpcError as error:
            lines.append(f"  {what} -> {error.code().name}: {error.details()}")
    # A second claim on the group: a member of it, else two members of another one.
    same = [d for d in free if d is not first and _attribute(d, "iommuGroup") == group]
    pair = (first, same[0]) if same else _pair([d for d in free if d is not first])
    claims, second = [claim], None
    if pair is not None:
        if pair[0] is not first:
            one = _claim(api, driver, "vm-b", "dev", pair[0]["name"])
            (reply,) = (await asyncio.to_thread(kubelet.prepare, driver, [one])).values()
            members = _attribute(pair[0], "members")
            whole = f", the whole group: {members}" if members else ""
            lines.append(f"  claim vm-b ({pair[0]['name']}{whole}): {reply.error or 'prepared'}")
            claims.append(one)
        second = _claim(api, driver, "vm-c", "dev", pair[1]["name"])
        (reply,) = (await asyncio.to_thread(kubelet.prepare, driver, [second])).values()
        lines.append(
            f"  claim vm-c ({pair[1]['name']}, same group as {claims[-1].name}): "
            f"{reply.error or 'prepared (unexpected)'}"
        )

    await asyncio.to_thread(kubelet.unprepare, driver, claims)
    held = " and ".join(c.name for c in claims)
    lines += ["", f"NodeUnprepareResources of {held} frees the groups at once:"]
    if sibling is not None:
        name, device_id = sibling
        await asyncio.to_thread(
            served.kubelet.wait_for,
            lambda e: e.resources()[name].devices[device_id].healthy,
            5.0,
        )
        response = await asyncio.to_thread(served.kubelet.allocate, name, [device_id])
        nodes = ", ".join(d.host_path for d in response.devices)
        lines.append(f"  Allocate({device_id} of {name}) -> {nodes}")
    if second is not None:
        (reply,) = (await asyncio.to_thread(kubelet.prepare, driver, [second])).values()
        lines.append(f"  claim vm-c: {reply.error or 'prepared'}")
    if sibling is None and second is None:
        lines.append(f"  IOMMU group {group} is free for the next claim")
    return lines
