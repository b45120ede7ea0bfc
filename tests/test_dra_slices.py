"""The ResourceSlice publisher against the API-server emulator: what lands there, and when."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import attrs
import pytest

from dp_core import Backoff, DraFeaturesObserved
from dp_core.dra.pool_content import (
    CounterConsumption,
    CounterSet,
    DeviceTaint,
    PoolContent,
    PoolDevice,
)
from dp_server.dra.api import KubeApi
from dp_server.dra.pacing import RepairPacer
from dp_server.dra.slices import SlicePublisher
from dp_testing.apiserver import ApiServerEmulator
from dp_testing.apiserver.rules import drop_disabled_fields

SCHEMA = Path(__file__).parent / "data" / "k8s" / "resource.k8s.io-v1.schema.json"
DRIVER = "vfio.dp.example.com"
NODE = "node-a"


def device(i: int, *, advanced: bool = False, numa: int = 0) -> PoolDevice:
    return PoolDevice(
        f"pci-0000-3b-{i:02x}-0" if not advanced else f"vf-{i:03d}",
        attributes=[
            ("resource.kubernetes.io/pciBusID", f"0000:3b:{i % 256:02x}.0"),
            (f"{DRIVER}/numaNode", numa),
            (f"{DRIVER}/resourceName", "nvidia.com/TU104GL_Tesla_T4"),
        ],
        consumes_counters=[CounterConsumption(f"group-{i}", [("members", 1)])] if advanced else (),
        taints=[DeviceTaint(f"{DRIVER}/unhealthy")] if advanced and i % 2 else (),
    )


def pool(plain: int, advanced: int = 0, numa: int = 0, node: str = NODE) -> PoolContent:
    devices = [device(i, numa=numa) for i in range(plain)]
    devices += [device(i, advanced=True) for i in range(advanced)]
    sets = [CounterSet(f"group-{i}", [("members", 1)]) for i in range(advanced)]
    return PoolContent(
        driver=DRIVER, pool=node, node_name=node, devices=devices, shared_counters=sets
    )


async def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.01)


def ours(emulator: ApiServerEmulator) -> list[dict[str, Any]]:
    return [
        s
        for s in emulator.slices()
        if s["spec"].get("nodeName") == NODE and s["spec"]["driver"] == DRIVER
    ]


def matches(emulator: ApiServerEmulator, content: PoolContent) -> bool:
    """The server holds exactly `content`, in one complete generation."""
    slices = ours(emulator)
    if not slices:
        return not content.devices and not content.shared_counters
    generations = {s["spec"]["pool"]["generation"] for s in slices}
    counts = {s["spec"]["pool"]["resourceSliceCount"] for s in slices}
    if len(generations) != 1 or counts != {len(slices)}:
        return False
    names = sorted(d["name"] for s in slices for d in s["spec"].get("devices") or ())
    sets = sorted(c["name"] for s in slices for c in s["spec"].get("sharedCounters") or ())
    attributes = {
        d["name"]: d.get("attributes", {}) for s in slices for d in s["spec"].get("devices") or ()
    }
    wanted = {d.name: {k: _attr(v) for k, v in d.attributes} for d in content.devices}
    return (
        names == sorted(wanted)
        and sets == sorted(c.name for c in content.shared_counters)
        and attributes == wanted
    )


def _attr(value: object) -> dict[str, object]:
    if isinstance(value, bool):
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value}
    return {"string": value}


@pytest.fixture
async def emulator() -> AsyncIterator[ApiServerEmulator]:
    server = ApiServerEmulator(schema=SCHEMA)
    await server.start()
    server.add_node(NODE)
    yield server
    await server.stop()
    assert server.rejected == [], "dp wrote an object the API server would refuse"


class Running:
    def __init__(self, emulator: ApiServerEmulator, **kwargs: Any) -> None:
        self.api = KubeApi.connect(server=emulator.url, timeout=kwargs.pop("timeout", 2.0))
        kwargs.setdefault("watch_period", (0.3, 0.5))
        kwargs.setdefault("backoff", Backoff(0.02, 0.1))
        self.publisher = SlicePublisher(self.api, **kwargs)
        self.task: asyncio.Task[None] | None = None

    def start(self) -> SlicePublisher:
        self.task = asyncio.create_task(self.publisher.run())
        return self.publisher

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
            # The publisher only ends by cancellation: any other end is a bug.
            assert self.task.cancelled()
        await self.api.close()


@pytest.fixture
async def running(emulator: ApiServerEmulator) -> AsyncIterator[Running]:
    run = Running(emulator)
    yield run
    await run.close()


async def test_a_pool_is_cut_into_owned_slices_within_the_limits(
    emulator: ApiServerEmulator, running: Running
) -> None:
    content = pool(plain=200, advanced=70)
    publisher = running.start()
    publisher.publish(content)
    await until(lambda: matches(emulator, content))
    await until(lambda: publisher.synced)  # once the pass has read its last answer

    slices = ours(emulator)
    node_uid = emulator.store.get("nodes", "", NODE)["metadata"]["uid"]
    for s in slices:
        spec = s["spec"]
        assert spec["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": len(slices)}
        assert s["metadata"]["name"].startswith(f"{NODE}-{DRIVER}-")
        assert s["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": node_uid, "controller": True}
        ]
        devices = spec.get("devices") or []
        # Counter sets live in slices of their own (1.35).
        assert not (devices and spec.get("sharedCounters"))
        advanced = any(d.get("taints") or d.get("consumesCounters") for d in devices)
        assert len(devices) <= (64 if advanced else 128)
    # 70 counter sets in 9 slices of at most 8, 200 plain devices in 2, 70 advanced in 2.
    # 70 counter sets in 9 slices of at most 8; 270 devices, 64 to a slice
    # whatever they carry (so a taint coming or going moves none of them).
    assert sorted(len(s["spec"].get("devices") or []) for s in slices) == [0] * 9 + [14] + [64] * 4
    assert emulator.writes == len(slices) == publisher.generation + 13
    assert publisher.synced


async def test_nothing_is_written_while_nothing_changes(
    emulator: ApiServerEmulator, running: Running
) -> None:
    content = pool(plain=10, advanced=3)  # taints: the server stamps their timeAdded
    publisher = running.start()
    publisher.publish(content)
    await until(lambda: matches(emulator, content))
    writes = emulator.writes
    watches = emulator.requests[("watch", "resourceslices")]

    publisher.publish(pool(plain=10, advanced=3))  # equal content, a new value
    await asyncio.sleep(1.5)  # several watch periods

    assert emulator.writes == writes
    assert emulator.requests[("watch", "resourceslices")] >= watches + 2
    assert publisher.generation == 1
    families = {f.name: f for f in publisher.families()}
    assert families["dp_kube_api_writes_total"].samples[0].value == writes
    assert families["dp_dra_slices_synced"].samples[0].value == 1


async def test_a_change_bumps_the_generation_of_every_slice(
    emulator: ApiServerEmulator, running: Running
) -> None:
    publisher = running.start()
    publisher.publish(pool(plain=150))
    await until(lambda: matches(emulator, pool(plain=150)))
    assert len(ours(emulator)) == 3
    writes = emulator.writes

    changed = pool(plain=150, numa=1)
    publisher.publish(changed)
    await until(lambda: matches(emulator, changed))
    assert {s["spec"]["pool"]["generation"] for s in ours(emulator)} == {2}
    assert emulator.writes == writes + 3  # three updates, nothing created or deleted

    fewer = pool(plain=50, numa=1)
    publisher.publish(fewer)
    await until(lambda: matches(emulator, fewer))
    assert [s["spec"]["pool"]["generation"] for s in ours(emulator)] == [3]
    assert emulator.writes == writes + 3 + 3  # one update, two deletes
    assert emulator.requests[("create", "resourceslices")] == 3


async def test_a_change_to_one_slice_is_one_update_at_the_same_generation(
    emulator: ApiServerEmulator, running: Running
) -> None:
    """A health change taints one device: one slice changes, and one update is
    atomic, so the generation stays (as the Go helper does)."""
    content = pool(plain=150, advanced=2)
    publisher = running.start()
    publisher.publish(content)
    await until(lambda: matches(emulator, content))
    await until(lambda: publisher.synced)
    writes = emulator.writes

    sick = device(149)
    tainted = attrs.evolve(sick, taints=[DeviceTaint(f"{DRIVER}/unhealthy")])
    unhealthy = attrs.evolve(
        content, devices=[tainted if d.name == sick.name else d for d in content.devices]
    )
    publisher.publish(unhealthy)
    await until(lambda: taints_of(emulator, sick.name) == [f"{DRIVER}/unhealthy"])
    await until(lambda: publisher.synced)
    assert emulator.writes == writes + 1
    assert emulator.requests[("update", "resourceslices")] == 1
    assert {s["spec"]["pool"]["generation"] for s in ours(emulator)} == {1}

    publisher.publish(content)  # healthy again
    await until(lambda: taints_of(emulator, sick.name) == [])
    await until(lambda: publisher.synced)
    assert emulator.writes == writes + 2
    assert publisher.generation == 1


def taints_of(emulator: ApiServerEmulator, name: str) -> list[str]:
    return [
        t["key"]
        for s in ours(emulator)
        for d in s["spec"].get("devices") or ()
        if d["name"] == name
        for t in d.get("taints") or ()
    ]


async def test_stale_slices_of_this_node_and_driver_are_cleaned_at_start(
    emulator: ApiServerEmulator, running: Running
) -> None:
    def left(name: str, pool_name: str, generation: int, *, node: str = NODE, driver: str = DRIVER):
        spec = {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": pool_name, "generation": generation, "resourceSliceCount": 2},
            "devices": [{"name": "old-device"}],
        }
        emulator.store.create("resourceslices", "", {"metadata": {"name": name}, "spec": spec})

    left("old-a", NODE, 7)
    left("old-b", NODE, 6)
    left("renamed-pool", "node-a-before", 1)
    left("other-driver", NODE, 1, driver="gpu.example.com")
    emulator.add_node("node-b")
    left("other-node", "node-b", 1, node="node-b")

    content = pool(plain=5)
    running.start().publish(content)
    await until(lambda: matches(emulator, content))

    assert [s["spec"]["pool"]["generation"] for s in ours(emulator)] == [8]
    names = sorted(s["metadata"]["name"] for s in emulator.slices())
    # One left-over slice reused for the new generation; the rest of ours deleted.
    assert names in (
        ["old-a", "other-driver", "other-node"],
        ["old-b", "other-driver", "other-node"],
    )


async def test_a_conflict_is_answered_by_listing_again_and_retrying(
    emulator: ApiServerEmulator, running: Running
) -> None:
    publisher = running.start()
    publisher.publish(pool(plain=3))
    await until(lambda: matches(emulator, pool(plain=3)))
    lists = emulator.requests[("list", "resourceslices")]

    emulator.fail_next("update", "resourceslices", 409)
    publisher.publish(pool(plain=4))
    await until(lambda: matches(emulator, pool(plain=4)))

    assert publisher.conflicts == 1
    assert emulator.requests[("list", "resourceslices")] == lists + 1
    assert publisher.failures == 0


async def test_conflicts_without_end_back_off_and_never_end_the_publisher(
    emulator: ApiServerEmulator, running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    # Whatever level an earlier test's CLI left the root logger at.
    caplog.set_level(logging.WARNING, logger="dp.dra")
    publisher = running.start()
    publisher.publish(pool(plain=3))
    await until(lambda: matches(emulator, pool(plain=3)))

    for _ in range(12):  # more stale views in a row than it retries at once
        emulator.fail_next("update", "resourceslices", 409)
    publisher.publish(pool(plain=4))
    await until(lambda: matches(emulator, pool(plain=4)))
    assert publisher.conflicts == 12
    assert publisher.failures >= 1  # it backed off, and went on
    away = [r for r in caplog.records if r.getMessage() == "kube-api-unavailable"]
    assert away
    # Each names the API server it asked, as the kubeconfig gives it.
    assert all(r.dp_fields["server"] == emulator.url for r in away)  # type: ignore[attr-defined]
    assert running.task is not None and not running.task.done()


async def test_an_answer_that_is_no_object_is_retried_after_a_backoff(
    emulator: ApiServerEmulator, running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    emulator.garble_next("list", "resourceslices")
    publisher = running.start()
    publisher.publish(pool(plain=3))
    await until(lambda: matches(emulator, pool(plain=3)))
    assert publisher.failures == 1
    (failed,) = [r for r in caplog.records if r.getMessage() == "resourceslice-publisher-failed"]
    assert "retry_in" in getattr(failed, "dp_fields", {})
    assert running.task is not None and not running.task.done()


async def test_an_expired_watch_lists_again_and_sees_what_changed(
    emulator: ApiServerEmulator, running: Running
) -> None:
    content = pool(plain=3)
    publisher = running.start()
    publisher.publish(content)
    await until(lambda: matches(emulator, content))
    lists = emulator.requests[("list", "resourceslices")]

    emulator.expire_watches()  # open watches get 410; older versions are forgotten
    await until(lambda: emulator.requests[("list", "resourceslices")] > lists)
    (only,) = ours(emulator)
    emulator.store.delete("resourceslices", "", only["metadata"]["name"])

    await until(lambda: matches(emulator, content))
    assert publisher.relists >= 1
    assert publisher.failures == 0


async def test_slices_changed_or_deleted_by_someone_else_are_put_back(
    emulator: ApiServerEmulator, running: Running
) -> None:
    content = pool(plain=100)
    publisher = running.start()
    publisher.publish(content)
    await until(lambda: matches(emulator, content))

    first, second = ours(emulator)
    emulator.store.delete("resourceslices", "", first["metadata"]["name"])
    await until(lambda: matches(emulator, content))
    assert {s["spec"]["pool"]["generation"] for s in ours(emulator)} == {2}
    await until(lambda: publisher.synced)
    writes = emulator.writes

    victim = ours(emulator)[0]
    victim["spec"]["devices"] = victim["spec"]["devices"][:1]
    emulator.store.update("resourceslices", "", victim["metadata"]["name"], victim, status=False)
    await until(lambda: matches(emulator, content))
    # One slice changed: put back by one update, at the same generation.
    assert {s["spec"]["pool"]["generation"] for s in ours(emulator)} == {2}
    await until(lambda: publisher.synced)
    assert emulator.writes == writes + 1
    assert publisher.repairs.repairs == 2


async def test_a_change_seen_before_the_answer_to_our_own_write_is_not_lost(
    emulator: ApiServerEmulator, running: Running
) -> None:
    """The watch may bring someone else's change to a slice before the answer to
    dp's own write of it: the newer of the two is what dp knows of the slice."""
    content = pool(plain=3)
    publisher = running.start()
    publisher.publish(content)
    await until(lambda: matches(emulator, content))
    await until(lambda: publisher.synced)

    emulator.delay_answer("update", "resourceslices", 0.5)
    changed = pool(plain=3, numa=1)
    publisher.publish(changed)
    await until(lambda: matches(emulator, changed))  # stored; dp still waits for the answer
    (victim,) = ours(emulator)
    victim["spec"]["devices"] = victim["spec"]["devices"][:1]
    emulator.store.update("resourceslices", "", victim["metadata"]["name"], victim, status=False)

    await until(lambda: matches(emulator, changed))
    await until(lambda: publisher.synced)
    assert emulator.requests[("update", "resourceslices")] == 2  # the change, and the repair
    assert publisher.repairs.repairs == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def test_an_api_server_down_at_start_gets_the_pool_when_it_returns() -> None:
    emulator = ApiServerEmulator(schema=SCHEMA)
    emulator.port = _free_port()  # nothing listens there yet
    run = Running(emulator)
    try:
        publisher = run.start()
        publisher.publish(pool(plain=3))
        await until(lambda: publisher.failures >= 2)
        assert not publisher.synced

        await emulator.start()
        emulator.add_node(NODE)
        await until(lambda: matches(emulator, pool(plain=3)))
        # The pass that wrote them ends once the last answer is read.
        await until(lambda: publisher.synced)
    finally:
        await run.close()
        await emulator.stop()
    assert emulator.rejected == []


