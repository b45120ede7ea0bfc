"""`serve` as a DRA driver beside the device-plugin front end, end to end.

The fixture node's T4 GPUs and its NVMe pair (one IOMMU group, 93) are
`frontend: dra`; the GPUs' audio functions stay on the device-plugin front
end, so a GPU claim and an audio Allocate meet in IOMMU group 59. The runtime
is served to the grpcio device-plugin kubelet emulator, the grpcio DRA
kubelet emulator and the API-server emulator, which validates every object
dp writes against resource.k8s.io/v1's schema.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import httpx2
import pytest

from dp_core import DevicePluginFrontend
from dp_server.cli.main import main
from dp_server.config.loader import parse_config
from dp_server.monitoring.probes import runtime_families, runtime_readiness
from dp_server.runtime.runtime import Runtime
from dp_testing.apiserver import ApiServerEmulator, Device, Scheduler
from dp_testing.dra_kubelet import Claim, DraCallError, DraKubeletEmulator, PrepareResult
from tests.cdi_reader import read_spec, resolve
from tests.e2e_harness import Harness

SCHEMA = Path(__file__).parent / "data" / "k8s" / "resource.k8s.io-v1.schema.json"
DRIVER = "vfio.dp.example.com"
NODE = "node-a"
AUDIO = "nvidia.com/TU104_HDA"
GPU_A = "pci-0000-3b-00-0"  # group 59, with the audio function 0000:3b:00.1
NVME_A, NVME_B = "pci-0000-5e-00-0", "pci-0000-5e-01-0"  # both in group 93
CONFIG = f"""
dra:
  driverName: {DRIVER}
permittedHostDevices:
  pciHostDevices:
    - pciVendorSelector: "10DE:1EB8"
      resourceName: nvidia.com/TU104GL_Tesla_T4
      frontend: dra
    - pciVendorSelector: "10DE:10F8"
      resourceName: {AUDIO}
    - pciVendorSelector: "144D:A808"
      resourceName: devices.kubevirt.io/nvme
      frontend: dra
"""


async def until(check: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.02)


class Dra:
    """The fixture node served by one runtime to the three emulators."""

    def __init__(self) -> None:
        self.harness = Harness()
        root = self.harness.root
        self.cdi = root / "cdi"
        self.cdi.mkdir()
        self.state = root / "state"
        self.registry = root / "reg"
        self.plugins = root / "plugins"
        self.api = ApiServerEmulator(schema=SCHEMA)
        self.kubelet = DraKubeletEmulator(self.registry)
        self.runtime: Runtime | None = None
        self._serving: asyncio.Task[None] | None = None
        self.port = 0

    async def start_api(self) -> None:
        await self.api.start(self.port or None)
        self.port = self.api.port
        if not self.api.store.objects("nodes"):
            self.api.add_node(NODE)

    async def start_server(self, config: str = CONFIG, **overrides: Any) -> Runtime:
        settings = self.harness.settings(
            cdi_spec_dir=str(overrides.pop("cdi_spec_dir", self.cdi)),
            state_dir=str(self.state),
            node_name=NODE,
            plugins_registry_dir=str(self.registry),
            plugins_dir=str(self.plugins),
            kube_api_server=f"http://127.0.0.1:{self.port}",
            slice_watch_period=(0.5, 1.0),
            **overrides,
        )
        self.runtime = Runtime(settings, parse_config(config, "<dra>"))
        self._serving = asyncio.create_task(self.runtime.run())
        await asyncio.wait_for(self.runtime.ready.wait(), 5)
        names = self.runtime.node.frontend(DevicePluginFrontend).resource_names()
        assert await self.harness.registered(names)
        return self.runtime

    async def stop_server(self) -> None:
        assert self.runtime is not None and self._serving is not None
        self.runtime.stop()
        await asyncio.wait_for(self._serving, 10)
        self.runtime = self._serving = None

    async def registered(self, count: int = 1) -> None:
        await asyncio.to_thread(self.kubelet.wait_for, "registered", DRIVER, count=count)

    def claim(self, name: str, *devices: tuple[str, str], pool: str = NODE) -> Claim:
        """A claim in the API server, allocated `devices` as (request, device)."""
        obj = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "devices": {
                    "requests": [
                        {"name": r, "exactly": {"deviceClassName": "vfio"}} for r, _ in devices
                    ]
                }
            },
            "status": {
                "allocation": {
                    "devices": {
                        "results": [
                            {"request": r, "driver": DRIVER, "pool": pool, "device": d}
                            for r, d in devices
                        ]
                    }
                }
            },
        }
        created = self.api.store.create("resourceclaims", "default", obj)
        return Claim("default", created["metadata"]["uid"], name)

    async def prepare(self, *claims: Claim) -> dict[str, PrepareResult]:
        return await asyncio.to_thread(self.kubelet.prepare, DRIVER, claims)

    async def unprepare(self, *claims: Claim) -> dict[str, str]:
        return await asyncio.to_thread(self.kubelet.unprepare, DRIVER, claims)

    def pool(self) -> set[str]:
        """The device names of the node's newest complete pool generation on the server."""
        ours = [s for s in self.api.slices() if s["spec"].get("nodeName") == NODE]
        if not ours:
            return set()
        top = max(s["spec"]["pool"]["generation"] for s in ours)
        current = [s for s in ours if s["spec"]["pool"]["generation"] == top]
        if len(current) != current[0]["spec"]["pool"]["resourceSliceCount"]:
            return set()
        return {d["name"] for s in current for d in s["spec"].get("devices") or ()}

    async def close(self) -> None:
        if self.runtime is not None:
            await self.stop_server()
        await asyncio.to_thread(self.kubelet.stop)
        await self.api.stop()
        await self.harness.close()
        assert self.api.rejected == [], "dp wrote an object the API server would refuse"


