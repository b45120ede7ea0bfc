"""The API-server emulator's REST conventions, over plain HTTP (httpx2, not dp's client)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from dp_testing.apiserver import ApiServerEmulator, Scheduler

SCHEMA = Path(__file__).parent / "data" / "k8s" / "resource.k8s.io-v1.schema.json"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/vms/resourceclaims"


def a_slice(
    node: str = "node-a", driver: str = "vfio.dp.example.com", **spec: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "driver": driver,
        "nodeName": node,
        "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
        "devices": [{"name": "gpu-0", "attributes": {"numa": {"int": 0}}}],
    }
    body.update(spec)
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"generateName": f"{node}-"},
        "spec": body,
    }


@pytest.fixture
async def server() -> AsyncIterator[ApiServerEmulator]:
    emulator = ApiServerEmulator(schema=SCHEMA)
    await emulator.start()
    yield emulator
    await emulator.stop()


@pytest.fixture
async def http(server: ApiServerEmulator) -> AsyncIterator[httpx2.AsyncClient]:
    async with httpx2.AsyncClient(base_url=server.url, timeout=5) as client:
        yield client


async def test_generate_name_uid_version_and_generation(http: httpx2.AsyncClient) -> None:
    created = await http.post(SLICES, json=a_slice())
    assert created.status_code == 201
    meta = created.json()["metadata"]
    assert meta["name"].startswith("node-a-") and len(meta["name"]) == len("node-a-") + 5
    assert meta["uid"] and meta["generation"] == 1 and int(meta["resourceVersion"]) > 0
    again = await http.get(f"{SLICES}/{meta['name']}")
    assert again.json()["metadata"] == meta


async def test_an_update_with_a_stale_resource_version_is_a_conflict(
    http: httpx2.AsyncClient,
) -> None:
    obj = (await http.post(SLICES, json=a_slice())).json()
    url = f"{SLICES}/{obj['metadata']['name']}"
    obj["spec"]["pool"]["generation"] = 2
    updated = await http.put(url, json=obj)
    assert updated.status_code == 200
    assert updated.json()["metadata"]["generation"] == 2  # the spec changed

    stale = await http.put(url, json=obj)  # still the old resourceVersion
    assert stale.status_code == 409
    assert stale.json()["reason"] == "Conflict" and stale.json()["kind"] == "Status"

    same = await http.put(url, json=updated.json())
    assert same.json()["metadata"]["generation"] == 2  # no spec change, no new generation
    assert (
        same.json()["metadata"]["resourceVersion"] != updated.json()["metadata"]["resourceVersion"]
    )


async def test_list_by_field_selector(http: httpx2.AsyncClient) -> None:
    await http.post(SLICES, json=a_slice("node-a"))
    await http.post(SLICES, json=a_slice("node-b"))
    await http.post(SLICES, json=a_slice("node-a", driver="gpu.example.com"))

    listed = await http.get(
        SLICES, params={"fieldSelector": "spec.nodeName=node-a,spec.driver=vfio.dp.example.com"}
    )
    assert listed.json()["kind"] == "ResourceSliceList"
    assert int(listed.json()["metadata"]["resourceVersion"]) == 3
    assert [(i["spec"]["nodeName"], i["spec"]["driver"]) for i in listed.json()["items"]] == [
        ("node-a", "vfio.dp.example.com")
    ]
    others = await http.get(SLICES, params={"fieldSelector": "spec.nodeName!=node-a"})
    assert [i["spec"]["nodeName"] for i in others.json()["items"]] == ["node-b"]
    bad = await http.get(SLICES, params={"fieldSelector": "spec.pool.name=node-a"})
    assert bad.status_code == 400 and "field label not supported" in bad.json()["message"]


async def _events(
    http: httpx2.AsyncClient, params: dict[str, str], count: int
) -> list[dict[str, Any]]:
    events = []
    async with http.stream("GET", SLICES, params={"watch": "true", **params}) as answer:
        assert answer.status_code == 200
        async for line in answer.aiter_lines():
            events.append(json.loads(line))
            if len(events) == count:
                break
    return events


async def test_watch_from_a_version_and_from_now(
    server: ApiServerEmulator, http: httpx2.AsyncClient
) -> None:
    first = (await http.post(SLICES, json=a_slice("node-a"))).json()
    version = first["metadata"]["resourceVersion"]
    await http.post(SLICES, json=a_slice("node-b"))
    await http.delete(f"{SLICES}/{first['metadata']['name']}")

    after = await _events(http, {"resourceVersion": version}, 2)
    assert [(e["type"], e["object"]["spec"]["nodeName"]) for e in after] == [
        ("ADDED", "node-b"),
        ("DELETED", "node-a"),
    ]
    assert after[0]["object"]["kind"] == "ResourceSlice"

    # No version: what exists now, as ADDED, then what follows.
    watching = asyncio.create_task(_events(http, {"fieldSelector": "spec.nodeName=node-b"}, 2))
    await asyncio.sleep(0.1)
    current = (await http.get(SLICES)).json()["items"][0]
    current["spec"]["pool"]["generation"] = 5
    await http.put(f"{SLICES}/{current['metadata']['name']}", json=current)
    events = await asyncio.wait_for(watching, 5)
    assert [e["type"] for e in events] == ["ADDED", "MODIFIED"]
    assert events[1]["object"]["spec"]["pool"]["generation"] == 5


async def test_watch_ends_after_timeout_seconds(http: httpx2.AsyncClient) -> None:
    start = time.monotonic()
    async with http.stream("GET", SLICES, params={"watch": "1", "timeoutSeconds": "0.3"}) as answer:
        lines = [line async for line in answer.aiter_lines()]
    assert lines == []
    assert 0.25 < time.monotonic() - start < 3


async def test_a_compacted_version_is_gone_and_open_watches_expire(
    server: ApiServerEmulator, http: httpx2.AsyncClient
) -> None:
    obj = (await http.post(SLICES, json=a_slice())).json()
    watching = asyncio.create_task(
        _events(http, {"resourceVersion": obj["metadata"]["resourceVersion"]}, 2)
    )
    await asyncio.sleep(0.1)
    await http.post(SLICES, json=a_slice("node-b"))  # the watch's next event...
    server.expire_watches()  # ...is forgotten
    added, gone = await asyncio.wait_for(watching, 5)
    assert added["type"] == "ADDED"
    assert gone["type"] == "ERROR" and gone["object"]["code"] == 410

    (old,) = await _events(http, {"resourceVersion": "1"}, 1)
    assert old["type"] == "ERROR" and old["object"]["reason"] == "Expired"


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        (
            lambda s: s["spec"].update(devices=[{"name": f"d{i}"} for i in range(129)]),
            "129 devices",
        ),
        (
            lambda s: s["spec"].update(
                devices=[
                    {"name": f"d{i}", "taints": [{"key": "k", "effect": "NoSchedule"}]}
                    for i in range(65)
                ]
            ),
            "at most 64",
        ),
        (
            lambda s: s["spec"].update(sharedCounters=[{"name": "g", "counters": {}}]),
            "only one of `sharedCounters` or `devices`",
        ),
        (lambda s: s["spec"]["devices"][0].update(name="GPU_0"), "is not a DNS label"),
        (lambda s: s["spec"]["devices"][0].update(colour="red"), "colour"),
        (lambda s: s["spec"]["pool"].pop("generation"), "'generation' is a required property"),
        (lambda s: s["spec"].update(allNodes=True), "exactly one of"),
    ],
)
async def test_objects_are_checked_against_the_schema_and_the_rules(
    server: ApiServerEmulator, http: httpx2.AsyncClient, change: Any, complaint: str
) -> None:
    obj = a_slice()
    change(obj)
    answer = await http.post(SLICES, json=obj)
    assert answer.status_code == 422, answer.text
    assert complaint in answer.json()["message"]
    assert server.rejected and complaint in server.rejected[0][1]
    assert server.slices() == []


async def test_taints_get_their_time_added(http: httpx2.AsyncClient) -> None:
    obj = a_slice()
    obj["spec"]["devices"][0]["taints"] = [{"key": "k", "effect": "NoSchedule"}]
    created = (await http.post(SLICES, json=obj)).json()
    assert created["spec"]["devices"][0]["taints"][0]["timeAdded"].endswith("Z")


async def test_faults_delay_unavailability_and_injected_codes(
    server: ApiServerEmulator, http: httpx2.AsyncClient
) -> None:
    server.delay = 0.3
    start = time.monotonic()
    assert (await http.get(SLICES)).status_code == 200
    assert time.monotonic() - start >= 0.3
    server.delay = 0

    server.unavailable = True
    assert (await http.get(SLICES)).status_code == 503
    server.unavailable = False

    server.fail_next("create", "resourceslices", 500)
    assert (await http.post(SLICES, json=a_slice())).status_code == 500
    assert (await http.post(SLICES, json=a_slice())).status_code == 201
    assert server.requests[("create", "resourceslices")] == 2
    # The 503 came from in front of the API: it was never served as a list.
    assert server.requests[("list", "resourceslices")] == 1

    await server.stop()
    with pytest.raises(httpx2.ConnectError):
        await http.get(SLICES)
    await server.start()
    assert (await http.get(SLICES)).status_code == 200


async def test_nodes_and_claims(server: ApiServerEmulator, http: httpx2.AsyncClient) -> None:
    node = server.add_node("node-a")
    got = await http.get("/api/v1/nodes/node-a")
    assert got.json()["metadata"]["uid"] == node["metadata"]["uid"]
    assert got.json()["kind"] == "Node"
    assert (await http.get("/api/v1/nodes/node-z")).status_code == 404

    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "gpu"},
        "spec": {"devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": "t4"}}]}},
    }
    created = (await http.post(CLAIMS, json=claim)).json()
    assert created["metadata"]["namespace"] == "vms"
    created["status"] = {
        "allocation": {
            "devices": {
                "results": [
                    {
                        "request": "r",
                        "driver": "vfio.dp.example.com",
                        "pool": "node-a",
                        "device": "gpu-0",
                    }
                ]
            }
        }
    }
    created["spec"] = {"devices": {}}  # the status subresource ignores the spec
    status = await http.put(f"{CLAIMS}/gpu/status", json=created)
    assert status.status_code == 200, status.text
    got_claim = (await http.get(f"{CLAIMS}/gpu")).json()
    assert got_claim["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu-0"
    assert got_claim["spec"]["devices"]["requests"][0]["name"] == "r"
    assert (
        await http.get("/apis/resource.k8s.io/v1/namespaces/other/resourceclaims/gpu")
    ).status_code == 404


async def test_the_garbage_collector_takes_what_a_deleted_node_owned(
    server: ApiServerEmulator, http: httpx2.AsyncClient
) -> None:
    node = server.add_node("node-a")
    uid = node["metadata"]["uid"]
    owned = a_slice()
    owned["metadata"]["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "Node", "name": "node-a", "uid": uid, "controller": True}
    ]
    kept = a_slice("node-b")  # owned by nobody
    assert (await http.post(SLICES, json=owned)).status_code == 201
    assert (await http.post(SLICES, json=kept)).status_code == 201

    assert (await http.delete("/api/v1/nodes/node-a")).status_code == 200
    assert len(server.slices()) == 2  # the collector comes a moment later
    await asyncio.sleep(server.gc_delay + 0.1)
    assert [s["spec"]["nodeName"] for s in server.slices()] == ["node-b"]
    assert [c[0] for c in server.collected] == ["resourceslices"]

    again = server.add_node("node-a")
    assert again["metadata"]["uid"] != uid  # registered again: another Node
    listed = await http.get("/api/v1/nodes", params={"fieldSelector": "metadata.name=node-a"})
    assert [n["metadata"]["uid"] for n in listed.json()["items"]] == [again["metadata"]["uid"]]


async def test_an_object_with_a_living_owner_is_not_collected(
    server: ApiServerEmulator, http: httpx2.AsyncClient
) -> None:
    first, second = server.add_node("node-a"), server.add_node("node-b")
    owned = a_slice()
    owned["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "v1",
            "kind": "Node",
            "name": n["metadata"]["name"],
            "uid": n["metadata"]["uid"],
        }
        for n in (first, second)
    ]
    assert (await http.post(SLICES, json=owned)).status_code == 201
    server.delete_node("node-a")
    await asyncio.sleep(server.gc_delay + 0.1)
    assert len(server.slices()) == 1


async def test_delete_collection_by_field_selector(
    server: ApiServerEmulator, http: httpx2.AsyncClient
) -> None:
    for node in ("node-a", "node-a", "node-b"):
        await http.post(SLICES, json=a_slice(node))
    wiped = await http.delete(SLICES, params={"fieldSelector": "spec.nodeName=node-a"})
    assert wiped.status_code == 200 and wiped.json()["kind"] == "ResourceSliceList"
    assert len(wiped.json()["items"]) == 2
    assert [s["spec"]["nodeName"] for s in server.slices()] == ["node-b"]


async def test_a_late_answer_and_a_garbled_one(
    server: ApiServerEmulator, http: httpx2.AsyncClient
) -> None:
    server.delay_answer("create", "resourceslices", 0.3)
    heard: list[float] = []

    async def watch() -> None:
        async with http.stream("GET", SLICES, params={"watch": "true"}) as answer:
            async for _ in answer.aiter_lines():
                heard.append(time.monotonic())
                return

    watching = asyncio.create_task(watch())
    await asyncio.sleep(0.1)
    start = time.monotonic()
    created = await http.post(SLICES, json=a_slice())
    answered = time.monotonic()
    await asyncio.wait_for(watching, 5)
    assert created.status_code == 201 and answered - start >= 0.3
    # Stored at once: the watch heard of it well before the answer came.
    assert heard[0] < answered - 0.2

    server.garble_next("list", "resourceslices")
    garbled = await http.get(SLICES)
    assert garbled.status_code == 200 and not garbled.text.startswith("{")
    assert (await http.get(SLICES)).json()["kind"] == "ResourceSliceList"


async def test_a_dry_run_answers_as_a_write_and_stores_nothing(
    server: ApiServerEmulator, http: httpx2.AsyncClient
) -> None:
    server.disabled_features = frozenset({"DRADeviceTaints"})
    obj = a_slice()
    obj["spec"]["devices"][0]["taints"] = [{"key": "k", "effect": "NoSchedule"}]
    heard: list[str] = []

    async def watch() -> None:
        async with http.stream("GET", SLICES, params={"watch": "true"}) as answer:
            async for line in answer.aiter_lines():
                heard.append(json.loads(line)["type"])

    watching = asyncio.create_task(watch())
    await asyncio.sleep(0.1)
    dry = await http.post(SLICES, json=obj, params={"dryRun": "All"})
    assert dry.status_code == 201
    meta = dry.json()["metadata"]
    # As the real answer: a name and a UID, generation 1, no resourceVersion,
    # and the fields of a disabled feature dropped.
    assert meta["name"].startswith("node-a-") and meta["uid"] and meta["generation"] == 1
    assert "resourceVersion" not in meta
    assert "taints" not in dry.json()["spec"]["devices"][0]
    await asyncio.sleep(0.2)
    watching.cancel()
    assert server.slices() == [] and heard == [] and server.store.version == 0
    assert server.dry_runs[("create", "resourceslices")] == 1 and server.writes == 0

    created = (await http.post(SLICES, json=a_slice())).json()
    url = f"{SLICES}/{created['metadata']['name']}"
    changed = {
        **created,
        "spec": {**created["spec"], "pool": {**created["spec"]["pool"], "generation": 9}},
    }
    dry_update = await http.put(url, json=changed, params={"dryRun": "All"})
    assert dry_update.status_code == 200
    assert (
        dry_update.json()["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]
    )
    assert dry_update.json()["metadata"]["generation"] == 2
    assert (await http.delete(url, params={"dryRun": "All"})).status_code == 200
    (kept,) = server.slices()
    assert kept["spec"]["pool"]["generation"] == 1
    # What a real write would refuse, a dry run refuses; and only All is a dry run.
    bad = a_slice()
    bad["spec"]["devices"][0]["name"] = "Not_A_Label"
    assert (await http.post(SLICES, json=bad, params={"dryRun": "All"})).status_code == 422
    other = await http.post(SLICES, json=a_slice(), params={"dryRun": "Some"})
    assert other.status_code == 422 and "supported values" in other.json()["message"]


async def test_events_are_checked_and_kept(
    server: ApiServerEmulator, http: httpx2.AsyncClient
) -> None:
    events = "/apis/events.k8s.io/v1/namespaces/vms/events"
    event = {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"name": "gpu.1"},
        "eventTime": "2026-01-01T00:00:00.000001Z",
        "type": "Warning",
        "reason": "IOMMUGroupHeld",
        "action": "NodePrepareResources",
        "reportingController": "vfio.dp.example.com",
        "reportingInstance": "vfio.dp.example.com-node-a",
        "regarding": {"kind": "ResourceClaim", "name": "gpu", "namespace": "vms"},
        "note": "held",
    }
    assert (await http.post(events, json=event)).status_code == 201
    (kept,) = server.store.objects("events", "vms")
    assert kept["metadata"]["namespace"] == "vms"
    for change, complaint in [
        ({"eventTime": "2026-01-01T00:00:00Z"}, "RFC3339Micro"),
        ({"reason": ""}, "reason: Required value"),
        ({"type": "Bad"}, "type: Unsupported"),
        ({"regarding": {"kind": "ResourceClaim", "name": "gpu", "namespace": "x"}}, "regarding"),
    ]:
        answer = await http.post(events, json={**event, "metadata": {"name": "e"}, **change})
        assert answer.status_code == 422 and complaint in answer.json()["message"], answer.text


async def test_the_scheduler_allocates_from_complete_pools_within_counters_and_taints(
    server: ApiServerEmulator, http: httpx2.AsyncClient
) -> None:
    def claim(name: str) -> None:
        server.store.create(
            "resourceclaims",
            "vms",
            {"metadata": {"name": name}, "spec": {"devices": {"requests": [{"name": "r"}]}}},
        )

    def pool(generation: int, count: int, **spec: Any) -> dict[str, Any]:
        obj = a_slice(**spec)
        obj["spec"]["pool"] = {
            "name": "node-a",
            "generation": generation,
            "resourceSliceCount": count,
        }
        return obj

    scheduler = Scheduler(server)
    try:
        for name in ("a", "b", "c"):
            claim(name)
            scheduler.wait("vms", name, {"r": lambda d: d.name.startswith("gpu")})
        devices = [
            {
                "name": "gpu-0",
                "consumesCounters": [{"counterSet": "g", "counters": {"slot": {"value": "1"}}}],
            },
            {
                "name": "gpu-1",
                "consumesCounters": [{"counterSet": "g", "counters": {"slot": {"value": "1"}}}],
            },
            {"name": "gpu-2", "taints": [{"key": "k", "effect": "NoSchedule"}]},
        ]
        await http.post(SLICES, json=pool(1, 2, devices=devices))
        await asyncio.sleep(0.05)
        assert scheduler.allocated == {}  # one slice of two: not a complete pool
        counters = pool(1, 2, sharedCounters=[{"name": "g", "counters": {"slot": {"value": "1"}}}])
        del counters["spec"]["devices"]
        await http.post(SLICES, json=counters)
        await asyncio.sleep(0.05)
        # One of the counter's members, and not the tainted device.
        assert scheduler.allocated == {
            ("vms", "a"): [("r", "vfio.dp.example.com", "node-a", "gpu-0")]
        }
        claim_a = server.store.get("resourceclaims", "vms", "a")
        assert claim_a["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu-0"
        assert set(scheduler.waiting) == {("vms", "b"), ("vms", "c")}
    finally:
        scheduler.close()

    # Without the gates, counters and taints mean nothing to the allocator.
    server.disabled_features = frozenset({"DRAPartitionableDevices", "DRADeviceTaints"})
    scheduler = Scheduler(server)
    try:
        claim("d")
        scheduler.wait("vms", "d", {"r": lambda d: d.name.startswith("gpu")})
        claim("e")
        scheduler.wait("vms", "e", {"r": lambda d: d.name.startswith("gpu")})
        await asyncio.sleep(0.05)
        assert [d for got in scheduler.allocated.values() for *_, d in got] == ["gpu-1", "gpu-2"]
    finally:
        scheduler.close()