async def test_an_api_server_that_fails_later_is_written_when_it_recovers(
    emulator: ApiServerEmulator, running: Running
) -> None:
    publisher = running.start()
    publisher.publish(pool(plain=3))
    await until(lambda: matches(emulator, pool(plain=3)))

    emulator.unavailable = True  # 503 to everything
    await emulator.stop()  # and the open watch cut
    await emulator.start()
    publisher.publish(pool(plain=5))
    await until(lambda: publisher.failures >= 2)
    assert not matches(emulator, pool(plain=5))

    emulator.unavailable = False
    await until(lambda: matches(emulator, pool(plain=5)))


async def test_answers_slower_than_the_timeout_are_retried(emulator: ApiServerEmulator) -> None:
    run = Running(emulator, timeout=0.2)
    try:
        emulator.delay = 0.5
        publisher = run.start()
        publisher.publish(pool(plain=3))
        await until(lambda: publisher.failures >= 2)
        assert ours(emulator) == []

        emulator.delay = 0.05
        await until(lambda: matches(emulator, pool(plain=3)))
    finally:
        await run.close()


async def test_publish_keeps_to_one_driver_and_node(running: Running) -> None:
    publisher = running.start()
    publisher.publish(pool(plain=1))
    with pytest.raises(ValueError, match="one driver on one node"):
        publisher.publish(pool(plain=1, node="node-b"))


