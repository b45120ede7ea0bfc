"""Extended resources served through DRA (KEP-5004), end to end, as KubeVirt uses them.

A KubeVirt launcher pod asks `resources.limits: {<resource>: N}`; on a node
whose allocatable for the name is 0 while a DeviceClass names it (the
classes `dp-server device-classes` writes), the API-server emulator's
scheduler makes the pod's claim and request mappings as the 1.36 scheduler
does, dp prepares the claim, and the DRA kubelet emulator hands each
container the CDI devices of its mapped requests. What virt-launcher reads
is then resolved from dp's spec files by the independent CDI reader: the
VFIO nodes, and `PCI_RESOURCE_<NAME>` / `MDEV_PCI_RESOURCE_<NAME>` naming
the container's devices.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dp_core.dra.deviceclasses import device_classes
from dp_server.cli.deviceclasses import render
from dp_server.cli.main import load_settings
from dp_server.config.loader import parse_config
from dp_server.runtime.runtime import Runtime
from dp_testing.apiserver import Scheduler
from dp_testing.dra_kubelet import Claim
from tests.cdi_reader import Edits, read_dir, resolve
from tests.test_dra_e2e import DRIVER, NODE, Dra, until

T4 = "nvidia.com/TU104GL_Tesla_T4"
VGPU = "nvidia.com/GRID_RTX6000-4Q"
AUDIO = "nvidia.com/TU104_HDA"
NVME = "devices.kubevirt.io/nvme"
CONFIG = f"""
dra:
  driverName: {DRIVER}
permittedHostDevices:
  pciHostDevices:
    - pciVendorSelector: "10DE:1EB8"
      resourceName: {T4}
      frontend: dra
    - pciVendorSelector: "10DE:10F8"
      resourceName: {AUDIO}
    - pciVendorSelector: "144D:A808"
      resourceName: {NVME}
  mediatedDevices:
    - mdevNameSelector: "GRID RTX6000-4Q"
      resourceName: {VGPU}
      frontend: dra
"""
VGPUS = {"4b20d080-1b54-4048-85b3-a6a62d165c01", "9d9bfc6e-2f41-4a34-a2d4-3a0c9e0b7d02"}


class Cluster:
    """The fixture node under dp, the emulated scheduler, and dp's DeviceClasses applied."""

    def __init__(self, dra: Dra, scheduler: Scheduler) -> None:
        self.dra = dra
        self.scheduler = scheduler

    def apply_device_classes(self, config: str = CONFIG) -> list[dict[str, Any]]:
        """What `kubectl apply -f <(dp-server device-classes ...)` creates."""
        classes, problems = device_classes(parse_config(config, "<test>"))
        assert problems == ()
        objects = list(yaml.safe_load_all(render(classes)))
        for obj in objects:
            self.dra.api.store.create("deviceclasses", "", obj)
        return objects

    def report_allocatable(self) -> None:
        """The kubelet's node status: each device-plugin resource's healthy devices."""
        assert self.dra.harness.emulator is not None
        self.dra.api.set_allocatable(NODE, self.dra.harness.emulator.allocatable())

    def launcher_pod(self, name: str, containers: dict[str, dict[str, int]]) -> dict[str, Any]:
        """A pod as virt-controller writes one: limits only, per container."""
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "containers": [
                    {
                        "name": container,
                        "image": "virt-launcher",
                        "resources": {"limits": {k: str(v) for k, v in limits.items()}},
                    }
                    for container, limits in containers.items()
                ]
            },
        }
        created = self.dra.api.store.create("pods", "default", pod)
        self.scheduler.schedule("default", name, NODE)
        return created

    async def bound(self, name: str) -> dict[str, Any]:
        return await self.bound_within(name, 10.0)

    async def bound_within(self, name: str, timeout: float) -> dict[str, Any]:
        await until(lambda: bool(self.pod(name)["spec"].get("nodeName")), timeout)
        return self.pod(name)

    def pod(self, name: str) -> dict[str, Any]:
        return self.dra.api.store.get("pods", "default", name)

    async def run(self, name: str) -> dict[str, Edits]:
        """What the kubelet does for a bound pod: prepare its claim, then give
        each container its CDI devices, resolved as a runtime would."""
        pod = self.pod(name)
        status = pod["status"]["extendedResourceClaimStatus"]
        claim = self.dra.api.store.get("resourceclaims", "default", status["resourceClaimName"])
        ref = Claim("default", claim["metadata"]["uid"], claim["metadata"]["name"])
        (result,) = (await self.dra.prepare(ref)).values()
        assert result.error == ""
        specs = read_dir(self.dra.cdi)
        given = self.dra.kubelet.container_cdi_devices(pod)
        return {
            container: sum((resolve(specs, cdi_id) for cdi_id in ids), Edits())
            for container, ids in given.items()
        }


