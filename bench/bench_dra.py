#!/usr/bin/env python3
"""Benchmark `dp-server serve` as a DRA driver, end to end, against the emulators.

The server runs as its own process (`python -m dp_server serve` with a config
whose devices are `frontend: dra`), pointed by a kubeconfig at the API-server
emulator (`dp_testing.apiserver.ApiServerEmulator`, on its own event loop in a
thread of this process) and served by the grpcio DRA kubelet emulator
(`dp_testing.dra_kubelet.DraKubeletEmulator`, also in this process). The host
is generated: `--ids` vendor:device IDs x `--functions` functions, each
function alone in its IOMMU group, plus `--multi-groups` IOMMU groups of two
functions each (default 8 x 64 + 4 x 2 = 520 devices).

It measures the two speed targets that need the whole server (docs/benchmarks.md, "Targets"):

1. NodePrepareResources as the kubelet emulator sees it (the server's GET of
   the claim from the API emulator, the ledger, the claim's CDI spec and
   KEP-5304 metadata files, the checkpoint) for `--claims` claims of one
   distinct device each, all held at once, then NodeUnprepareResources of
   each; then `--batches` requests of `--batch-size` claims each, prepared and
   unprepared in one request. Every reply is checked: no error, the device
   asked, and the claim's CDI spec file on disk (gone after Unprepare).
   Target: p99 < 50 ms.
2. Health change -> slice update: with the server idle and its pool
   published, the device's /dev/vfio/<group> node is removed from the fake
   /dev (which the server watches), and the time is taken until the API
   emulator holds a complete pool generation in which the device is gone or
   tainted; then the node is put back and the time taken until the device is
   back and untainted. `--health-changes` times. Target: < 200 ms.
   The same changes are timed until the kubelet emulator's health stream
   (NodeWatchResources) says the device is Unhealthy, and Healthy
   again: what the kubelet needs to write the status of a pod holding it.

The times of (2) are those of the emulator's store events (recorded by a
listener on its loop as they happen), and of the kubelet emulator's health
events (recorded by its stream's thread as each message is read), not of
when the bench looks.
bench/bench_dra_api.py measures the API writes in a steady state and the
calls per node per hour; bench/README.md describes both.

Usage: python3 bench/bench_dra.py [--claims 400] [--health-changes 20]
       [--server-python PATH] [--share-cpus] [--json results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serve import (  # noqa: E402
    CLASS_CODE,
    VENDOR,
    BenchError,
    add_server_python,
    allowed_cpus,
    bench_topology,
    collected_before,
    cpu_split,
    describe_cpus,
    pin,
    print_log_tail,
    proc_cpu_ns,
    proc_snapshot,
    resource_names,
    serve_command,
    server_env,
    source_version,
    stop_server,
    summary,
    warm_page_cache,
)

from dp_core import VFIO_DRIVER, PciAddress  # noqa: E402
from dp_testing.apiserver import ApiServerEmulator  # noqa: E402
from dp_testing.apiserver.store import Event  # noqa: E402
from dp_testing.dra_kubelet import Claim, DraKubeletEmulator  # noqa: E402
from dp_testing.topology import FakePci, Topology, write_sysfs  # noqa: E402

SCHEMA = Path(__file__).resolve().parent.parent / "tests" / "data" / "k8s"
SCHEMA = SCHEMA / "resource.k8s.io-v1.schema.json"
DRIVER = "vfio.dp.example.com"
NODE = "bench-node"
NAMESPACE = "default"
TARGETS = {"prepare_p99_ms": 50.0, "health_ms": 200.0}
# How often the bench looks at the store events while it waits; the times
# come from the events themselves.
POLL = 0.001

T = TypeVar("T")


# ---------------------------------------------------------------------------
# The host and the config


def dra_topology(n_ids: int, n_functions: int, multi_groups: int) -> Topology:
    """bench_serve's host (one function per group), plus `multi_groups` groups of
    two functions (a device and its audio function, say) under one more ID."""
    base = bench_topology(n_ids, n_functions)
    first_group = n_ids * n_functions
    extra = [
        FakePci(
            address=PciAddress(0, n_ids + 1, g, f),
            vendor=VENDOR,
            device=0x1000 + n_ids,
            class_code=CLASS_CODE,
            driver=VFIO_DRIVER,
            group=first_group + g,
            numa=g % 2,
        )
        for g in range(multi_groups)
        for f in range(2)
    ]
    nodes = set(base.dev_nodes) | {f"/dev/vfio/{first_group + g}" for g in range(multi_groups)}
    return Topology(pci=[*base.pci, *extra], dev_nodes=nodes)  # type: ignore[arg-type]


def dra_config(n_ids: int) -> str:
    lines = [f"dra: {{driverName: {DRIVER}}}", "permittedHostDevices:", "  pciHostDevices:"]
    for i, name in enumerate(resource_names(n_ids)):
        lines.append(f'    - pciVendorSelector: "{VENDOR:04X}:{0x1000 + i:04X}"')
        lines.append(f'      resourceName: "{name}"')
        lines.append("      frontend: dra")
    lines += [
        "sharedDevices:",
        "  devices.kubevirt.io/kvm: {enabled: false}",
        "  devices.kubevirt.io/tun: {enabled: false}",
        "  devices.kubevirt.io/vhost-net: {enabled: false}",
    ]
    return "\n".join(lines) + "\n"


def kubeconfig(url: str) -> str:
    """A kubeconfig naming the emulator's plain-http URL, with no credentials."""
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "emulator", "cluster": {"server": url}}],
            "users": [{"name": "bench", "user": {}}],
            "contexts": [{"name": "bench", "context": {"cluster": "emulator", "user": "bench"}}],
            "current-context": "bench",
        },
        indent=1,
    )