# -- what the API server keeps: DraFeaturesObserved ------------------------------------------


async def quiet(emulator: ApiServerEmulator, period: float = 0.8) -> None:
    """Until a whole `period` passes without a write."""
    async with asyncio.timeout(10):
        while True:
            before = emulator.writes
            await asyncio.sleep(period)
            if emulator.writes == before:
                return


@pytest.mark.parametrize(
    ("disabled", "observed"),
    [
        ((), DraFeaturesObserved(partitionable=True, device_taints=True)),
        (("DRAPartitionableDevices",), DraFeaturesObserved(False, True)),
        (("DRADeviceTaints",), DraFeaturesObserved(True, False)),
        (("DRAPartitionableDevices", "DRADeviceTaints"), DraFeaturesObserved(False, False)),
    ],
)
async def test_what_a_write_shows_of_the_features_is_reported_once(
    emulator: ApiServerEmulator,
    disabled: tuple[str, ...],
    observed: DraFeaturesObserved,
) -> None:
    emulator.disabled_features = frozenset(disabled)
    heard: list[DraFeaturesObserved] = []
    run = Running(emulator, on_features=heard.append)
    try:
        content = pool(plain=3, advanced=4)  # counters, and taints on two devices
        publisher = run.start()
        publisher.publish(content)
        await until(lambda: matches_without(emulator, content, disabled))
        await quiet(emulator)  # what the server drops is not written again and again
        assert findings(heard) == observed
        gauge = {
            dict(s.labels)["feature"]: s.value
            for f in publisher.families()
            if f.name == "dp_dra_api_feature"
            for s in f.samples
        }
        assert gauge == {
            "DRAPartitionableDevices": 0 if "DRAPartitionableDevices" in disabled else 1,
            "DRADeviceTaints": 0 if "DRADeviceTaints" in disabled else 1,
        }
        # The core's answer: the content without what the server drops, written at once.
        safe = pool(plain=3)
        publisher.publish(safe)
        await until(lambda: matches(emulator, safe))
        await quiet(emulator)
        assert findings(heard) == observed
    finally:
        await run.close()


