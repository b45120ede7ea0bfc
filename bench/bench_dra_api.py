"""What dp's ResourceSlice publisher asks of the API server, against the API-server emulator.

(a) API writes over a steady period with nothing changing (the target is 0
    over 10 minutes: `--duration 600`, the default);
(b) API calls per node per hour in that steady state (the watch ended and
    opened again every 300-600 s, as in production, and the re-list after a
    410 when the emulator compacts its history every `--compact-every` s, as
    kube-apiserver's etcd compaction does every 5 minutes, while other nodes
    write `--churn` times a second), the dry runs that ask for the cluster's
    features again every 30 minutes, and what that makes for 5,000 nodes;
(c) time from a pool content change (`publish`) to the new generation being
    complete on the emulator, median and p99, for a pool of one slice and one
    of five;
(d) writes per health change: a device tainted and untainted (a cluster with
    DRADeviceTaints), and a device left out and put back (without);
(e) time from a Node's return (deleted, its slices taken by the emulator's
    garbage collector, registered again with a new UID) to a complete pool
    owned by the new Node, and from a kubelet's wipe of its node's slices at
    its start to a complete pool again; and the writes each takes.

The publisher and the emulator share one event loop in this process, as in the tests.

    python3 bench/bench_dra_api.py            # 600 s steady period
    python3 bench/bench_dra_api.py --quick    # 20 s, watch periods of 2-4 s
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dp_core.dra.pool_content import DeviceTaint, PoolContent, PoolDevice  # noqa: E402
from dp_server.dra.api import KubeApi  # noqa: E402
from dp_server.dra.pacing import RepairPacer  # noqa: E402
from dp_server.dra.slices import SlicePublisher  # noqa: E402
from dp_testing.apiserver import ApiServerEmulator  # noqa: E402
from dp_testing.apiserver.store import Event  # noqa: E402

SCHEMA = Path(__file__).resolve().parent.parent / "tests" / "data" / "k8s"
SCHEMA = SCHEMA / "resource.k8s.io-v1.schema.json"
DRIVER = "vfio.dp.example.com"
NODE = "bench-node"


def content(devices: int, unhealthy: int = -1, *, taint: bool = False) -> PoolContent:
    """`devices` GPUs; `unhealthy` (if >= 0) is left out, as a health change does
    without device taints, or with `taint` tainted NoSchedule."""
    return PoolContent(
        driver=DRIVER,
        pool=NODE,
        node_name=NODE,
        devices=[
            PoolDevice(
                f"pci-0000-{i // 32:02x}-{i % 32:02x}-0",
                attributes=[
                    ("resource.kubernetes.io/pciBusID", f"0000:{i // 32:02x}:{i % 32:02x}.0"),
                    (f"{DRIVER}/resourceName", "nvidia.com/TU104GL_Tesla_T4"),
                    (f"{DRIVER}/numaNode", i % 2),
                    (f"{DRIVER}/iommuGroup", 10 + i),
                ],
                taints=[DeviceTaint(f"{DRIVER}/unhealthy")] if taint and i == unhealthy else (),
            )
            for i in range(devices)
            if i != unhealthy or taint
        ],
    )


def churn(emulator: ApiServerEmulator, writes: int) -> None:
    """Writes of other nodes' slices: the cluster's resourceVersion moves on without us,
    so after a compaction our watch's version is too old (410), as in a real cluster."""
    for _ in range(writes):
        obj = {
            "metadata": {"generateName": "other-node-"},
            "spec": {
                "driver": DRIVER,
                "nodeName": "other-node",
                "pool": {"name": "other-node", "generation": 1, "resourceSliceCount": 1},
            },
        }
        created = emulator.store.create("resourceslices", "", obj)
        emulator.store.delete("resourceslices", "", created["metadata"]["name"])


def complete(emulator: ApiServerEmulator, generation: int) -> bool:
    slices = [s for s in emulator.slices() if s["spec"].get("nodeName") == NODE]
    return bool(slices) and all(
        s["spec"]["pool"]["generation"] == generation
        and s["spec"]["pool"]["resourceSliceCount"] == len(slices)
        for s in slices
    )


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