# ---------------------------------------------------------------------------
# The API-server emulator on a loop of its own


class ApiThread:
    """The emulator served by an event loop in a thread; its store read and
    written only on that loop, through `call`. Store events are kept with the
    time they happened (`perf_counter`), for the bench to read at leisure."""

    def __init__(self, schema: Path | None) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="api-emulator")
        self._thread.daemon = True
        self._thread.start()
        self.api = ApiServerEmulator(schema=schema)
        self.events: list[tuple[float, Event]] = []  # appended on the loop (one op, GIL-safe)
        self.run(self.api.start())
        self.call(lambda: self.api.add_node(NODE))
        self.call(lambda: self.api.store.listen(self._seen))

    def _seen(self, event: Event) -> None:
        if event.resource == "resourceslices":
            self.events.append((time.perf_counter(), event))

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], T]) -> T:
        async def wrapped() -> T:
            return fn()

        return self.run(wrapped())

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.run(self.api.stop(), timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


class Pool:
    """The node's pool as the store's slice events build it, event by event."""

    def __init__(self) -> None:
        self.slices: dict[str, dict[str, Any]] = {}
        self.seen = 0  # events of ApiThread.events applied

    def apply(self, event: Event) -> None:
        obj = event.object
        if obj.get("spec", {}).get("nodeName") != NODE:
            return
        name = obj["metadata"]["name"]
        if event.type == "DELETED":
            self.slices.pop(name, None)
        else:
            self.slices[name] = obj

    def current(self) -> dict[str, dict[str, Any]] | None:
        """Device name -> device of the newest generation, if it is complete."""
        if not self.slices:
            return None
        top = max(s["spec"]["pool"]["generation"] for s in self.slices.values())
        newest = [s for s in self.slices.values() if s["spec"]["pool"]["generation"] == top]
        if len(newest) != newest[0]["spec"]["pool"]["resourceSliceCount"]:
            return None
        return {d["name"]: d for s in newest for d in s["spec"].get("devices") or ()}

    def until(
        self,
        events: list[tuple[float, Event]],
        check: Callable[[dict[str, dict[str, Any]]], bool],
        timeout: float,
    ) -> float | None:
        """The time of the first event after which `check` holds of the pool."""
        deadline = time.monotonic() + timeout
        while True:
            while self.seen < len(events):
                at, event = events[self.seen]
                self.seen += 1
                self.apply(event)
                current = self.current()
                if current is not None and check(current):
                    return at
            if time.monotonic() > deadline:
                return None
            time.sleep(POLL)


def state_of(device: dict[str, Any] | None) -> str:
    if device is None:
        return "removed"
    return "tainted" if device.get("taints") else "healthy"


def attribute(device: dict[str, Any], key: str) -> Any:
    # Unqualified names are in the driver's domain (dp_core.dra.names).
    attributes = device.get("attributes", {})
    value = attributes.get(key) or attributes.get(f"{DRIVER}/{key}") or {}
    return next(iter(value.values()), None)


# ---------------------------------------------------------------------------
# The run


def make_claims(api: ApiThread, prefix: str, devices: Sequence[str]) -> list[Claim]:
    """One claim per device in the API emulator, allocated that device on this node."""

    def create() -> list[Claim]:
        out = []
        for i, device in enumerate(devices):
            obj = {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": f"{prefix}-{i}", "namespace": NAMESPACE},
                "spec": {
                    "devices": {
                        "requests": [{"name": "dev", "exactly": {"deviceClassName": "vfio"}}]
                    }
                },
                "status": {
                    "allocation": {
                        "devices": {
                            "results": [
                                {"request": "dev", "driver": DRIVER, "pool": NODE, "device": device}
                            ]
                        }
                    }
                },
            }
            created = api.api.store.create("resourceclaims", NAMESPACE, obj)
            out.append(Claim(NAMESPACE, created["metadata"]["uid"], obj["metadata"]["name"]))
        return out

    return api.call(create)


def spec_path(cdi: Path, claim: Claim) -> Path:
    # dp_server.cdi.claim_files: <driver>_claim_<UID>.json
    return cdi / f"{DRIVER}_claim_{claim.uid}.json"


def check_prepared(
    results: dict[str, Any], claims: Sequence[Claim], devices: Sequence[str], cdi: Path
) -> None:
    for claim, device in zip(claims, devices, strict=True):
        got = results.get(claim.uid)
        if got is None:
            raise BenchError(f"Prepare of {claim.name}: no reply for it")
        if got.error:
            raise BenchError(f"Prepare of {claim.name} ({device}) failed: {got.error}")
        names = [(d.pool_name, d.device_name) for d in got.devices]
        if names != [(NODE, device)] or not got.devices[0].cdi_device_ids:
            raise BenchError(f"Prepare of {claim.name}: devices {got.devices}, want {device}")
        if not spec_path(cdi, claim).is_file():
            raise BenchError(f"Prepare of {claim.name}: no CDI spec {spec_path(cdi, claim)}")


def check_unprepared(errors: dict[str, str], claims: Sequence[Claim], cdi: Path) -> None:
    for claim in claims:
        if claim.uid not in errors or errors[claim.uid]:
            raise BenchError(f"Unprepare of {claim.name}: {errors.get(claim.uid, 'no reply')!r}")
        if spec_path(cdi, claim).exists():
            raise BenchError(f"Unprepare of {claim.name} left {spec_path(cdi, claim)}")


def ms(seconds: float) -> float:
    return seconds * 1000.0


def measure_claims(
    args: argparse.Namespace,
    api: ApiThread,
    kubelet: DraKubeletEmulator,
    pid: int,
    free: list[str],
    cdi: Path,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    devices = free[: args.claims]
    claims = make_claims(api, "single", devices)
    batch_devices = [free[i % len(free)] for i in range(args.batches * args.batch_size)]
    batch_claims = make_claims(api, "batch", batch_devices)
    writes0 = api.call(lambda: api.api.writes)

    prepare, unprepare = [], []
    with collected_before():
        cpu0 = proc_cpu_ns(pid)
        for claim, device in zip(claims, devices, strict=True):
            t0 = time.perf_counter()
            result = kubelet.prepare(DRIVER, [claim])
            prepare.append(ms(time.perf_counter() - t0))
            check_prepared(result, [claim], [device], cdi)
        cpu1 = proc_cpu_ns(pid)
        out["proc_all_prepared"] = proc_snapshot(pid)
        for claim in claims:
            t0 = time.perf_counter()
            errors = kubelet.unprepare(DRIVER, [claim])
            unprepare.append(ms(time.perf_counter() - t0))
            check_unprepared(errors, [claim], cdi)
        cpu2 = proc_cpu_ns(pid)
    out["prepare_ms"], out["unprepare_ms"] = prepare, unprepare
    out["prepare"], out["unprepare"] = summary(prepare), summary(unprepare)
    out["prepare_server_cpu_us"] = (cpu1 - cpu0) / 1e3 / len(claims)
    out["unprepare_server_cpu_us"] = (cpu2 - cpu1) / 1e3 / len(claims)
    # The ledger grows as claims are held: compare the first and last tenth.
    edge = max(1, len(prepare) // 10)
    out["prepare_first_p50"] = statistics.median(prepare[:edge])
    out["prepare_last_p50"] = statistics.median(prepare[-edge:])
    out["claim_gets"] = api.call(lambda: api.api.requests[("get", "resourceclaims")])

    bprep, bunprep = [], []
    with collected_before():
        for b in range(args.batches):
            part = slice(b * args.batch_size, (b + 1) * args.batch_size)
            t0 = time.perf_counter()
            result = kubelet.prepare(DRIVER, batch_claims[part])
            bprep.append(ms(time.perf_counter() - t0))
            check_prepared(result, batch_claims[part], batch_devices[part], cdi)
            t0 = time.perf_counter()
            errors = kubelet.unprepare(DRIVER, batch_claims[part])
            bunprep.append(ms(time.perf_counter() - t0))
            check_unprepared(errors, batch_claims[part], cdi)
    out["batch_prepare_ms"], out["batch_unprepare_ms"] = bprep, bunprep
    out["batch_prepare"], out["batch_unprepare"] = summary(bprep), summary(bunprep)
    out["api_writes_during_claims"] = api.call(lambda: api.api.writes) - writes0
    return out


def stream_says(kubelet: DraKubeletEmulator, change: str, since: float, timeout: float) -> float:
    """When (time.monotonic) the kubelet emulator's health stream first said
    `change` (`pool/device=Health`) at or after `since`."""
    deadline = time.monotonic() + timeout
    while True:
        for event in kubelet.events("health"):
            if event.detail == change and event.time >= since:
                return event.time
        if time.monotonic() > deadline:
            raise BenchError(f"the kubelet's health stream did not say {change} in {timeout} s")
        time.sleep(0.002)


def measure_health(
    args: argparse.Namespace,
    api: ApiThread,
    kubelet: DraKubeletEmulator,
    pool: Pool,
    dev: Path,
    targets: list[tuple[str, int]],
) -> dict[str, Any]:
    down, up, how = [], [], []
    stream_down: list[float] = []  # to the kubelet's health stream
    stream_up: list[float] = []
    # When the first slice write of the change landed, and how many it took.
    first_down, first_up, writes_down, writes_up = [], [], [], []
    wall: list[float] = []  # when each change was made, to read the server's log against
    for i in range(args.health_changes):
        device, group = targets[i % len(targets)]
        node = dev / "vfio" / str(group)
        time.sleep(args.settle)  # idle: the previous change is long published
        pool.until(api.events, lambda _: True, 0)  # catch up with what is there
        with collected_before():
            wall.append(time.time())
            mark = len(api.events)
            t0, m0 = time.perf_counter(), time.monotonic()
            node.unlink()
            t1 = pool.until(api.events, lambda p, d=device: state_of(p.get(d)) != "healthy", 10)
        if t1 is None:
            raise BenchError(f"{device}: still healthy in the slices 10 s after {node} went")
        stream_down.append(ms(stream_says(kubelet, f"{NODE}/{device}=Unhealthy", m0, 10) - m0))
        current = pool.current()
        how.append(state_of(current.get(device) if current else None))
        down.append(ms(t1 - t0))
        first_down.append(ms(api.events[mark][0] - t0))
        writes_down.append(pool.seen - mark)
        time.sleep(args.settle)
        pool.until(api.events, lambda _: True, 0)
        with collected_before():
            wall.append(time.time())
            mark = len(api.events)
            t0, m0 = time.perf_counter(), time.monotonic()
            node.touch()
            t1 = pool.until(api.events, lambda p, d=device: state_of(p.get(d)) == "healthy", 10)
        if t1 is None:
            raise BenchError(f"{device}: not back in the slices 10 s after {node} returned")
        stream_up.append(ms(stream_says(kubelet, f"{NODE}/{device}=Healthy", m0, 10) - m0))
        up.append(ms(t1 - t0))
        first_up.append(ms(api.events[mark][0] - t0))
        writes_up.append(pool.seen - mark)
    return {
        "down_ms": down,
        "up_ms": up,
        "down": summary(down),
        "up": summary(up),
        "first_write_down_ms": first_down,
        "first_write_up_ms": first_up,
        "first_write_down": summary(first_down),
        "first_write_up": summary(first_up),
        "writes_down": writes_down,
        "writes_up": writes_up,
        "stream_down_ms": stream_down,
        "stream_up_ms": stream_up,
        "stream_down": summary(stream_down),
        "stream_up": summary(stream_up),
        "unhealthy_shown_as": sorted(set(how)),
        "changes_at_unix_s": wall,
    }


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    result: dict[str, Any] = {}
    host = root
    config = root / "config.yaml"
    config.write_text(dra_config(args.ids + (1 if args.multi_groups else 0)))
    work = Path(tempfile.mkdtemp(prefix="w-", dir=root))
    cdi, state, registry, plugins = (work / n for n in ("cdi", "state", "reg", "plugins"))
    for d in (cdi, state, registry, plugins, work / "dp"):
        d.mkdir()
    log_path = work / "server.log"
    api = ApiThread(None if args.no_schema else SCHEMA)
    (work / "kubeconfig").write_text(kubeconfig(api.api.url))
    kubelet = DraKubeletEmulator(registry, poll_interval=0.02).start()
    server: subprocess.Popen[bytes] | None = None
    log_file = open(log_path, "wb")  # noqa: SIM115 - closed in finally
    try:
        command = [
            *serve_command(
                args.server_python,
                host,
                config,
                work / "dp",
                work / "pr.sock",
                "single",
                args.log_level,
            ),
            *("--node-name", NODE, "--kubeconfig", str(work / "kubeconfig")),
            *("--plugins-registry-dir", str(registry), "--plugins-dir", str(plugins)),
            *("--cdi-spec-dir", str(cdi), "--state-dir", str(state)),
        ]
        if not args.cold:
            warm_page_cache(host)
        t_spawn = time.monotonic()
        server = subprocess.Popen(
            command,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=server_env(host),
            # `-m` puts the working directory first on sys.path: run from the
            # checkout, --server-python would import the checkout, not its own dp.
            cwd=work,
        )
        if args.cpu_split is not None:
            pin(server.pid, args.cpu_split[1])
        kubelet.wait_for("registered", DRIVER, timeout=args.timeout)
        result["spawn_to_registered_s"] = time.monotonic() - t_spawn
        pool = Pool()
        # Each group of two is offered whole too (iommu-group-<n>).
        expected = args.ids * args.functions + 3 * args.multi_groups
        if pool.until(api.events, lambda p: len(p) == expected, args.timeout) is None:
            raise BenchError(
                f"no complete pool of {expected} devices within {args.timeout} s: "
                f"{len(pool.current() or {})} devices in {len(pool.slices)} slices"
            )
        result["spawn_to_published_s"] = time.monotonic() - t_spawn
        current = pool.current()
        assert current is not None
        result["slices"] = len(pool.slices)
        result["server_cpus"] = allowed_cpus(server.pid)
        result["bench_cpus"] = allowed_cpus(os.getpid())
        # One function per IOMMU group, so no two claims can meet in a group;
        # the groups of two first, so the claims take a function of each (the
        # pool is not written for them: the group's counter says it).
        by_group: dict[int, str] = {}
        for name in sorted(n for n in current if not n.startswith("iommu-group-")):
            by_group.setdefault(int(attribute(current[name], "iommuGroup")), name)
        pairs = {
            int(attribute(current[n], "iommuGroup"))
            for n in current
            if n.startswith("iommu-group-")
        }
        free = [by_group[g] for g in sorted(by_group, key=lambda g: (g not in pairs, g))]
        if len(free) < args.claims:
            raise BenchError(f"{len(free)} IOMMU groups, fewer than --claims {args.claims}")
        result["claims"] = measure_claims(args, api, kubelet, server.pid, free, cdi)
        # Spread the health changes over the pool (and so over its slices).
        step = max(1, len(free) // max(1, args.health_changes))
        targets = [(by_group[g], g) for g in sorted(by_group)[::step]]
        result["pairs_claimed"] = sorted(by_group[g] for g in pairs)
        result["health"] = measure_health(args, api, kubelet, pool, host / "dev", targets)
        result["proc_end"] = proc_snapshot(server.pid)
        result["rejected_by_schema"] = api.call(lambda: list(api.api.rejected))
        result["api_requests"] = {
            f"{verb} {res}": n
            for (verb, res), n in sorted(api.call(lambda: dict(api.api.requests)).items())
        }
        if server.poll() is not None:
            raise BenchError(f"the server exited with {server.returncode}")
        return result
    except BaseException:
        print_log_tail(log_file, log_path, "DRA run")
        raise
    finally:
        if server is not None and server.poll() is None:
            result["exit_code"] = stop_server(server)
        log_file.close()
        if args.server_log:
            with contextlib.suppress(OSError):
                shutil.copyfile(log_path, args.server_log)
        with contextlib.suppress(OSError):
            result["log_lines"] = len(log_path.read_bytes().splitlines())
        kubelet.stop()
        api.stop()


# ---------------------------------------------------------------------------
# The report


def report(r: dict[str, Any]) -> str:
    c, h = r["claims"], r["health"]
    lines = [
        "| measurement | n | p50 | p90 | p99 | max |",
        "|---|---|---|---|---|---|",
    ]

    def row(label: str, s: dict[str, float]) -> None:
        lines.append(
            f"| {label} | {s['n']} | {s['p50']:.2f} | {s['p90']:.2f} | {s['p99']:.2f} | "
            f"{s['max']:.2f} |"
        )

    row("NodePrepareResources, 1 claim (ms)", c["prepare"])
    row("NodeUnprepareResources, 1 claim (ms)", c["unprepare"])
    row(f"NodePrepareResources, {r['batch_size']} claims (ms)", c["batch_prepare"])
    row(f"NodeUnprepareResources, {r['batch_size']} claims (ms)", c["batch_unprepare"])
    row("vfio node removed -> device out of slices (ms)", h["down"])
    row("vfio node back -> device back in slices (ms)", h["up"])
    row("  vfio node removed -> first slice write stored (ms)", h["first_write_down"])
    row("  vfio node back -> first slice write stored (ms)", h["first_write_up"])
    row("vfio node removed -> kubelet's health stream: Unhealthy (ms)", h["stream_down"])
    row("vfio node back -> kubelet's health stream: Healthy (ms)", h["stream_up"])
    lines += [
        "",
        f"Prepare p50, first / last tenth of the claims (ledger growing): "
        f"{c['prepare_first_p50']:.2f} / {c['prepare_last_p50']:.2f} ms; server CPU per "
        f"Prepare {c['prepare_server_cpu_us']:.0f} us, per Unprepare "
        f"{c['unprepare_server_cpu_us']:.0f} us",
        f"Claim GETs seen by the API emulator: {c['claim_gets']}; API writes during the "
        f"claim phase: {c['api_writes_during_claims']}",
        f"Slice writes per health change (removed / back): median "
        f"{statistics.median(h['writes_down']):g} / {statistics.median(h['writes_up']):g}; "
        f"API emulator validating every write against the schema: {r['schema']}",
        f"Unhealthy device shown as: {', '.join(h['unhealthy_shown_as'])}; objects the "
        f"emulator refused: {len(r['rejected_by_schema'])}",
        f"Server: registered {r['spawn_to_registered_s']:.2f} s and pool of "
        f"{r['devices']} devices in {r['slices']} slices published "
        f"{r['spawn_to_published_s']:.2f} s after spawn; RSS with {r['claims_n']} claims held "
        f"{c['proc_all_prepared']['rss_kb'] / 1024:.1f} MB, threads "
        f"{r['proc_end']['threads']}",
        "",
        "Targets:",
    ]
    checks = [
        (
            f"NodePrepareResources p99 < {TARGETS['prepare_p99_ms']:g} ms (1 claim)",
            c["prepare"]["p99"],
            TARGETS["prepare_p99_ms"],
        ),
        (
            f"NodePrepareResources p99 < {TARGETS['prepare_p99_ms']:g} ms "
            f"({r['batch_size']} claims)",
            c["batch_prepare"]["p99"],
            TARGETS["prepare_p99_ms"],
        ),
        (
            f"health change -> slice update < {TARGETS['health_ms']:g} ms (worst, removal)",
            h["down"]["max"],
            TARGETS["health_ms"],
        ),
        (
            f"health change -> slice update < {TARGETS['health_ms']:g} ms (worst, return)",
            h["up"]["max"],
            TARGETS["health_ms"],
        ),
    ]
    for label, value, target in checks:
        lines.append(f"  {label:<62} {'met' if value < target else 'MISSED':<7} {value:.1f} ms")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--claims", type=int, default=400, help="single-claim Prepares (400)")
    parser.add_argument("--batches", type=int, default=50, help="batched Prepares (50)")
    parser.add_argument("--batch-size", type=int, default=8, help="claims per batch (8)")
    parser.add_argument("--health-changes", type=int, default=20, help="vfio node removals (20)")
    parser.add_argument(
        "--settle", type=float, default=0.5, help="idle seconds before each health change"
    )
    parser.add_argument("--ids", type=int, default=8, help="vendor:device IDs (8)")
    parser.add_argument("--functions", type=int, default=64, help="functions per ID (64)")
    parser.add_argument(
        "--multi-groups", type=int, default=4, help="extra IOMMU groups of 2 functions (4)"
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="per wait, seconds")
    parser.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error")
    )
    parser.add_argument(
        "--no-schema",
        action="store_true",
        help="the API emulator does not check writes against resource.k8s.io/v1's schema "
        "(its Python validation is most of its time per slice write)",
    )
    parser.add_argument("--cold", action="store_true", help="don't warm the page cache")
    parser.add_argument(
        "--share-cpus",
        action="store_true",
        help="let the server and the bench (both emulators) share every CPU",
    )
    add_server_python(parser)
    parser.add_argument("--json", metavar="PATH", help="write raw results here")
    parser.add_argument("--server-log", metavar="PATH", help="keep the server's log here")
    args = parser.parse_args(argv)
    if (
        not 1 <= args.functions <= 256
        or not 1 <= args.ids <= 99
        or not 0 <= args.multi_groups <= 32
    ):
        parser.error("--functions 1..256, --ids 1..99, --multi-groups 0..32")
    if args.claims < 1 or args.batches < 1 or args.batch_size < 1 or args.health_changes < 1:
        parser.error("--claims, --batches, --batch-size and --health-changes must be >= 1")
    args.cpu_split = cpu_split(args.share_cpus)
    if args.cpu_split is not None:
        pin(os.getpid(), args.cpu_split[0])  # the emulators' threads, started later, inherit it

    version = source_version()
    load_before = os.getloadavg()
    root = Path(tempfile.mkdtemp(prefix="dpd-", dir="/tmp"))
    try:
        t0 = time.monotonic()
        write_sysfs(dra_topology(args.ids, args.functions, args.multi_groups), root)
        print(
            f"host: {args.ids} IDs x {args.functions} functions + {args.multi_groups} groups "
            f"of 2 in {root} (written in {time.monotonic() - t0:.1f} s)",
            file=sys.stderr,
        )
        result = run(args, root)
    except BenchError as error:
        print(f"bench_dra: {error}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["batch_size"] = args.batch_size
    result["schema"] = not args.no_schema
    result["claims_n"] = args.claims
    result["devices"] = args.ids * args.functions + 2 * args.multi_groups
    machine = {
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "server_python": args.server_python,
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python3", *sys.argv]),
        "source": version,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "cpus": describe_cpus(args.cpu_split, "bench (API-server and DRA kubelet emulators)"),
    }
    print(
        f"dp-server serve as a DRA driver: {result['devices']} devices, {args.claims} claims, "
        f"{args.batches} batches of {args.batch_size}, {args.health_changes} health changes"
    )
    print(
        f"machine: nproc {machine['nproc']}, Python {machine['python']} (server: "
        f"{args.server_python}), {machine['date']}, load average before/after "
        f"{load_before[0]:.2f}/{machine['loadavg_after'][0]:.2f}"
    )
    print(f"source: {version}")
    print(f"CPUs: {machine['cpus']}")
    print()
    print(report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "args": vars(args), "results": result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