def environment(edits: Edits) -> dict[str, str]:
    """The container's variables after the runtime applied every edit in order:
    a later `NAME=` replaces an earlier one, as the CDI library's editor does."""
    env: dict[str, str] = {}
    for entry in edits.env:
        key, _, value = entry.partition("=")
        env[key] = value
    return env


def groups(edits: Edits) -> set[str]:
    return {n.path for n in edits.device_nodes}


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    dra = Dra()
    dra.harness.start_kubelet()
    dra.kubelet.start()
    scheduler = Scheduler(dra.api)
    try:
        await dra.start_api()
        await dra.start_server(CONFIG)
        await dra.registered()
        await until(lambda: len(dra.pool()) > 0)
        yield Cluster(dra, scheduler)
    finally:
        scheduler.close()
        await dra.close()


def t4_addresses(dra: Dra) -> dict[str, str]:
    """The node's healthy T4s in the pool: device name -> PCI address."""
    found = {}
    for s in dra.api.slices():
        for device in s["spec"].get("devices") or ():
            attributes = device.get("attributes") or {}
            if (attributes.get("resourceName") or {}).get("string") == T4:
                found[device["name"]] = attributes["resource.kubernetes.io/pciBusID"]["string"]
    return found


async def test_a_launcher_pod_asking_by_limits_gets_what_virt_launcher_reads(
    cluster: Cluster,
) -> None:
    dra = cluster.dra
    cluster.apply_device_classes()
    cluster.report_allocatable()
    await until(lambda: len(t4_addresses(dra)) >= 2)
    cluster.launcher_pod("virt-launcher-vm-a-x7k2p", {"compute": {T4: 2, VGPU: 1}})
    pod = await cluster.bound("virt-launcher-vm-a-x7k2p")

    # The scheduler's claim, as 1.36 makes it.
    status = pod["status"]["extendedResourceClaimStatus"]
    name = status["resourceClaimName"]
    assert name.startswith("virt-launcher-vm-a-x7k2p-extended-resources-")
    claim = dra.api.store.get("resourceclaims", "default", name)
    assert claim["metadata"]["annotations"] == {
        "resource.kubernetes.io/extended-resource-claim": "true"
    }
    (owner,) = claim["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "Pod",
        pod["metadata"]["name"],
        pod["metadata"]["uid"],
        True,
    )
    # Sorted resource names: GRID_RTX6000-4Q is j=0, TU104GL_Tesla_T4 j=1.
    assert sorted(status["requestMappings"], key=lambda m: m["requestName"]) == [
        {"containerName": "compute", "resourceName": VGPU, "requestName": "container-0-request-0"},
        {"containerName": "compute", "resourceName": T4, "requestName": "container-0-request-1"},
    ]

    edits = (await cluster.run("virt-launcher-vm-a-x7k2p"))["compute"]
    results = claim_results(dra, name)
    t4s = [d for r, d in results if r == "container-0-request-1"]
    addresses = [t4_addresses(dra)[d] for d in t4s]
    env = environment(edits)
    # One variable per resource, every device of the request, in allocation order.
    assert env["PCI_RESOURCE_NVIDIA_COM_TU104GL_TESLA_T4"] == ",".join(addresses)
    assert len(addresses) == 2
    (vgpu,) = env["MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_RTX6000-4Q"].split(",")
    assert vgpu in VGPUS
    assert set(env) == {
        "PCI_RESOURCE_NVIDIA_COM_TU104GL_TESLA_T4",
        "MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_RTX6000-4Q",
    }
    # The VFIO nodes Allocate gives: the container node, and each device's group.
    assert "/dev/vfio/vfio" in groups(edits)
    assert len(groups(edits) - {"/dev/vfio/vfio"}) == 3


