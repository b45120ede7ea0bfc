"""The kubelet's DRA health stream end to end: `serve` against the grpcio DRA
kubelet emulator, which opens the stream when it registers the driver and
keeps each prepared claim's device health as the kubelet puts it in the pod's
status (`allocatedResourcesStatus`).

The fixture's T4 0000:3b:00.0 (DRA device pci-0000-3b-00-0) is in IOMMU
group 59: removing /dev/vfio/59 is the device going unhealthy on the host.

Each runs against a 1.36 kubelet, which reads `v1alpha1.DRAResourceHealth`,
and a 1.37 one, which reads `v1.DRAResourceHealth` from a driver that
advertises it, as dp does.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import grpc
import pytest

from dp_core.dra.claims import ClaimRef
from dp_server.dra import DraEndpoints, PrepareOutcome, refused
from dp_server.monitoring.probes import runtime_families
from dp_testing.dra_kubelet import HEALTH_MESSAGES, DraKubeletEmulator, ResourceHealth
from tests.e2e_harness import FAST
from tests.test_dra_e2e import DRIVER, GPU_A, NODE, Dra, serving, until

import go_kubelet

RETRY = 0.3  # the emulator's 5 s between health streams, shortened
#: The health service each kubelet release asks dp for.
ASKED = {"1.36": "v1alpha1.DRAResourceHealth", "1.37": "v1.DRAResourceHealth"}


@pytest.fixture(params=sorted(ASKED))
def release(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def dra(release: str) -> AsyncIterator[Dra]:
    setup = Dra()
    setup.kubelet = DraKubeletEmulator(setup.registry, health_retry=RETRY, release=release)
    setup.harness.start_kubelet()
    setup.kubelet.start()
    try:
        yield setup
    finally:
        await setup.close()


def health_events(dra: Dra, kind: str) -> list[str]:
    return [e.detail for e in dra.kubelet.events(kind) if e.driver == DRIVER]


async def test_a_held_device_that_goes_unhealthy_shows_in_its_pods_status_and_comes_back(
    dra: Dra, release: str
) -> None:
    await serving(dra)
    info = dra.kubelet.plugins()[DRIVER].versions
    assert info[-2:] == ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"), info
    gpu = dra.claim("vm-gpu", ("gpu", GPU_A))
    (result,) = (await dra.prepare(gpu)).values()
    assert result.error == ""
    cdi_id = result.devices[0].cdi_device_ids[0]  # what the kubelet names it by
    healthy = await asyncio.to_thread(dra.kubelet.wait_claim_health, gpu.uid, "Healthy")
    assert healthy == (ResourceHealth(cdi_id, "Healthy"),)

    group = dra.harness.dev / "vfio" / "59"
    group.unlink()  # seen by the /dev/vfio watch (the harness rescans hourly)
    unhealthy = await asyncio.to_thread(dra.kubelet.wait_claim_health, gpu.uid, "Unhealthy")
    assert unhealthy == (ResourceHealth(cdi_id, "Unhealthy"),)
    reason = dra.kubelet.health_message(DRIVER, NODE, GPU_A)
    assert "/dev/vfio/59" in reason, reason

    group.touch()
    back = await asyncio.to_thread(dra.kubelet.wait_claim_health, gpu.uid, "Healthy")
    assert back == (ResourceHealth(cdi_id, "Healthy"),)
    assert dra.kubelet.health_message(DRIVER, NODE, GPU_A) == ""
    # One stream, of the version this kubelet reads, all along, nothing
    # ended: every change came on it.
    assert health_events(dra, "health-opened") == [ASKED[release]]
    assert health_events(dra, "health-ended") == []
    assert f"{NODE}/{GPU_A}=Unhealthy" in health_events(dra, "health")


async def test_health_is_sent_again_before_the_kubelet_would_read_it_as_unknown(dra: Dra) -> None:
    """With nothing changing, the list comes again every resend interval and
    the claim never reads Unknown, though the kubelet is told to hold each
    message only three intervals and a second (3 s here), from a time on the
    wire in whole seconds, rounded down; the claim is watched for longer."""
    await dra.start_api()
    runtime = await dra.start_server(timing=attrs.evolve(FAST, health_resend=0.5))
    await dra.registered()
    gpu = dra.claim("vm-gpu", ("gpu", GPU_A))
    assert (await dra.prepare(gpu))[gpu.uid].error == ""
    await asyncio.to_thread(dra.kubelet.wait_claim_health, gpu.uid, "Healthy")
    seen = []
    deadline = time.monotonic() + 4.0
    while time.monotonic() < deadline:
        seen.append(dra.kubelet.claim_health(gpu.uid)[0].health)
        await asyncio.sleep(0.05)
    assert set(seen) == {"Healthy"}
    families = {f.name: f for f in runtime_families(runtime)}
    assert families["dp_dra_health_streams"].samples[0].value == 1


async def test_a_restarted_dp_is_watched_again_and_says_healthy_again(dra: Dra) -> None:
    """dp going away ends the stream: the kubelet forgets the driver's health
    (its claims read Unknown) and asks again; the new dp answers."""
    await serving(dra)
    gpu = dra.claim("vm-gpu", ("gpu", GPU_A))
    (result,) = (await dra.prepare(gpu)).values()
    cdi_id = result.devices[0].cdi_device_ids[0]  # what the kubelet names it by
    await asyncio.to_thread(dra.kubelet.wait_claim_health, gpu.uid, "Healthy")
    await dra.stop_server()
    (ended,) = await asyncio.to_thread(dra.kubelet.wait_for, "health-ended", DRIVER)
    assert "UNAVAILABLE" in ended.detail and "shutting down" in ended.detail
    assert dra.kubelet.claim_health(gpu.uid) == (ResourceHealth(cdi_id, "Unknown"),)
    await dra.start_server()
    await until(lambda: len(health_events(dra, "health-opened")) >= 2, timeout=10)
    await asyncio.to_thread(dra.kubelet.wait_claim_health, gpu.uid, "Healthy")


def _watch(channel: grpc.Channel, service: str, seen: queue.Queue[Any]) -> grpc.Future:
    """NodeWatchResources of `service` on `channel`; each message into `seen`."""
    module = HEALTH_MESSAGES[service]
    call = channel.unary_stream(
        f"/{service}/NodeWatchResources",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=module.NodeWatchResourcesResponse.FromString,
    )(module.NodeWatchResourcesRequest())

    def read() -> None:
        with contextlib.suppress(grpc.RpcError):  # cancelled at the end
            for message in call:
                seen.put(message)

    threading.Thread(target=read, daemon=True).start()
    return call


def _devices(message: Any) -> list[tuple[str, str, int, int, str]]:
    return [
        (
            d.device.pool_name,
            d.device.device_name,
            d.health,
            d.health_check_timeout_seconds,
            d.message,
        )
        for d in message.devices
    ]


async def test_a_v1_and_a_v1alpha1_stream_are_sent_the_same_lists_from_one_watch(dra: Dra) -> None:
    """Both versions are served at once, each stream fed by the one health
    watch: the same devices, health, timeout and message on both, at the
    start and at a change; each device's timeout is three resends and a
    second (31 s for dp's 10 s), its message why it is not healthy."""
    runtime = await serving(dra)
    await until(lambda: len(health_events(dra, "health-opened")) == 1)
    socket = dra.plugins / DRIVER / "dra.sock"
    channel = grpc.insecure_channel(f"unix:{socket}")
    got: dict[str, queue.Queue[Any]] = {service: queue.Queue() for service in HEALTH_MESSAGES}
    calls = [_watch(channel, service, seen) for service, seen in got.items()]
    try:
        first = {s: await asyncio.to_thread(q.get, timeout=5) for s, q in got.items()}
        families = {f.name: f for f in runtime_families(runtime)}
        assert families["dp_dra_health_streams"].samples[0].value == 3  # and the kubelet's
        (dra.harness.dev / "vfio" / "59").unlink()

        def next_change(seen: queue.Queue[Any]) -> Any:
            while True:
                message = seen.get(timeout=5)
                if _devices(message) != _devices(first["v1.DRAResourceHealth"]):
                    return message

        changed = {s: await asyncio.to_thread(next_change, q) for s, q in got.items()}
    finally:
        for call in calls:
            call.cancel()
        channel.close()
    v1, v1alpha1 = (first[s] for s in ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"))
    assert _devices(v1) == _devices(v1alpha1)
    assert (NODE, GPU_A, 1, 31, "") in _devices(v1)  # HEALTHY
    assert v1.devices[0].last_updated_time == pytest.approx(time.time(), abs=10)
    after = [_devices(changed[s]) for s in ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")]
    assert after[0] == after[1]
    (gpu,) = [d for d in after[0] if d[1] == GPU_A]
    assert gpu[2] == 2 and gpu[3] == 31 and "/dev/vfio/59" in gpu[4], gpu  # UNHEALTHY


async def test_a_grpc_go_kubelet_sees_a_held_device_go_unhealthy_and_come_back(
    gokubelet: Path, release: str
) -> None:
    """The same against the kubelet's own gRPC stack, as a 1.36 and a 1.37
    kubelet: the stream of the version each reads, opened at registration, is
    read without error ("malformed header: missing HTTP
    content-type" while dp did not serve it), the claim's device reads
    Healthy, Unhealthy once its VFIO node is gone, and Healthy again; methods
    dp does not serve read as UNIMPLEMENTED on both DRA sockets."""
    dra = Dra()  # its grpcio DRA kubelet stays stopped: gokubelet is the kubelet here
    dra.harness.start_kubelet()
    kubelet: subprocess.Popen[str] | None = None
    try:
        await dra.start_api()
        await dra.start_server()
        await until(lambda: GPU_A in dra.pool())
        gpu = dra.claim("vm-gpu", ("gpu", GPU_A))
        kubelet = go_kubelet.start_dra(
            gokubelet,
            dra.registry,
            [(gpu.namespace, gpu.name, gpu.uid)],
            health_expect=("Healthy", "Unhealthy", "Healthy"),
            health_retry=RETRY,
            release=release,
            timeout=20.0,
        )
        group = dra.harness.dev / "vfio" / "59"

        def drive_the_host(process: subprocess.Popen[str]) -> list[str]:
            seen = []
            for uid, state in go_kubelet.health_changes(process):
                assert uid == gpu.uid
                seen.append(state)
                if state == "Healthy" and "Unhealthy" not in seen:
                    group.unlink()
                elif state == "Unhealthy":
                    group.touch()
                elif state == "Healthy":
                    break
            return seen

        seen = await asyncio.to_thread(drive_the_host, kubelet)
        result = await asyncio.to_thread(go_kubelet.report, kubelet, 60)
    finally:
        if kubelet is not None and kubelet.poll() is None:
            kubelet.kill()
            kubelet.communicate()
        await dra.close()
    assert result["exit_code"] == 0, result
    assert [s for s in seen if s != "Unknown"] == ["Healthy", "Unhealthy", "Healthy"], seen
    assert [s["health"] for s in result["health_seen"]] == seen
    assert result["health_errors"] == []  # one stream, never ended
    assert result["health_opened"] == 1
    (plugin,) = result["plugins"]
    assert plugin["health_service"] == ASKED[release]
    (device,) = result["prepare"][gpu.uid]["devices"]
    assert device["device_name"] == GPU_A
    assert result["unprepare"] == {gpu.uid: ""}
    for socket in ("registration", "dra"):
        assert result["unknown_methods"][socket].startswith("Unimplemented: "), result


class _NoClaims:
    async def prepare(self, claims: Sequence[ClaimRef]) -> list[PrepareOutcome | Exception]:
        return [refused(claim, "no claims in this test", "Test") for claim in claims]

    async def unprepare(self, claim: ClaimRef) -> str | None:
        return None


async def test_a_grpc_go_kubelet_asks_again_after_each_failed_health_stream(
    gokubelet: Path,
) -> None:
    """A driver without the health service (DRA endpoints made without a
    health watcher): the grpc-go kubelet reads each ask as UNIMPLEMENTED and
    asks again the retry interval later, as the kubelet does every 5 s."""
    root = Path(tempfile.mkdtemp(prefix="dp-gohealth-"))  # short: Unix socket paths
    endpoints = DraEndpoints(DRIVER, root / "registry", root / "plugins", _NoClaims())
    await endpoints.start()
    kubelet: subprocess.Popen[str] | None = None
    try:
        kubelet = go_kubelet.start_dra(
            gokubelet, root / "registry", [], health_retry=RETRY, health_opens=3
        )
        result = await asyncio.to_thread(go_kubelet.report, kubelet, 60)
    finally:
        if kubelet is not None and kubelet.poll() is None:
            kubelet.kill()
            kubelet.communicate()
        await endpoints.close()
        shutil.rmtree(root, ignore_errors=True)
    assert result["exit_code"] == 0, result
    assert result["health_opened"] >= 3
    assert len(result["health_errors"]) >= 2
    assert all("code = Unimplemented" in e for e in result["health_errors"]), result
    opened = result["health_opened_ms"]
    gaps = [later - earlier for earlier, later in zip(opened, opened[1:], strict=False)]
    assert all(gap >= RETRY * 1000 for gap in gaps), gaps


async def test_a_grpc_go_137_kubelet_asks_no_health_stream_of_a_driver_that_offers_none(
    gokubelet: Path,
) -> None:
    """The same driver without the health service, as a 1.37 kubelet sees it:
    it advertised none, so none is asked for, and claims go on as ever."""
    root = Path(tempfile.mkdtemp(prefix="dp-gohealth-"))  # short: Unix socket paths
    endpoints = DraEndpoints(DRIVER, root / "registry", root / "plugins", _NoClaims())
    await endpoints.start()
    kubelet: subprocess.Popen[str] | None = None
    try:
        kubelet = go_kubelet.start_dra(gokubelet, root / "registry", [], release="1.37")
        result = await asyncio.to_thread(go_kubelet.report, kubelet, 60)
    finally:
        if kubelet is not None and kubelet.poll() is None:
            kubelet.kill()
            kubelet.communicate()
        await endpoints.close()
        shutil.rmtree(root, ignore_errors=True)
    assert result["exit_code"] == 0, result
    (plugin,) = result["plugins"]
    assert "v1.DRAResourceHealth" not in plugin["versions"]
    assert plugin["health_service"] == ""
    assert result["health_opened"] == 0 and result["health_errors"] == []