@pytest.fixture
async def dra() -> AsyncIterator[Dra]:
    setup = Dra()
    setup.harness.start_kubelet()
    setup.kubelet.start()
    try:
        yield setup
    finally:
        await setup.close()


async def serving(dra: Dra) -> Runtime:
    await dra.start_api()
    runtime = await dra.start_server()
    await dra.registered()
    await until(lambda: {GPU_A, NVME_A, NVME_B} <= dra.pool())
    # The kubelet's NotifyRegistrationStatus counts toward readiness.
    await until(lambda: runtime_readiness(runtime).ok)
    assert DRIVER in runtime_readiness(runtime).detail
    return runtime


async def test_slices_a_prepared_claim_its_files_and_the_ledger_shared_with_allocate(
    dra: Dra,
) -> None:
    await serving(dra)
    before = dra.pool()
    slices = [s for s in dra.api.slices() if s["spec"].get("nodeName") == NODE]
    counters = {c["name"] for s in slices for c in s["spec"].get("sharedCounters") or ()}
    assert "iommu-group-93" in counters  # the NVMe pair can never go to two claims
    assert all(s["spec"]["driver"] == DRIVER and s["spec"]["pool"]["name"] == NODE for s in slices)

    gpu = dra.claim("vm-gpu", ("gpu", GPU_A))
    (result,) = (await dra.prepare(gpu)).values()
    assert result.error == ""
    (device,) = result.devices
    assert (device.pool_name, device.device_name) == (NODE, GPU_A)
    claim_id = f"{DRIVER}/claim={gpu.uid}-{GPU_A}"
    meta_id = f"{DRIVER}/metadata={gpu.uid}_gpu"
    assert device.cdi_device_ids == (claim_id, meta_id)
    # The independent reader resolves the claim's device to Allocate's VFIO nodes.
    spec_file = dra.cdi / f"{DRIVER}_claim_{gpu.uid}.json"
    edits = resolve([read_spec(spec_file.read_bytes(), str(spec_file))], claim_id)
    assert {(n.path, n.permissions) for n in edits.device_nodes} == {
        ("/dev/vfio/vfio", "mrw"),
        ("/dev/vfio/59", "mrw"),
    }
    # KEP-5304: the metadata stream, newest version first, mounted by its own spec.
    host = dra.plugins / DRIVER / "dra-device-metadata" / "default_vm-gpu" / "gpu" / "metadata.json"
    objects = [json.loads(line) for line in host.read_text().splitlines()]
    assert [o["apiVersion"] for o in objects] == [
        "metadata.resource.k8s.io/v1beta1",
        "metadata.resource.k8s.io/v1alpha1",
    ]
    (request,) = objects[1]["requests"]
    (meta_device,) = request["devices"]
    assert meta_device["attributes"]["resource.kubernetes.io/pciBusID"] == {
        "string": "0000:3b:00.0"
    }
    meta_spec = json.loads((dra.cdi / f"{DRIVER}_metadata_{gpu.uid}_gpu.json").read_text())
    assert meta_spec["kind"] == f"{DRIVER}/metadata"
    (mount,) = meta_spec["devices"][0]["containerEdits"]["mounts"]
    assert mount["hostPath"] == str(host)
    assert mount["containerPath"] == (
        f"/var/run/kubernetes.io/dra-device-attributes/resourceclaims/vm-gpu/gpu/{DRIVER}-metadata.json"
    )
    # Prepared again: the same answer.
    assert (await dra.prepare(gpu))[gpu.uid] == result

    # The claim holds group 59: the audio function is refused on the device-plugin side.
    await dra.harness.wait(lambda e: not e.resources()[AUDIO].devices["0000:3b:00.1"].healthy)
    with pytest.raises(grpc.RpcError) as refused:
        await dra.harness.kubelet("allocate", AUDIO, ["0000:3b:00.1"])
    assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "59" in str(refused.value.details())
    assert "vm-gpu" in str(refused.value.details())

    # Two NVMe drives of one group in two claims: the second is refused, by name.
    nvme_a = dra.claim("nvme-a", ("disk", NVME_A))
    nvme_b = dra.claim("nvme-b", ("disk", NVME_B))
    replies = await dra.prepare(nvme_a, nvme_b)
    assert replies[nvme_a.uid].error == ""
    assert "IOMMU group 93" in replies[nvme_b.uid].error
    assert "default/nvme-a" in replies[nvme_b.uid].error
    assert not (dra.cdi / f"{DRIVER}_claim_{nvme_b.uid}.json").exists()

    # A device the node does not offer, another node's pool: each claim's own error.
    unknown = dra.claim("unknown", ("gpu", "pci-0000-ff-00-0"))
    elsewhere = dra.claim("elsewhere", ("gpu", GPU_A), pool="node-b")
    replies = await dra.prepare(unknown, elsewhere)
    assert "pci-0000-ff-00-0" in replies[unknown.uid].error
    assert "not offered" in replies[unknown.uid].error
    assert "node-b" in replies[elsewhere.uid].error

    # Unprepare frees the groups at once: the audio function is Healthy again,
    # the files are gone, and the pool holds what it held before.
    assert await dra.unprepare(gpu, nvme_a) == {gpu.uid: "", nvme_a.uid: ""}
    await dra.harness.wait(lambda e: e.resources()[AUDIO].devices["0000:3b:00.1"].healthy)
    await dra.harness.kubelet("allocate", AUDIO, ["0000:3b:00.1"])
    assert not spec_file.exists() and not host.exists()
    assert list(dra.cdi.glob(f"{DRIVER}_*")) == []
    await until(lambda: dra.pool() == before)
    assert (await dra.prepare(nvme_b))[nvme_b.uid].error == ""
    # Unprepared again: nothing to do, no error.
    assert await dra.unprepare(gpu) == {gpu.uid: ""}