def claim_results(dra: Dra, name: str) -> list[tuple[str, str]]:
    claim = dra.api.store.get("resourceclaims", "default", name)
    return [
        (r["request"], r["device"]) for r in claim["status"]["allocation"]["devices"]["results"]
    ]


async def test_each_container_gets_the_variable_of_its_own_requests_only(
    cluster: Cluster,
) -> None:
    dra = cluster.dra
    cluster.apply_device_classes()
    cluster.report_allocatable()
    await until(lambda: len(t4_addresses(dra)) >= 2)
    cluster.launcher_pod("two", {"compute": {T4: 1}, "sidecar": {T4: 1, VGPU: 1}})
    pod = await cluster.bound("two")
    name = pod["status"]["extendedResourceClaimStatus"]["resourceClaimName"]
    by_request = dict(claim_results(dra, name))
    address = t4_addresses(dra)

    containers = await cluster.run("two")
    compute, sidecar = (environment(containers[c]) for c in ("compute", "sidecar"))
    assert compute == {
        "PCI_RESOURCE_NVIDIA_COM_TU104GL_TESLA_T4": address[by_request["container-0-request-0"]]
    }
    assert (
        sidecar["PCI_RESOURCE_NVIDIA_COM_TU104GL_TESLA_T4"]
        == (address[by_request["container-1-request-1"]])
    )
    assert sidecar["MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_RTX6000-4Q"] in VGPUS
    assert (
        compute["PCI_RESOURCE_NVIDIA_COM_TU104GL_TESLA_T4"]
        != (sidecar["PCI_RESOURCE_NVIDIA_COM_TU104GL_TESLA_T4"])
    )


async def test_an_ordinary_claim_gets_the_vfio_nodes_and_no_variable(cluster: Cluster) -> None:
    """KubeVirt's DRA path reads a device's address from the KEP-5304
    metadata, and no resource name belongs to an ordinary claim's request."""
    dra = cluster.dra
    await until(lambda: len(t4_addresses(dra)) >= 1)
    device = sorted(t4_addresses(dra))[0]
    claim = dra.claim("vm-gpu", ("gpu", device))
    (result,) = (await dra.prepare(claim)).values()
    assert result.error == ""
    specs = read_dir(dra.cdi)
    edits = sum((resolve(specs, i) for d in result.devices for i in d.cdi_device_ids), Edits())
    assert edits.env == ()
    assert "/dev/vfio/vfio" in groups(edits)


async def test_a_pod_whose_owner_status_is_missing_is_refused_naming_the_pod(
    cluster: Cluster,
) -> None:
    """A claim annotated as the scheduler's whose pod has no mapping for it
    (its status lost, or another pod's claim) is refused, and holds nothing."""
    dra = cluster.dra
    cluster.apply_device_classes()
    cluster.report_allocatable()
    await until(lambda: len(t4_addresses(dra)) >= 1)
    cluster.launcher_pod("lost", {"compute": {T4: 1}})
    pod = await cluster.bound("lost")
    name = pod["status"]["extendedResourceClaimStatus"]["resourceClaimName"]
    pod["status"]["extendedResourceClaimStatus"]["resourceClaimName"] = "another"
    dra.api.store.update("pods", "default", "lost", pod, status=True)
    claim = dra.api.store.get("resourceclaims", "default", name)
    ref = Claim("default", claim["metadata"]["uid"], name)
    (result,) = (await dra.prepare(ref)).values()
    assert "pod default/lost" in result.error
    assert "'another'" in result.error
    assert not list(dra.cdi.glob(f"{DRIVER}_claim_*"))