def findings(heard: list[DraFeaturesObserved]) -> DraFeaturesObserved:
    """What was reported, each feature at most once (the counter-set slice and
    the device slices are separate writes, so they may tell apart)."""
    partitionable = [h.partitionable for h in heard if h.partitionable is not None]
    taints = [h.device_taints for h in heard if h.device_taints is not None]
    assert len(partitionable) <= 1 and len(taints) <= 1, heard
    return DraFeaturesObserved(next(iter(partitionable), None), next(iter(taints), None))


def matches_without(
    emulator: ApiServerEmulator, content: PoolContent, disabled: tuple[str, ...]
) -> bool:
    """`matches`, on the fields a server with `disabled` features keeps."""
    slices = ours(emulator)
    if not slices or len({s["spec"]["pool"]["generation"] for s in slices}) != 1:
        return False
    names = sorted(d["name"] for s in slices for d in s["spec"].get("devices") or ())
    sets = [c["name"] for s in slices for c in s["spec"].get("sharedCounters") or ()]
    consumes = [
        d for s in slices for d in s["spec"].get("devices") or () if d.get("consumesCounters")
    ]
    taints = [d for s in slices for d in s["spec"].get("devices") or () if d.get("taints")]
    counters_off = "DRAPartitionableDevices" in disabled
    taints_off = "DRADeviceTaints" in disabled
    return (
        names == sorted(d.name for d in content.devices)
        and bool(sets) != counters_off
        and bool(consumes) != counters_off
        and bool(taints) != taints_off
    )