async def test_a_restarted_dp_recalls_its_claims_and_releases_one_deleted_from_the_api(
    dra: Dra,
) -> None:
    await serving(dra)
    nvme_a = dra.claim("nvme-a", ("disk", NVME_A))
    assert (await dra.prepare(nvme_a))[nvme_a.uid].error == ""
    checkpoint = json.loads((dra.state / "claims.json").read_text())
    assert [c["claim"]["uid"] for c in checkpoint["claims"]] == [nvme_a.uid]

    await dra.stop_server()
    # Left in place for containers still being created, and for the next run.
    assert (dra.cdi / f"{DRIVER}_claim_{nvme_a.uid}.json").exists()
    dra.api.store.delete("resourceclaims", "default", "nvme-a")
    await dra.start_server()
    await dra.registered(count=2)

    nvme_b = dra.claim("nvme-b", ("disk", NVME_B))
    assert "default/nvme-a" in (await dra.prepare(nvme_b))[nvme_b.uid].error
    assert await dra.unprepare(nvme_a) == {nvme_a.uid: ""}
    assert not (dra.cdi / f"{DRIVER}_claim_{nvme_a.uid}.json").exists()
    assert (await dra.prepare(nvme_b))[nvme_b.uid].error == ""


def _claim_with_status(dra: Dra, name: str, status: Any) -> Claim:
    """A claim in the API server whose status is `status`, as written by whoever wrote it."""
    obj = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "v"}}]}},
        "status": status,
    }
    created = dra.api.store.create("resourceclaims", "default", obj)
    return Claim("default", created["metadata"]["uid"], name)


def reads_waiting(runtime: Runtime) -> float:
    """What the core says of the Prepare calls waiting for their claim's read."""
    families = {f.name: f for f in runtime_families(runtime)}
    (sample,) = families["dp_dra_claim_reads_waiting"].samples
    return sample.value


def refusals_logged(caplog: pytest.LogCaptureFixture) -> dict[str, str]:
    """The reason of each claim-refused line, by claim UID."""
    return {
        r.dp_fields["uid"]: r.dp_fields["reason"]  # type: ignore[attr-defined]
        for r in caplog.records
        if r.getMessage() == "claim-refused"
    }