async def test_the_device_plugin_serves_where_the_node_offers_the_name(cluster: Cluster) -> None:
    """The node rule: a class names the audio function too, but the node has
    it allocatable through the device plugin, so no claim is made for it."""
    dra = cluster.dra
    cluster.apply_device_classes(
        CONFIG.replace(f"resourceName: {AUDIO}", f"resourceName: {AUDIO}\n      frontend: dra")
    )
    cluster.report_allocatable()
    assert int(dra.api.store.get("nodes", "", NODE)["status"]["allocatable"][AUDIO]) > 0
    cluster.launcher_pod("audio", {"compute": {AUDIO: 1}})
    pod = await cluster.bound("audio")
    assert "extendedResourceClaimStatus" not in (pod.get("status") or {})
    assert not [
        c
        for c in dra.api.store.objects("resourceclaims", "default")
        if c["metadata"]["name"].startswith("audio-")
    ]
    # A name neither the node nor a class serves: the pod does not fit, and waits.
    cluster.launcher_pod("nothing", {"compute": {"example.com/none": 1}})
    await until(lambda: ("default", "nothing") in cluster.scheduler.unschedulable)
    assert cluster.scheduler.unschedulable[("default", "nothing")] == (
        "cannot fit resource example.com/none"
    )
    await asyncio.sleep(0)


# -- a live node moving its NVMe pair from the device plugin to DRA ------------------------

NVME_ON_DP = CONFIG
NVME_ON_DRA = CONFIG.replace(
    f"resourceName: {NVME}\n", f"resourceName: {NVME}\n      frontend: dra\n"
)
NVME_A, NVME_B = "pci-0000-5e-00-0", "pci-0000-5e-01-0"  # both in IOMMU group 93


def fields(caplog: pytest.LogCaptureFixture, event: str) -> list[dict[str, object]]:
    return [dict(getattr(r, "dp_fields", {})) for r in caplog.records if r.getMessage() == event]


@pytest.fixture
async def moving(tmp_path: Path) -> AsyncIterator[tuple[Cluster, Path]]:
    """The cluster, with dp serving a config file it watches, as `serve --config` does."""
    dra = Dra()
    dra.harness.start_kubelet()
    dra.kubelet.start()
    scheduler = Scheduler(dra.api)
    path = dra.harness.root / "config.yaml"
    path.write_text(NVME_ON_DP)
    try:
        await dra.start_api()
        settings = dra.harness.settings(
            cdi_spec_dir=str(dra.cdi),
            state_dir=str(dra.state),
            node_name=NODE,
            plugins_registry_dir=str(dra.registry),
            plugins_dir=str(dra.plugins),
            kube_api_server=f"http://127.0.0.1:{dra.port}",
            slice_watch_period=(0.5, 1.0),
            config_path=str(path),
        )
        config, _ = load_settings(str(path))
        dra.runtime = Runtime(settings, config, reload=lambda: load_settings(str(path)))
        dra._serving = asyncio.create_task(dra.runtime.run())
        await asyncio.wait_for(dra.runtime.ready.wait(), 5)
        await dra.registered()
        yield Cluster(dra, scheduler), path
    finally:
        scheduler.close()
        await dra.close()