async def steady(args: argparse.Namespace) -> dict[str, object]:
    emulator = ApiServerEmulator(schema=SCHEMA)
    await emulator.start()
    emulator.add_node(NODE)
    api = KubeApi.connect(server=emulator.url)
    publisher = SlicePublisher(api, watch_period=tuple(args.watch_period))
    task = asyncio.create_task(publisher.run())
    try:
        publisher.publish(content(args.devices))
        while not complete(emulator, 1):
            await asyncio.sleep(0.01)
        writes, calls = emulator.writes, sum(emulator.requests.values())
        dry_runs = sum(emulator.dry_runs.values())
        by_kind = dict(emulator.requests)
        client_writes = api.calls.writes
        start = time.monotonic()
        next_compaction = start + args.compact_every
        while (now := time.monotonic()) < start + args.duration:
            publisher.publish(content(args.devices))  # the same content, again and again
            churn(emulator, args.churn)
            if now >= next_compaction:
                emulator.store.compact()
                next_compaction += args.compact_every
            await asyncio.sleep(min(1.0, start + args.duration - now))
        elapsed = time.monotonic() - start
        steady_calls = sum(emulator.requests.values()) - calls
        steady_dry_runs = sum(emulator.dry_runs.values()) - dry_runs
        # The dry run that asks for the features again, once per `relearn`:
        # counted from the period, as a steady run shorter than it may hold none.
        probes_per_hour = 3600 / publisher.relearn
        per_hour = steady_calls / elapsed * 3600 + probes_per_hour
        return {
            "duration_s": round(elapsed, 1),
            "devices": args.devices,
            "slices": len([s for s in emulator.slices() if s["spec"]["nodeName"] == NODE]),
            "writes_during_steady_period": emulator.writes - writes,
            "client_counted_writes_during_steady_period": api.calls.writes - client_writes,
            "calls_during_steady_period": {
                f"{verb} {resource}": n - by_kind.get((verb, resource), 0)
                for (verb, resource), n in sorted(emulator.requests.items())
                if n - by_kind.get((verb, resource), 0)
            },
            "dry_runs_during_steady_period": steady_dry_runs,
            "dry_runs_per_node_per_hour": probes_per_hour,
            "calls_per_node_per_hour": round(per_hour, 1),
            "calls_per_hour_5000_nodes": round(per_hour * 5000),
            "calls_per_second_5000_nodes": round(per_hour * 5000 / 3600, 2),
            "watch_period_s": args.watch_period,
            "compaction_every_s": args.compact_every,
            "other_writes_per_s": args.churn,
        }
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await api.close()
        await emulator.stop()


def holds(emulator: ApiServerEmulator, wanted: PoolContent) -> bool:
    """Whether the node's pool is complete and holds exactly `wanted`'s devices."""
    slices = [s for s in emulator.slices() if s["spec"].get("nodeName") == NODE]
    names = sorted(d["name"] for s in slices for d in s["spec"].get("devices") or ())
    return complete_any(emulator) and names == sorted(d.name for d in wanted.devices)


async def latency(devices: int, changes: int) -> dict[str, object]:
    emulator = ApiServerEmulator(schema=SCHEMA)
    await emulator.start()
    emulator.add_node(NODE)
    api = KubeApi.connect(server=emulator.url)
    publisher = SlicePublisher(api)
    task = asyncio.create_task(publisher.run())
    done = asyncio.Event()
    wanted = content(devices)

    def seen(_: Event) -> None:
        if holds(emulator, wanted):
            done.set()

    unlisten = emulator.store.listen(seen)
    try:
        publisher.publish(wanted)
        await asyncio.wait_for(done.wait(), 10)
        times = []
        for change in range(changes):
            await asyncio.sleep(0.02)  # let the watch echoes settle
            done.clear()
            wanted = content(devices, unhealthy=change % devices if change % 2 == 0 else -1)
            start = time.perf_counter()
            publisher.publish(wanted)
            await asyncio.wait_for(done.wait(), 10)
            times.append(time.perf_counter() - start)
        return {
            "devices": devices,
            "slices": len(emulator.slices()),
            "changes": changes,
            "median_ms": round(statistics.median(times) * 1000, 2),
            "p99_ms": round(_p99(times) * 1000, 2),
            "max_ms": round(max(times) * 1000, 2),
            "rejected_by_schema": len(emulator.rejected),
        }
    finally:
        unlisten()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await api.close()
        await emulator.stop()


async def health_writes(devices: int, changes: int, *, taint: bool) -> dict[str, object]:
    """Writes (and generation bumps) per health change: one device unhealthy, then back."""
    emulator = ApiServerEmulator(schema=SCHEMA)
    await emulator.start()
    emulator.add_node(NODE)
    api = KubeApi.connect(server=emulator.url)
    publisher = SlicePublisher(api)
    task = asyncio.create_task(publisher.run())
    try:
        publisher.publish(content(devices))
        await until(lambda: complete(emulator, 1) and publisher.synced)
        writes, bumps = [], []
        for change in range(changes):
            wanted = content(devices, change % devices if change % 2 == 0 else -1, taint=taint)
            before, generation = emulator.writes, publisher.generation
            publisher.publish(wanted)
            await until(lambda: publisher.synced)
            writes.append(emulator.writes - before)
            bumps.append(publisher.generation - generation)
        return {
            "devices": devices,
            "slices": len(emulator.slices()),
            "health": "tainted in place" if taint else "left out",
            "changes": changes,
            "writes_per_change_median": statistics.median(writes),
            "writes_per_change_max": max(writes),
            "generation_bumps": sum(bumps),
            "rejected_by_schema": len(emulator.rejected),
        }
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await api.close()
        await emulator.stop()