async def test_a_claim_with_a_malformed_status_fails_alone_and_releases_nothing(
    dra: Dra, caplog: pytest.LogCaptureFixture
) -> None:
    """Each malformed claim gets its own error naming what is wrong; the good
    claim in the same request is prepared, and a group held before stays held."""
    caplog.set_level(logging.INFO, logger="dp")
    await serving(dra)
    held = dra.claim("nvme-a", ("disk", NVME_A))
    assert (await dra.prepare(held))[held.uid].error == ""
    no_device = _claim_with_status(
        dra,
        "no-device",
        {"allocation": {"devices": {"results": [{"request": "gpu", "driver": DRIVER}]}}},
    )
    not_a_list = _claim_with_status(
        dra, "not-a-list", {"allocation": {"devices": {"results": "all of them"}}}
    )
    unallocated = _claim_with_status(dra, "unallocated", {})
    good = dra.claim("vm-gpu", ("gpu", GPU_A))
    results = await dra.prepare(no_device, not_a_list, unallocated, good)
    # lightkube's models read the claim, and name the field that is wrong.
    assert "missing required field `device`" in results[no_device.uid].error
    assert "status.allocation.devices.results[0]" in results[no_device.uid].error
    assert "default/not-a-list" in results[not_a_list.uid].error
    assert "no status.allocation.devices.results" in results[unallocated.uid].error
    assert results[good.uid].error == "" and results[good.uid].devices
    # Refused by the core, as any claim is (claim-refused), with the shell's
    # reason as it stands; and no Event: a claim that could not be read may
    # be gone, or another claim of that name by now.
    refusals = refusals_logged(caplog)
    for claim in (no_device, not_a_list, unallocated):
        assert refusals[claim.uid] == results[claim.uid].error
    await asyncio.sleep(0.2)
    assert dra.api.store.objects("events", "default") == []
    # Nothing held was let go: the NVMe pair's group is still the first claim's.
    nvme_b = dra.claim("nvme-b", ("disk", NVME_B))
    assert "default/nvme-a" in (await dra.prepare(nvme_b))[nvme_b.uid].error


async def test_a_claim_whose_cdi_directory_cannot_be_written_fails_and_holds_nothing(
    dra: Dra,
) -> None:
    await dra.start_api()
    await dra.start_server(cdi_spec_dir=dra.harness.root / "no-such-dir")
    await dra.registered()
    gpu = dra.claim("vm-gpu", ("gpu", GPU_A))
    error = (await dra.prepare(gpu))[gpu.uid].error
    assert "could not be written" in error and "no-such-dir" in error
    # Nothing stays held: the audio function can be allocated.
    await dra.harness.kubelet("allocate", AUDIO, ["0000:3b:00.1"])
    assert json.loads((dra.state / "claims.json").read_text())["claims"] == []


async def test_the_api_server_down_at_start_holds_up_nothing_and_gets_its_slices_later(
    dra: Dra,
) -> None:
    with socket.socket() as probe:  # a port nothing listens on, for now
        probe.bind(("127.0.0.1", 0))
        dra.port = probe.getsockname()[1]
    await dra.start_server()  # the device-plugin resources register meanwhile
    await dra.registered()
    response = await dra.harness.kubelet("allocate", AUDIO, ["0000:af:00.1"])
    assert "/dev/vfio/175" in {d.host_path for d in response.devices}
    gpu = dra.claim("vm-gpu", ("gpu", GPU_A))
    error = (await dra.prepare(gpu))[gpu.uid].error
    assert "cannot read claim default/vm-gpu" in error
    await dra.start_api()
    await until(lambda: {GPU_A, NVME_A, NVME_B} <= dra.pool(), timeout=15)
    assert (await dra.prepare(gpu))[gpu.uid].error == ""


async def test_a_prepare_the_kubelet_gives_up_on_while_its_claims_are_read_leaves_nothing_waiting(
    dra: Dra, caplog: pytest.LogCaptureFixture
) -> None:
    """The kubelet's NodePrepareResources has a deadline, which a slow API
    server can outlast. The node asked for the claims to be read; the call's
    end ends those waits too (nobody would ever hand the reads back), and
    the kubelet's next call prepares the claims."""
    caplog.set_level(logging.INFO, logger="dp")
    runtime = await serving(dra)
    claims = [dra.claim("vm-gpu", ("gpu", GPU_A)), dra.claim("nvme-a", ("disk", NVME_A))]
    timeout, dra.kubelet.call_timeout = dra.kubelet.call_timeout, 1.0
    dra.api.delay = 3.0  # before every answer
    prepare = asyncio.create_task(dra.prepare(*claims))
    await until(lambda: reads_waiting(runtime) == 2)
    with pytest.raises(DraCallError) as gave_up:
        await prepare
    assert gave_up.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    await until(lambda: reads_waiting(runtime) == 0)
    refusals = refusals_logged(caplog)
    for claim in claims:
        assert refusals[claim.uid] == (
            f"cannot read claim default/{claim.name} (UID {claim.uid}): "
            "the call was cancelled while it was read"
        )
    assert not (dra.state / "claims.json").exists()  # nothing was prepared
    dra.api.delay, dra.kubelet.call_timeout = 0.0, timeout
    replies = await dra.prepare(*claims)
    assert [replies[c.uid].error for c in claims] == ["", ""]
    assert reads_waiting(runtime) == 0
    await asyncio.sleep(0.2)
    assert dra.api.store.objects("events", "default") == []  # none for a claim never read