async def test_moving_a_held_pair_to_dra_never_serves_the_name_twice_and_waits_for_the_holder(
    moving: tuple[Cluster, Path], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="dp")
    cluster, path = moving
    dra = cluster.dra
    harness = dra.harness
    assert await harness.wait(lambda e: e.allocatable().get(NVME) == 2)
    # A running VM holds one drive of group 93 through the device plugin.
    await harness.kubelet("admit", "virt-launcher-old", "compute", {NVME: 1})
    held = next(iter(harness.emulator.pods()["default/virt-launcher-old"].containers.values()))
    cluster.apply_device_classes(NVME_ON_DRA)

    path.write_text(NVME_ON_DRA)
    # One server at a time: the kubelet keeps the name, at 0 allocatable,
    # while the pool publishes both drives; the VM keeps its drive.
    assert await harness.wait(lambda e: e.allocatable().get(NVME) == 0, timeout=10)
    assert NVME in harness.emulator.resources()
    await until(lambda: {NVME_A, NVME_B} <= dra.pool())
    assert "default/virt-launcher-old" in harness.emulator.pods()
    (started_move,) = fields(caplog, "frontend-move-started")
    assert started_move["resource"] == NVME
    assert (started_move["from"], started_move["to"]) == ("device-plugin", "dra")
    assert started_move["held_groups"] == "93"
    assert fields(caplog, "frontend-move-finished") == []

    # A new VM asking by limits is served through DRA, and waits: the drive
    # left free shares the held group.
    cluster.report_allocatable()
    cluster.launcher_pod("virt-launcher-new", {"compute": {NVME: 1}})
    await until(lambda: ("default", "virt-launcher-new") in cluster.scheduler.unschedulable)
    assert not cluster.pod("virt-launcher-new")["spec"].get("nodeName")

    # The old VM goes: the group is let go, the move finishes, the new VM runs.
    await harness.kubelet("remove_pod", "virt-launcher-old")
    pod = await cluster.bound_within("virt-launcher-new", 15.0)
    assert (
        pod["status"]["extendedResourceClaimStatus"]["requestMappings"][0]["resourceName"] == NVME
    )
    (finished,) = fields(caplog, "frontend-move-finished")
    assert finished["resource"] == NVME
    edits = (await cluster.run("virt-launcher-new"))["compute"]
    assert set(environment(edits)) == {"PCI_RESOURCE_DEVICES_KUBEVIRT_IO_NVME"}
    assert "/dev/vfio/93" in groups(edits)
    assert held.devices  # the old VM had a drive of the same group all along


async def test_a_restarted_dp_answers_the_extended_claim_as_before(cluster: Cluster) -> None:
    dra = cluster.dra
    cluster.apply_device_classes()
    cluster.report_allocatable()
    await until(lambda: len(t4_addresses(dra)) >= 1)
    cluster.launcher_pod("kept", {"compute": {T4: 1}})
    pod = await cluster.bound("kept")
    before = await cluster.run("kept")
    name = pod["status"]["extendedResourceClaimStatus"]["resourceClaimName"]
    claim = dra.api.store.get("resourceclaims", "default", name)
    ref = Claim("default", claim["metadata"]["uid"], name)
    answer = (await dra.prepare(ref))[ref.uid]

    await dra.stop_server()
    # Meanwhile the pod's status is gone from the API: the claim is answered
    # from the checkpoint, with the variable it was prepared with.
    lost = cluster.pod("kept")
    lost["status"] = {}
    dra.api.store.update("pods", "default", "kept", lost, status=True)
    await dra.start_server(CONFIG)
    await dra.registered(2)
    assert (await dra.prepare(ref))[ref.uid] == answer
    checkpoint = json.loads((dra.state / "claims.json").read_text())
    (kept,) = checkpoint["claims"]
    assert kept["extended_resources"] == [["container-0-request-0", T4]]
    specs = read_dir(dra.cdi)
    after = sum((resolve(specs, i) for d in answer.devices for i in d.cdi_device_ids), Edits())
    assert environment(after) == environment(before["compute"])