def test_the_emulator_drops_a_disabled_feature_unless_the_old_slice_uses_it() -> None:
    def spec(**device: object) -> dict[str, Any]:
        return {"spec": {"devices": [{"name": "d", **device}], "sharedCounters": [{"name": "s"}]}}

    off = frozenset({"DRAPartitionableDevices", "DRADeviceTaints"})
    counters = {"consumesCounters": [{"counterSet": "s", "counters": {}}]}
    taints = {"taints": [{"key": "k", "effect": "NoSchedule"}]}
    created = drop_disabled_fields(spec(**counters, **taints), None, off)
    assert created == {"spec": {"devices": [{"name": "d"}]}}
    # pkg/registry/resource/resourceslice/strategy.go: fields in use stay on update.
    kept = drop_disabled_fields(spec(**counters, **taints), spec(**counters, **taints), off)
    assert kept == spec(**counters, **taints)
    assert drop_disabled_fields(spec(**taints), None, frozenset()) == spec(**taints)
    with pytest.raises(ValueError, match="DRAPartitionable"):
        ApiServerEmulator(disabled_features={"DRAPartitionable"})


# -- the Node that owns the slices --------------------------------------------------------


def owner_uids(emulator: ApiServerEmulator) -> set[str]:
    return {r["uid"] for s in ours(emulator) for r in s["metadata"]["ownerReferences"]}