async def test_readiness_waits_for_the_kubelet_to_register_the_driver(dra: Dra) -> None:
    await dra.start_api()
    dra.kubelet.stop()  # no plugin watcher: nobody registers the driver
    runtime = await dra.start_server()
    check = runtime_readiness(runtime)
    assert not check.ok
    assert f"DRA driver {DRIVER} not registered" in check.detail
    await until(lambda: dra.pool() != set())
    families = {f.name: f for f in runtime_families(runtime)}
    (created,) = [
        s
        for s in families["dp_kube_api_requests_total"].samples
        if dict(s.labels) == {"verb": "create", "resource": "resourceslices"}
    ]
    assert created.value >= 1
    assert families["dp_dra_registered"].samples[0].value == 0


def test_a_config_with_dra_and_no_node_name_is_a_startup_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("NODE_NAME", raising=False)
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG)
    code = main(
        ["serve", "--config", str(config), "--sysfs", str(tmp_path), "--dev", str(tmp_path)]
    )
    assert code == 2
    error = capsys.readouterr().err
    assert "--node-name" in error and "NODE_NAME" in error


# -- what the cluster keeps: partitionable devices and device taints ----------------------

PARTITIONABLE = "DRAPartitionableDevices"
UNHEALTHY_GPU = "pci-0000-d8-00-0"
TAINTS = "DRADeviceTaints"


def our_slices(dra: Dra) -> list[dict[str, Any]]:
    return [s for s in dra.api.slices() if s["spec"].get("nodeName") == NODE]


def counters_in(slices: list[dict[str, Any]]) -> bool:
    return any(
        s["spec"].get("sharedCounters")
        or any(d.get("consumesCounters") for d in s["spec"].get("devices") or ())
        for s in slices
    )


def taints_of(dra: Dra, device: str) -> list[str]:
    return [
        t["key"]
        for s in our_slices(dra)
        for d in s["spec"].get("devices") or ()
        if d["name"] == device
        for t in d.get("taints") or ()
    ]


def feature_gauge(runtime: Runtime) -> dict[str, float]:
    families = {f.name: f for f in runtime_families(runtime)}
    return {dict(s.labels)["feature"]: s.value for s in families["dp_dra_api_feature"].samples}


async def writes_settle(dra: Dra, quiet: float = 1.0) -> None:
    """Wait until the publisher stops writing: what the server cannot keep is not rewritten."""
    async with asyncio.timeout(10):
        while True:
            before = dra.api.writes
            await asyncio.sleep(quiet)
            if dra.api.writes == before:
                return


def details(caplog: pytest.LogCaptureFixture, event: str) -> list[str]:
    return [
        str(getattr(r, "dp_fields", {}).get("detail"))
        for r in caplog.records
        if r.getMessage() == event
    ]


async def test_a_cluster_without_partitionable_devices_or_taints_gets_what_it_can_keep(
    dra: Dra, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="dp")
    dra.api.disabled_features = frozenset({PARTITIONABLE, TAINTS})
    await dra.start_api()
    runtime = await dra.start_server()
    await dra.registered()
    # The first write shows the counters dropped: one NVMe of group 93 is
    # published; and the taint of the fixture's unhealthy GPU (0000:d8:00.0,
    # its group not viable) dropped: that GPU is left out.
    await until(lambda: GPU_A in dra.pool() and len(dra.pool() & {NVME_A, NVME_B}) == 1)
    await writes_settle(dra)
    assert not counters_in(our_slices(dra))
    assert len(dra.pool() & {NVME_A, NVME_B}) == 1
    assert UNHEALTHY_GPU not in dra.pool()
    missing = sorted(details(caplog, "dra-feature-missing"))
    assert len(missing) == 2, missing
    assert missing[0].startswith(
        "the API server dropped device taints (DRADeviceTaints is off): leaving unhealthy devices"
    )
    assert missing[1] == (
        "the API server dropped sharedCounters (DRAPartitionableDevices is off): "
        "publishing one device per multi-device IOMMU group"
    )
    assert feature_gauge(runtime) == {PARTITIONABLE: 0, TAINTS: 0}

    # GPU_A's group node goes: it leaves the pool, and nothing more is logged.
    (dra.harness.dev / "vfio" / "59").unlink()
    await until(lambda: GPU_A not in dra.pool())
    await writes_settle(dra)
    assert not any(taints_of(dra, name) for name in dra.pool())
    assert len(details(caplog, "dra-feature-missing")) == 2