async def until(check: object, timeout: float = 20.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():  # type: ignore[operator]
            await asyncio.sleep(0.005)


def owned_by(emulator: ApiServerEmulator, uid: str) -> bool:
    slices = [s for s in emulator.slices() if s["spec"].get("nodeName") == NODE]
    return bool(slices) and all(
        [r["uid"] for r in s["metadata"]["ownerReferences"]] == [uid] for s in slices
    )


async def outside(devices: int, samples: int) -> dict[str, object]:
    """A Node deleted and registered again, and a kubelet's wipe: the time to a
    complete pool again, and the requests it took. The pacer's quiet minute is
    set to 0 s so each sample is a first repair, as a routine one is."""
    emulator = ApiServerEmulator(schema=SCHEMA)
    await emulator.start()
    uid = emulator.add_node(NODE)["metadata"]["uid"]
    api = KubeApi.connect(server=emulator.url)
    publisher = SlicePublisher(api, repairs=RepairPacer(quiet=0.0))
    task = asyncio.create_task(publisher.run())
    back = asyncio.Event()
    target = ""

    def seen(_: Event) -> None:
        if target and owned_by(emulator, target) and complete_any(emulator):
            back.set()

    unlisten = emulator.store.listen(seen)
    try:
        publisher.publish(content(devices))
        await until(lambda: owned_by(emulator, uid) and publisher.synced)
        returns, wipes = [], []
        node_calls: dict[str, int] = {}
        for _ in range(samples):
            emulator.delete_node(NODE)
            await until(lambda: publisher.node_present is False and not emulator.slices())
            calls = dict(emulator.requests)
            back.clear()
            start = time.perf_counter()
            target = emulator.add_node(NODE)["metadata"]["uid"]
            await asyncio.wait_for(back.wait(), 20)
            returns.append(time.perf_counter() - start)
            await until(lambda: publisher.synced)
            for (verb, resource), n in emulator.requests.items():
                key = f"{verb} {resource}"
                node_calls[key] = node_calls.get(key, 0) + n - calls.get((verb, resource), 0)
        wiped_writes = []
        for _ in range(samples):
            await asyncio.sleep(0.05)
            before = emulator.writes
            back.clear()
            start = time.perf_counter()
            for obj in emulator.slices():  # DeleteCollection by spec.nodeName, as the kubelet
                emulator.store.delete("resourceslices", "", obj["metadata"]["name"])
            await asyncio.wait_for(back.wait(), 20)
            wipes.append(time.perf_counter() - start)
            await until(lambda: publisher.synced)
            wiped_writes.append(emulator.writes - before)
        return {
            "devices": devices,
            "slices": len(emulator.slices()),
            "samples": samples,
            "node_return_to_complete_pool_median_ms": round(statistics.median(returns) * 1000, 2),
            "node_return_to_complete_pool_p99_ms": round(_p99(returns) * 1000, 2),
            "requests_per_node_return": {k: v / samples for k, v in sorted(node_calls.items())},
            "kubelet_wipe_to_complete_pool_median_ms": round(statistics.median(wipes) * 1000, 2),
            "kubelet_wipe_to_complete_pool_p99_ms": round(_p99(wipes) * 1000, 2),
            "writes_per_kubelet_wipe": statistics.median(wiped_writes),
            "rejected_by_schema": len(emulator.rejected),
        }
    finally:
        unlisten()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await api.close()
        await emulator.stop()


def complete_any(emulator: ApiServerEmulator) -> bool:
    slices = [s for s in emulator.slices() if s["spec"].get("nodeName") == NODE]
    generations = {s["spec"]["pool"]["generation"] for s in slices}
    return len(generations) == 1 and all(
        s["spec"]["pool"]["resourceSliceCount"] == len(slices) for s in slices
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="steady period, seconds")
    parser.add_argument("--quick", action="store_true", help="20 s steady, short watch periods")
    parser.add_argument("--devices", type=int, default=16)
    parser.add_argument("--watch-period", type=float, nargs=2, default=[300.0, 600.0])
    parser.add_argument("--compact-every", type=float, default=300.0)
    parser.add_argument(
        "--churn", type=int, default=1, help="other nodes' writes per second in the cluster"
    )
    parser.add_argument("--changes", type=int, default=200)
    parser.add_argument("--samples", type=int, default=50, help="Node returns and kubelet wipes")
    args = parser.parse_args()
    if args.quick:
        args.duration, args.watch_period, args.compact_every = 20.0, [2.0, 4.0], 10.0
        args.changes = min(args.changes, 100)
        args.samples = min(args.samples, 20)
    result = {
        "steady": await steady(args),
        "change_to_visible": [
            await latency(args.devices, args.changes),
            await latency(300, args.changes),
        ],
        "writes_per_health_change": [
            await health_writes(args.devices, 20, taint=True),
            await health_writes(300, 20, taint=True),
            await health_writes(args.devices, 20, taint=False),
            await health_writes(300, 20, taint=False),
        ],
        "outside_changes": [
            await outside(args.devices, args.samples),
            await outside(300, args.samples),
        ],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