def node_uid(emulator: ApiServerEmulator) -> str:
    uid: str = emulator.store.get("nodes", "", NODE)["metadata"]["uid"]
    return uid


async def test_a_deleted_node_gets_nothing_until_it_returns_then_its_pool_owned_by_it(
    emulator: ApiServerEmulator, running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    content = pool(plain=100)
    publisher = running.start()
    publisher.publish(content)
    await until(lambda: matches(emulator, content))
    await until(lambda: publisher.synced)
    writes = emulator.writes

    emulator.delete_node(NODE)  # the garbage collector takes the slices 0.1 s later
    await until(lambda: not ours(emulator))
    await until(lambda: publisher.node_present is False)
    await asyncio.sleep(1.0)  # several watch periods of the publisher
    assert ours(emulator) == [] and emulator.writes == writes
    assert any(r.getMessage() == "node-missing" for r in caplog.records)
    gauges = {f.name: f.samples[0].value for f in publisher.families() if f.samples}
    assert gauges["dp_dra_node_present"] == 0

    emulator.add_node(NODE)  # registered again: a new UID
    await until(lambda: matches(emulator, content))
    assert owner_uids(emulator) == {node_uid(emulator)}
    assert {s["spec"]["pool"]["generation"] for s in ours(emulator)} == {1}
    assert emulator.writes == writes + 2  # the two slices created again, nothing else
    await until(lambda: publisher.node_present is True)


def most_repairs(seconds: float, backoff: Backoff) -> int:
    """How many repairs `RepairPacer` allows in `seconds`: the first at once, then
    each at least half its backoff delay after the one before."""
    count, spent = 1, 0.0
    while True:
        gap = 0.5 * min(backoff.cap, backoff.first * 2.0 ** (count - 1))
        if spent + gap > seconds:
            return count
        spent += gap
        count += 1


async def test_a_node_deleted_and_registered_again_and_again_gets_paced_writes(
    emulator: ApiServerEmulator,
) -> None:
    backoff = Backoff(first=0.2, cap=0.8)
    run = Running(emulator, repairs=RepairPacer(backoff, quiet=10.0))
    try:
        emulator.gc_delay = 0.02
        content = pool(plain=100)  # two slices
        publisher = run.start()
        publisher.publish(content)
        await until(lambda: matches(emulator, content))
        writes = emulator.writes

        loop = asyncio.get_running_loop()
        started = loop.time()
        for _ in range(40):
            emulator.delete_node(NODE)
            await asyncio.sleep(0.05)
            emulator.add_node(NODE)
            await asyncio.sleep(0.05)
        storm = loop.time() - started
        # After the storm, the pool comes back owned by the last Node.
        await until(
            lambda: matches(emulator, content) and owner_uids(emulator) == {node_uid(emulator)}
        )
        finished = loop.time() - started

        repairs = publisher.repairs.repairs
        assert repairs <= most_repairs(finished, backoff)
        assert repairs < 40  # one a cycle without the pacer
        # Each repair writes at most the pool's two slices (creates or updates).
        assert emulator.writes - writes <= 2 * repairs
        assert storm < finished
    finally:
        await run.close()


# -- what the cluster keeps, asked before the first write -------------------------------------


def weakened(history: list[dict[str, Any]]) -> list[str]:
    """Devices of the rich pool ever stored without their counters."""
    return [
        d["name"]
        for s in history
        for d in s["spec"].get("devices") or ()
        if d["name"].startswith("vf-") and not d.get("consumesCounters")
    ]


async def test_the_features_are_asked_by_a_dry_run_before_the_first_write_and_again_later(
    emulator: ApiServerEmulator,
) -> None:
    rich, safe = pool(plain=3, advanced=4), pool(plain=3)
    heard: list[DraFeaturesObserved] = []

    def core(found: DraFeaturesObserved) -> None:
        # What the core answers: the pool the cluster can keep.
        heard.append(found)
        if found.partitionable is not None:
            run.publisher.publish(rich if found.partitionable else safe)

    emulator.disabled_features = frozenset({"DRAPartitionableDevices"})
    run = Running(emulator, on_features=core, relearn=0.5)
    try:
        publisher = run.start()
        publisher.publish(rich)  # what the core computes before anything is known
        await until(lambda: matches(emulator, safe))
        assert heard[0] == DraFeaturesObserved(partitionable=False, device_taints=True)
        assert emulator.dry_runs[("create", "resourceslices")] == 1
        assert emulator.requests[("create", "resourceslices")] == 1  # the safe pool's slice

        emulator.disabled_features = frozenset()  # the cluster upgraded to 1.36
        await until(lambda: matches_without(emulator, rich, ()), timeout=5)
        assert heard[-1].partitionable is True
        assert emulator.dry_runs[("create", "resourceslices")] >= 2
        history = [
            e.object for e in emulator.store.events_since(0) if e.resource == "resourceslices"
        ]
        assert weakened(history) == []
    finally:
        await run.close()


async def test_a_refused_dry_run_is_reported_as_unknown_and_the_pool_still_written(
    emulator: ApiServerEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    heard: list[DraFeaturesObserved] = []
    run = Running(emulator, on_features=heard.append)
    try:
        emulator.fail_next("create", "resourceslices", 400)  # a webhook refusing dry runs
        publisher = run.start()
        publisher.publish(pool(plain=3))
        await until(lambda: matches(emulator, pool(plain=3)))
        assert heard[0].unknown is not None and "400" in heard[0].unknown
        assert heard[0].partitionable is None and heard[0].device_taints is None
        assert any(r.getMessage() == "dra-feature-probe-refused" for r in caplog.records)
    finally:
        await run.close()


async def test_without_leave_to_watch_nodes_the_deleted_node_is_read_until_it_returns(
    emulator: ApiServerEmulator, running: Running
) -> None:
    """An RBAC of an older dp lets it get its Node but not list or watch it."""
    content = pool(plain=3)
    publisher = running.start()
    publisher.publish(content)
    await until(lambda: matches(emulator, content))
    emulator.fail_next("list", "nodes", 403)
    emulator.delete_node(NODE)
    await until(lambda: publisher.node_present is False)
    await until(lambda: emulator.requests[("list", "nodes")] == 1)
    gets = emulator.requests[("get", "nodes")]
    emulator.add_node(NODE)
    await until(lambda: matches(emulator, content) and owner_uids(emulator) == {node_uid(emulator)})
    assert emulator.requests[("get", "nodes")] > gets
    assert emulator.requests[("watch", "nodes")] == 0