async def test_a_cluster_with_both_features_keeps_counters_and_taints(dra: Dra) -> None:
    runtime = await serving(dra)
    assert counters_in(our_slices(dra)) and {NVME_A, NVME_B} <= dra.pool()
    assert taints_of(dra, UNHEALTHY_GPU) == [f"{DRIVER}/unhealthy"]
    (dra.harness.dev / "vfio" / "59").unlink()
    await until(lambda: taints_of(dra, GPU_A) == [f"{DRIVER}/unhealthy"])
    assert GPU_A in dra.pool()
    assert feature_gauge(runtime) == {PARTITIONABLE: 1, TAINTS: 1}


async def test_the_operator_overrides_what_the_api_server_shows(
    dra: Dra, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="dp")
    dra.api.disabled_features = frozenset({PARTITIONABLE})
    await dra.start_api()
    config = CONFIG.replace(
        f"driverName: {DRIVER}\n",
        f"driverName: {DRIVER}\n  partitionableDevices: true\n  deviceTaints: false\n",
    )
    await dra.start_server(config)
    await dra.registered()
    # partitionableDevices: true: both NVMe drives stay, though the server drops
    # their counters, and the dropped fields are not written again and again.
    await until(lambda: {GPU_A, NVME_A, NVME_B} <= dra.pool())
    await writes_settle(dra)
    assert {GPU_A, NVME_A, NVME_B} <= dra.pool()
    (missing,) = details(caplog, "dra-feature-missing")
    assert "dra.partitionableDevices is true, so dp keeps publishing them" in missing
    assert UNHEALTHY_GPU not in dra.pool()
    # deviceTaints: false on a server that would keep them: left out, never tainted.
    (dra.harness.dev / "vfio" / "59").unlink()
    await until(lambda: GPU_A not in dra.pool())
    assert all(not taints_of(dra, name) for name in (NVME_A, NVME_B))


async def test_partitionable_devices_false_never_sends_counters(dra: Dra) -> None:
    await dra.start_api()
    config = CONFIG.replace(
        f"driverName: {DRIVER}\n", f"driverName: {DRIVER}\n  partitionableDevices: false\n"
    )
    await dra.start_server(config)
    await dra.registered()
    await until(lambda: GPU_A in dra.pool() and len(dra.pool() & {NVME_A, NVME_B}) == 1)
    history = [e.object for e in dra.api.store.events_since(0) if e.resource == "resourceslices"]
    assert history and not counters_in(history)


async def test_the_kubelet_wiping_the_node_slices_at_its_start_gets_them_back_at_once(
    dra: Dra,
) -> None:
    """A kubelet that starts deletes its node's ResourceSlices, every driver's
    (DeleteCollection by spec.nodeName, pkg/kubelet/cm/dra/plugin/registration.go);
    dp puts them back in its first repair, which is not delayed."""
    runtime = await serving(dra)
    before = dra.pool()
    async with httpx2.AsyncClient(base_url=dra.api.url, timeout=5) as http:
        wiped = await http.delete(
            "/apis/resource.k8s.io/v1/resourceslices",
            params={"fieldSelector": f"spec.nodeName={NODE}"},
        )
    assert wiped.status_code == 200 and wiped.json()["items"]
    assert dra.pool() == set()
    await until(lambda: dra.pool() == before, timeout=2)
    families = {f.name: f for f in runtime_families(runtime)}
    assert families["dp_dra_slice_repairs_total"].samples[0].value == 1
    assert families["dp_dra_node_present"].samples[0].value == 1
    assert runtime.essential_tasks() == {
        "file-watch": "",
        "timer-loop": "",
        "dra-slice-publisher": "",
    }


# -- the start-up window: a scheduler that allocates the moment slices appear ----------------

NVME = "devices.kubevirt.io/nvme"


def waiting_claim(dra: Dra, name: str) -> None:
    """A claim with one request, not allocated yet."""
    dra.api.store.create(
        "resourceclaims",
        "default",
        {
            "metadata": {"name": name},
            "spec": {
                "devices": {"requests": [{"name": "dev", "exactly": {"deviceClassName": "x"}}]}
            },
        },
    )


def resource_is(resource: str) -> Callable[[Device], bool]:
    return lambda d: d.driver == DRIVER and d.attribute("resourceName") == resource


async def test_claims_waiting_at_start_never_get_two_members_of_a_group_without_counters(
    dra: Dra,
) -> None:
    """DRAPartitionableDevices off (every v1 cluster before 1.36), two claims
    waiting for one NVMe drive each, both drives in IOMMU group 93: the
    scheduler allocates from dp's first complete pool, so that pool must
    already be the one the cluster keeps."""
    dra.api.disabled_features = frozenset({PARTITIONABLE})
    scheduler = Scheduler(dra.api)
    try:
        await dra.start_api()
        for name in ("disk-a", "disk-b"):
            waiting_claim(dra, name)
            scheduler.wait("default", name, {"dev": resource_is(NVME)})
        await dra.start_server()
        await until(lambda: GPU_A in dra.pool())
        await writes_settle(dra)
        allocated = [d for got in scheduler.allocated.values() for _, _, _, d in got]
        assert len(allocated) == 1 and allocated[0] in {NVME_A, NVME_B}
        assert set(scheduler.waiting) == {("default", n) for n in ("disk-a", "disk-b")} - set(
            scheduler.allocated
        )
        # Nothing dp wrote ever carried the counters the server drops.
        history = [
            e.object for e in dra.api.store.events_since(0) if e.resource == "resourceslices"
        ]
        assert history and not counters_in(history)
        assert dra.api.dry_runs[("create", "resourceslices")] >= 1
    finally:
        scheduler.close()


async def test_a_device_whose_group_is_not_viable_is_never_allocated_without_taints(
    dra: Dra,
) -> None:
    """DRADeviceTaints off: the T4 at 0000:d8:00.0 (its audio function on a host
    driver) must never be in a pool the scheduler sees, not even the first."""
    dra.api.disabled_features = frozenset({TAINTS})
    scheduler = Scheduler(dra.api)
    try:
        await dra.start_api()
        waiting_claim(dra, "vm-gpu")
        scheduler.wait(
            "default",
            "vm-gpu",
            {"dev": lambda d: d.attribute("resource.kubernetes.io/pciBusID") == "0000:d8:00.0"},
        )
        await dra.start_server()
        await until(lambda: GPU_A in dra.pool())
        await writes_settle(dra)
        assert scheduler.allocated == {}
        history = [
            e.object for e in dra.api.store.events_since(0) if e.resource == "resourceslices"
        ]
        names = {d["name"] for s in history for d in s["spec"].get("devices") or ()}
        assert UNHEALTHY_GPU not in names
    finally:
        scheduler.close()


async def test_a_refused_claim_gets_an_event_saying_why_once_per_reason(dra: Dra) -> None:
    """The pod of a refused claim stays bound and the kubelet retries Prepare:
    the claim says why (kubectl describe resourceclaim), once, not at every retry."""
    runtime = await serving(dra)
    nvme_a = dra.claim("nvme-a", ("disk", NVME_A))
    nvme_b = dra.claim("nvme-b", ("disk", NVME_B))
    assert (await dra.prepare(nvme_a))[nvme_a.uid].error == ""
    for _ in range(3):  # the kubelet retries
        assert "IOMMU group 93" in (await dra.prepare(nvme_b))[nvme_b.uid].error
    await until(lambda: len(dra.api.store.objects("events", "default")) >= 1)
    await asyncio.sleep(0.2)
    (event,) = dra.api.store.objects("events", "default")
    assert event["regarding"] == {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "name": "nvme-b",
        "namespace": "default",
        "uid": nvme_b.uid,
    }
    assert (event["type"], event["reason"], event["action"]) == (
        "Warning",
        "IOMMUGroupHeld",
        "NodePrepareResources",
    )
    assert "IOMMU group 93" in event["note"] and "default/nvme-a" in event["note"]
    assert event["reportingController"] == DRIVER
    families = {f.name: f for f in runtime_families(runtime)}
    refused = {
        dict(s.labels)["reason"]: s.value for s in families["dp_dra_claims_refused_total"].samples
    }
    assert refused == {"IOMMUGroupHeld": 3}
    events = {
        dict(s.labels)["result"]: s.value for s in families["dp_dra_claim_events_total"].samples
    }
    assert events == {"posted": 1, "failed": 0}


async def test_preparing_and_unpreparing_claims_writes_no_slice(dra: Dra) -> None:
    """Where the server keeps counters, a claim changes nothing the scheduler
    does not know already: the pool is not written for it."""
    await serving(dra)
    await writes_settle(dra)
    writes = dra.api.writes
    claims = [dra.claim("nvme-a", ("disk", NVME_A)), dra.claim("vm-gpu", ("gpu", GPU_A))]
    for claim in claims:
        assert (await dra.prepare(claim))[claim.uid].error == ""
    assert await dra.unprepare(*claims) == {c.uid: "" for c in claims}
    await writes_settle(dra)
    assert dra.api.writes == writes


async def test_one_claim_takes_a_whole_group_and_two_claims_still_never_split_it(
    dra: Dra,
) -> None:
    """The NVMe pair of IOMMU group 93, offered whole as iommu-group-93: a claim
    for it gets both drives, and claims for one drive each wait meanwhile."""
    scheduler = Scheduler(dra.api)
    try:
        await serving(dra)
        assert "iommu-group-93" in dra.pool()
        waiting_claim(dra, "both")
        scheduler.wait(
            "default",
            "both",
            {
                "pair": lambda d: (
                    d.attribute("resourceName") == "iommu-group" and d.attribute("iommuGroup") == 93
                )
            },
        )
        await until(lambda: ("default", "both") in scheduler.allocated)
        assert scheduler.allocated[("default", "both")] == [
            ("pair", DRIVER, NODE, "iommu-group-93")
        ]
        for name in ("disk-a", "disk-b"):
            waiting_claim(dra, name)
            scheduler.wait("default", name, {"dev": resource_is(NVME)})
        await asyncio.sleep(0.3)
        # Neither drive: the whole group holds the counter's one slot.
        assert set(scheduler.waiting) == {("default", "disk-a"), ("default", "disk-b")}

        both = dra_claim(dra, ("default", "both"))
        (result,) = (await dra.prepare(both)).values()
        assert result.error == ""
        spec = dra.cdi / f"{DRIVER}_claim_{both.uid}.json"
        edits = resolve(
            [read_spec(spec.read_bytes(), str(spec))], result.devices[0].cdi_device_ids[0]
        )
        assert {n.path for n in edits.device_nodes} == {"/dev/vfio/vfio", "/dev/vfio/93"}
        host = (
            dra.plugins / DRIVER / "dra-device-metadata" / "default_both" / "pair" / "metadata.json"
        )
        v1alpha1 = [json.loads(line) for line in host.read_text().splitlines()][1]
        (request,) = v1alpha1["requests"]
        (device,) = request["devices"]  # KubeVirt 1.9 reads exactly one device per request
        assert device["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": "0000:5e:00.0"}
        assert device["attributes"]["members"] == {"string": "0000:5e:00.0,0000:5e:01.0"}
        # A drive of the group, allocated by hand as a split would be: refused.
        split = dra.claim("split", ("disk", NVME_B))
        assert "held by claim default/both" in (await dra.prepare(split))[split.uid].error
        dra.api.store.delete("resourceclaims", "default", "split")

        # The claim's pod goes: Unprepare, the claim de-allocated; a drive claim gets in.
        assert await dra.unprepare(both) == {both.uid: ""}
        dra.api.store.delete("resourceclaims", "default", "both")
        await until(lambda: len(scheduler.waiting) == 1)
    finally:
        scheduler.close()


def uid_of(dra: Dra, key: tuple[str, str]) -> str:
    uid: str = dra.api.store.get("resourceclaims", *key)["metadata"]["uid"]
    return uid


def dra_claim(dra: Dra, key: tuple[str, str]) -> Claim:
    return Claim(key[0], uid_of(dra, key), key[1])


async def test_a_requests_claims_are_read_at_once_and_prepared_in_the_kubelets_order(
    dra: Dra,
) -> None:
    """A pod's claims come in one NodePrepareResources: a slow API server holds
    it up by one read, not one per claim; the node still takes the claims in
    the order the kubelet listed them, so of two claims on one IOMMU group
    the first is prepared and the second refused, every time."""
    await serving(dra)
    claims = [
        dra.claim("vm-gpu-a", ("gpu", GPU_A)),
        dra.claim("vm-gpu-b", ("gpu", "pci-0000-af-00-0")),
        dra.claim("nvme-a", ("disk", NVME_A)),
        dra.claim("nvme-b", ("disk", NVME_B)),
    ]
    dra.api.delay = 1.0  # before every answer
    started = asyncio.get_running_loop().time()
    replies = await dra.prepare(*claims)
    took = asyncio.get_running_loop().time() - started
    dra.api.delay = 0.0
    assert [replies[c.uid].error for c in claims[:3]] == ["", "", ""]
    assert "IOMMU group 93" in replies[claims[3].uid].error
    assert took < 2.5, f"4 claims, 1 s per read: {took:.2f} s is one read after another"


async def test_two_calls_for_one_claim_read_at_once_get_one_preparation(
    dra: Dra, caplog: pytest.LogCaptureFixture
) -> None:
    """The kubelet asks again while the first call's read is under way (its
    retry after a deadline, a second pod of the claim): both calls wait for
    a read, the first read back prepares the claim, and the other call is
    answered from what is held."""
    caplog.set_level(logging.INFO, logger="dp")
    runtime = await serving(dra)
    gpu = dra.claim("vm-gpu", ("gpu", GPU_A))
    dra.api.delay = 0.5  # before every answer
    calls = [asyncio.create_task(dra.prepare(gpu)) for _ in range(2)]
    await until(lambda: reads_waiting(runtime) == 2)
    first, second = await asyncio.gather(*calls)
    dra.api.delay = 0.0
    assert first[gpu.uid].error == "" and first[gpu.uid].devices
    assert second == first
    assert [r.getMessage() for r in caplog.records].count("claim-prepared") == 1
    assert reads_waiting(runtime) == 0
