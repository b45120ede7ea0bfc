#!/usr/bin/env python3
"""Benchmark `dp-server serve` against the grpcio kubelet emulator.

The server runs as its own process (`python -m dp_server.cli.main serve`), so the
RSS, threads, fds and CPU measured from /proc/<pid> are its own; the kubelet
emulator runs in this process. The host is a generated sysfs tree with
`--resources` distinct vendor:device IDs x `--devices` functions each (default
64 x 64 = 4096 functions), every function bound to vfio-pci, alone in its IOMMU
group with /dev/vfio/<group> present, spread over 2 NUMA nodes; the config puts
each ID into a resource of its own (`bench.example.com/dev00` ..) and disables
the shared devices, so there are exactly `--resources` resources.

Per socket mode (`single` and `per-resource`, both in one run) and per
repetition it measures:

1. spawn -> every resource registered with a ListAndWatch list received, and
   first Register seen by the kubelet ("server ready") -> all registered;
2. GetDevicePluginOptions round trips (transport baseline), then the Allocate
   round trip (kubelet side, grpcio sync client included);
3. kubelet restart -> every resource registered again with a list, and the
   CPU each side spent meanwhile;
4. RSS, threads (with names) and open fds after registration, after the load
   and after idling;
5. idle CPU over `--idle-seconds`, per thread, once the server has released
   the bench's allocations;
6. SIGTERM -> exit: time, exit code, socket files left behind.

The server and the emulator run on CPUs of their own (the last CPU for the
server, the others for this process) unless `--share-cpus` is given: on a
2-vCPU machine the grpcio emulator is busy for most of a restart, and the
figures would otherwise measure which of the two the scheduler runs.

bench/README.md describes the setup and every measurement in detail.

Usage: python bench/bench_serve.py [--runs 5] [--allocs 2000] [--idle-seconds 20]
       [--modes single,per-resource] [--json results.json]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import shutil
import signal
import stat
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from dp_core import VFIO_DRIVER, PciAddress
from dp_server.host.scanner import scan_host
from dp_testing.emulator import KubeletEmulator
from dp_testing.emulator.pb.deviceplugin.v1beta1.api_pb2 import Empty
from dp_testing.topology import SHARED_DEV_PATHS, FakePci, Topology, write_sysfs

DOMAIN = "bench.example.com"
VENDOR = 0x1DED  # not a real vendor: the names come from the config, not pci.ids
CLASS_CODE = 0x120000  # processing accelerator
CLK_TCK = os.sysconf("SC_CLK_TCK")

# How often the bench looks at the emulator while it waits for registrations.
# The figures come from the emulator's event times, not from when the bench
# notices; a waiter woken by every event instead (`--watch-interval 0`) runs
# between the kubelet's steps and takes the GIL and the state lock from its
# threads, about 50 ms of a 64-resource re-registration.
WATCH_INTERVAL = 0.002

# The server's CPU and the emulator's, unless --share-cpus: see `cpu_split`.
CpuSplit = tuple[list[int], list[int]]

# The targets the project set itself for serving every resource from one
# process (docs/benchmarks.md, "Targets").
TARGETS = {
    "register_s": 1.5,
    "allocate_p99_ms": 5.0,
    "restart_s": 0.5,
    "rss_mb": 45.0,
    "idle_cpu_pct": 0.5,
    "threads": 3,
}


# ---------------------------------------------------------------------------
# The host


def bench_topology(n_ids: int, n_functions: int, numa_nodes: int = 2) -> Topology:
    """`n_ids` vendor:device IDs x `n_functions` functions, each its own group.

    ID i lives on bus i+1 (ARI-style addresses: 8 slots x 8 functions for 64);
    half of each ID's functions sit on each NUMA node, as a card per socket would.
    """
    pci = []
    for i in range(n_ids):
        domain, bus = divmod(i, 255)
        for j in range(n_functions):
            pci.append(
                FakePci(
                    address=PciAddress(domain, bus + 1, (j >> 3) & 0x1F, j & 7),
                    vendor=VENDOR,
                    device=0x1000 + i,
                    class_code=CLASS_CODE,
                    driver=VFIO_DRIVER,
                    group=i * n_functions + j,
                    numa=(j * numa_nodes) // n_functions,
                )
            )
    nodes = {"/dev/vfio/vfio", *SHARED_DEV_PATHS} | {f"/dev/vfio/{p.group}" for p in pci}
    return Topology(pci=pci, dev_nodes=nodes)  # type: ignore[arg-type]  # attrs converter


def resource_names(n_ids: int) -> list[str]:
    return [f"{DOMAIN}/dev{i:02d}" for i in range(n_ids)]


def bench_config(n_ids: int) -> str:
    lines = ["permittedHostDevices:", "  pciHostDevices:"]
    for i, name in enumerate(resource_names(n_ids)):
        lines.append(f'    - pciVendorSelector: "{VENDOR:04X}:{0x1000 + i:04X}"')
        lines.append(f'      resourceName: "{name}"')
    lines += [
        "sharedDevices:",
        "  devices.kubevirt.io/kvm: {enabled: false}",
        "  devices.kubevirt.io/tun: {enabled: false}",
        "  devices.kubevirt.io/vhost-net: {enabled: false}",
    ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# /proc


def proc_status(pid: int) -> dict[str, str]:
    return proc_status_path(f"/proc/{pid}/status")


def proc_cpu_ticks(pid: int) -> int:
    """utime + stime of the whole process, in clock ticks."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of stat(5)


def proc_stat_times(pid: int) -> dict[str, float]:
    """utime and stime (s) and major page faults (reads from disk) so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return {
        "utime_s": int(fields[11]) / CLK_TCK,
        "stime_s": int(fields[12]) / CLK_TCK,
        "majflt": int(fields[9]),
    }


def server_env(root: Path) -> dict[str, str]:
    """The environment for server processes: bytecode cached, as installed.

    A pip-installed package has its modules compiled to .pyc at install time;
    a checkout run with PYTHONDONTWRITEBYTECODE=1 (as this sandbox sets it)
    recompiles every module of ours at every start, some 70 ms of CPU that no
    installed server pays. Cache the bytecode under the bench's temp dir.
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(root / "pycache")
    return env


def add_server_python(parser: argparse.ArgumentParser) -> None:
    """--server-python: the interpreter that runs the server (see serve_command)."""
    parser.add_argument(
        "--server-python",
        default=sys.executable,
        metavar="PATH",
        help="the interpreter that runs the server (default: this one). Give a venv's "
        "python with only dp installed (`pip install .`) to measure the server as the "
        "container image runs it: a host interpreter may hold packages that dp's "
        "libraries import when present (betterproto2 imports pydantic, 5 MB)",
    )


def stop_server(server: subprocess.Popen[bytes] | None) -> int | None:
    """Stop a server still running as SIGTERM does (killed after 10 s); its exit code."""
    if server is None or server.poll() is not None:
        return None
    server.terminate()
    try:
        return server.wait(10)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
        return None


def print_log_tail(log_file: Any, log_path: Path, label: str, size: int = 4000) -> None:
    """The end of a server's log, on stderr: why a run failed."""
    log_file.flush()
    with contextlib.suppress(OSError):
        tail = log_path.read_bytes()[-size:].decode(errors="replace")
        print(f"--- server log tail ({label}) ---\n{tail}", file=sys.stderr)


def serve_command(
    python: str,
    host: Path,
    config: Path,
    plugin_dir: Path,
    pod_socket: Path,
    mode: str,
    log_level: str,
) -> list[str]:
    """`dp-server serve` on the generated `host`, with no periodic rescan (it
    would pollute the idle figures), run by the interpreter `python`."""
    return [
        *(python, "-m", "dp_server", "serve"),
        *("--sysfs", str(host / "sys"), "--dev", str(host / "dev"), "--config", str(config)),
        *("--device-plugin-dir", str(plugin_dir), "--pod-resources-socket", str(pod_socket)),
        *("--socket-mode", mode, "--rescan-interval", "3600", "--log-level", log_level),
    ]


def warm_page_cache(host: Path) -> None:
    """Read what the server will read at start, as a warm node would have it.

    The fake sysfs lives on a disk-backed /tmp, and this VM's DAMON `pageout`
    scheme evicts page cache that sat unused for a while, so after a run's
    idle phase the next server start re-read the tree (and Python's own files)
    from disk: 1 to 2 s more per start. Real /sys is memory-resident, so
    warm it: one scan of the tree here, and one import of the server's modules
    in a throwaway process. `--cold` skips this.
    """
    scan_host(str(host / "sys"), str(host / "dev"), dev_paths=[])
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import dp_server.cli.main, dp_server.runtime.runtime, dp_server.deviceplugin.service",
        ],
        check=True,
        timeout=60,
        env=server_env(host),
    )


def proc_cpu_ns(pid: int) -> int:
    """On-CPU time of every live thread, in ns (schedstat: finer than ticks)."""
    return sum(ns for _, ns, _ in proc_tasks(pid).values())


def cpu_split(share: bool) -> CpuSplit | None:
    """The CPUs for this process (the emulator) and for the server, or None to share.

    The emulator is a Python program standing in for a Go kubelet, and during
    a restart it is busy for most of the time: with both on 2 vCPUs the
    server's thread is preempted some 600 times per restart (its involuntary
    context switches), each time its emulator peer wakes. Each on its own CPU,
    the figures are the server's, not the scheduler's. A kubelet and a
    device plugin pod are rarely confined to the same two CPUs.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if share or len(cpus) < 2:
        return None
    return cpus[:-1], cpus[-1:]


def describe_cpus(
    split: CpuSplit | None, kubelet: str = "kubelet emulator (the bench process)"
) -> str:
    if split is None:
        return f"shared by the server and the {kubelet} (--share-cpus, or one CPU)"
    others, server = (",".join(map(str, cpus)) for cpus in split)
    return f"server on {server}, {kubelet} on {others}"


def pin(pid: int, cpus: list[int]) -> None:
    """Confine every thread of `pid` to `cpus`; threads started later inherit it."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(task.name), cpus)


def allowed_cpus(pid: int) -> list[str]:
    """Each thread's Cpus_allowed_list, as the kernel reports it."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            found.add(proc_status_path(str(task / "status"))["Cpus_allowed_list"])
    return sorted(found)


def proc_tasks(pid: int) -> dict[str, tuple[str, int, int]]:
    """Per thread: (name, on-CPU ns, context switches)."""
    out = {}
    for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
        with contextlib.suppress(OSError, ValueError):
            base = f"/proc/{pid}/task/{tid}"
            with open(f"{base}/comm") as f:
                name = f.read().strip()
            with open(f"{base}/schedstat") as f:
                ns = int(f.read().split()[0])
            status = proc_status_path(f"{base}/status")
            switches = int(status["voluntary_ctxt_switches"]) + int(
                status["nonvoluntary_ctxt_switches"]
            )
            out[tid] = (name, ns, switches)
    return out


def proc_status_path(path: str) -> dict[str, str]:
    out = {}
    with open(path) as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key] = value.strip()
    return out


def proc_snapshot(pid: int) -> dict[str, Any]:
    status = proc_status(pid)
    tasks = proc_tasks(pid)
    return {
        "rss_kb": int(status["VmRSS"].split()[0]),
        "hwm_kb": int(status["VmHWM"].split()[0]),
        "threads": int(status["Threads"]),
        "thread_names": [name for name, _, _ in tasks.values()],
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "ctxt_switches": sum(s for _, _, s in tasks.values()),
    }


def thread_deltas(
    before: dict[str, tuple[str, int, int]], after: dict[str, tuple[str, int, int]], seconds: float
) -> list[dict[str, Any]]:
    """Per thread alive at the end: % of a core and wakeups per second in between."""
    rows = []
    for tid, (name, ns, switches) in after.items():
        _, ns0, switches0 = before.get(tid, (name, 0, 0))
        rows.append(
            {
                "tid": int(tid),
                "name": name,
                "cpu_pct": 100.0 * (ns - ns0) / 1e9 / seconds,
                "switches_per_s": (switches - switches0) / seconds,
            }
        )
    return rows


def source_version() -> str:
    """The checkout's commit, and whether the server's code differs from it."""
    repo = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--", "dp_core", "dp_server"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{commit}{' + uncommitted changes in dp_core/dp_server' if changed else ''}"


def count_log_lines(path: Path, log_file: Any, needle: bytes) -> int:
    log_file.flush()
    with open(path, "rb") as f:
        return sum(1 for line in f if needle in line)


# ---------------------------------------------------------------------------
# Statistics


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n * q / 100)
    return ordered[int(min(rank, len(ordered))) - 1]


def summary(values: Sequence[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values),
        "mean": statistics.fmean(values),
    }


# ---------------------------------------------------------------------------
# One run


class BenchError(Exception):
    pass


def first_events(
    events: Iterable[Any], kind: str, names: set[str], after: float
) -> dict[str, float]:
    """Time of the first `kind` event per resource at or after `after`."""
    seen: dict[str, float] = {}
    for event in events:
        if event.kind == kind and event.resource in names and event.time >= after:
            seen.setdefault(event.resource, event.time)
    return seen


@contextlib.contextmanager
def collected_before() -> Iterable[None]:
    """Collect the bench process's garbage before a timed phase, and none during it.

    The emulator lives in the bench's process, which piles up every run's
    samples and replies. A full collection stops the emulator's threads while
    it walks them: 48 ms, falling inside the second single-socket restart of
    every `--runs 3` pass (the same allocation counts each time), so that run
    was always the slowest. No kubelet pauses for its observer's garbage.
    """
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def restart_kubelet(
    emulator: KubeletEmulator, names: Sequence[str], timeout: float, interval: float | None
) -> tuple[float, dict[str, int]]:
    """Restart the kubelet and wait until every resource is registered anew and listed.

    Returns when the new kubelet.sock accepted connections and each resource's
    registration count before the restart.
    """
    before = {n: emulator.registration_count(n) for n in names}
    emulator.restart()
    t_restart = emulator.last_restart
    assert t_restart is not None

    def again(e: KubeletEmulator) -> bool:
        states = e.resources()
        return all(
            e.registration_count(n) > before[n]
            and (at := states[n].registered_at) is not None
            and at >= t_restart
            for n in names
        )

    # First every resource registered anew (the restart dropped the old
    # registrations), then every new registration has its list: each new
    # registration resets the emulator's "listed" flag.
    deadline = time.monotonic() + timeout
    if not emulator.wait_for(again, timeout, interval=interval) or not emulator.wait_registered(
        names, max(0.0, deadline - time.monotonic()), listed=True, interval=interval
    ):
        states = emulator.resources()
        late = [
            n
            for n in names
            if not (
                emulator.registration_count(n) > before[n]
                and (at := states[n].registered_at) is not None
                and at >= t_restart
                and emulator.wait_registered([n], 0.0, listed=True)
            )
        ]
        # What the kubelet saw of the first few, from just before the restart.
        shown = "; ".join(
            f"{n}: "
            + ", ".join(
                f"{e.kind}@{e.time - t_restart:+.3f}"
                for e in emulator.events
                if e.resource == n and e.time >= t_restart - 1
            )
            for n in late[:3]
        )
        raise BenchError(
            f"{len(late)}/{len(names)} not registered anew and listed within {timeout} s "
            f"of the restart: {shown}"
        )
    return t_restart, before


def all_listed_at(events: Sequence[Any], names: set[str], after: float) -> float:
    """When the last resource got its first list of a registration made after `after`."""
    registered: dict[str, float] = {}
    listed: dict[str, float] = {}
    for event in events:
        if event.time < after or event.resource not in names:
            continue
        if event.kind == "registered":
            registered[event.resource] = event.time
            listed.pop(event.resource, None)  # a newer registration needs its own list
        elif event.kind == "list" and event.resource in registered:
            listed.setdefault(event.resource, event.time)
    missing = names - listed.keys()
    if missing:
        raise BenchError(f"no list after registration for {len(missing)} resources")
    return max(listed.values())


def run_once(
    mode: str,
    run: int,
    args: argparse.Namespace,
    host: Path,
    config: Path,
    names: list[str],
) -> dict[str, Any]:
    name_set = set(names)
    workdir = Path(tempfile.mkdtemp(prefix=f"r{run}-", dir=host))
    plugin_dir = workdir / "dp"
    pod_socket = workdir / "pr.sock"
    log_path = workdir / "server.log"
    result: dict[str, Any] = {"mode": mode, "run": run}
    emulator = KubeletEmulator(plugin_dir, pod_resources_socket=pod_socket)
    emulator.start()
    server: subprocess.Popen[bytes] | None = None
    log_file = open(log_path, "wb")  # noqa: SIM115 - closed in finally
    try:
        command = serve_command(
            args.server_python, host, config, plugin_dir, pod_socket, mode, args.log_level
        )
        if not args.cold:
            warm_page_cache(host)
        interval = args.watch_interval or None  # 0: woken on every kubelet event
        # 1. start -> all registered with a list
        with collected_before():
            t_spawn = time.monotonic()
            server = subprocess.Popen(
                command, stdout=log_file, stderr=subprocess.STDOUT, env=server_env(host)
            )
            pid = server.pid
            if args.cpu_split is not None:
                pin(pid, args.cpu_split[1])  # before it starts any thread of its own
            registered = emulator.wait_registered(
                names, args.timeout, listed=True, interval=interval
            )
        if not registered:
            got = sum(1 for r in emulator.resources().values() if r.registered)
            raise BenchError(f"only {got}/{len(names)} registered within {args.timeout} s")
        events = emulator.events
        t_all = all_listed_at(events, name_set, t_spawn)
        first_register = min(first_events(events, "register", name_set, t_spawn).values())
        result["register_s"] = t_all - t_spawn
        result["ready_to_register_s"] = t_all - first_register
        result["spawn_to_first_register_s"] = first_register - t_spawn
        result["cpu_s_at_registered"] = proc_cpu_ticks(pid) / CLK_TCK
        times = proc_stat_times(pid)
        result["stime_s_at_registered"] = times["stime_s"]
        result["majflt_at_registered"] = times["majflt"]
        result["proc_registered"] = proc_snapshot(pid)
        result["server_cpus"] = allowed_cpus(pid)
        result["bench_cpus"] = allowed_cpus(os.getpid())
        resources = emulator.resources()
        if sorted(resources) != sorted(names):
            extra = sorted(set(resources) - name_set)
            raise BenchError(f"unexpected resources {extra[:5]}")
        devices = {n: sorted(resources[n].devices) for n in names}
        for n in names:
            state = resources[n]
            if state.capacity != args.devices or state.allocatable != args.devices:
                raise BenchError(
                    f"{n}: capacity {state.capacity}, allocatable {state.allocatable}; "
                    f"want {args.devices} healthy"
                )

        # 2a. Baseline: GetDevicePluginOptions round trips over the same
        # connections (transport, grpclib, one trivial core call, the grpcio
        # client), so the Allocate numbers can be split into transport and core.
        options_ms = []
        for i in range(args.baseline_calls):
            n = names[i % len(names)]
            t0 = time.perf_counter()
            emulator.call(n, "GetDevicePluginOptions", Empty())
            options_ms.append((time.perf_counter() - t0) * 1000.0)
        result["options_ms"] = options_ms
        result["options"] = summary(options_ms)

        # 2. Allocate round trips. One warm-up call per resource (the last
        # device), not counted, then N calls round-robin over the resources,
        # walking each resource's devices from the first.
        for n in names:
            emulator.allocate(n, [devices[n][-1]])
        allocate_cpu_ns0 = proc_cpu_ns(pid)
        latencies = []
        per_resource = len(devices[names[0]])
        for i in range(args.allocs):
            n = names[i % len(names)]
            device = devices[n][(i // len(names)) % per_resource]
            t0 = time.perf_counter()
            response = emulator.allocate(n, [device])
            latencies.append((time.perf_counter() - t0) * 1000.0)
            if not response.devices:
                raise BenchError(f"Allocate({n}, {device}) returned no device specs")
        t_last_allocate = time.monotonic()
        # The server's own CPU per call: what the client's and the hour's noise
        # in the round trips hide.
        result["allocate_server_cpu_us"] = (proc_cpu_ns(pid) - allocate_cpu_ns0) / 1e3 / args.allocs
        result["allocate_ms"] = latencies
        result["allocate"] = summary(latencies)
        # The core's cost grows with the allocations it holds: compare the ends.
        edge = max(1, min(200, len(latencies) // 4))
        result["allocate_first_p50"] = percentile(latencies[:edge], 50)
        result["allocate_last_p50"] = percentile(latencies[-edge:], 50)
        result["allocate_edge_calls"] = edge
        result["proc_loaded"] = proc_snapshot(pid)

        # 3. kubelet restart -> all registered again, each with a list
        with collected_before():
            server_ns0, bench_cpu0 = proc_cpu_ns(pid), time.process_time()
            t_restart, before = restart_kubelet(emulator, names, args.timeout, interval)
        # CPU spent by each side from the start of restart() (which also tears
        # down 64 grpcio clients) to all re-registered: who is the bottleneck.
        result["restart_server_cpu_s"] = (proc_cpu_ns(pid) - server_ns0) / 1e9
        result["restart_kubelet_cpu_s"] = time.process_time() - bench_cpu0
        events = emulator.events
        result["restart_s"] = all_listed_at(events, name_set, t_restart) - t_restart
        regs = first_events(events, "register", name_set, t_restart)
        result["restart_first_register_s"] = min(regs.values()) - t_restart
        result["registrations_after_restart"] = sum(
            emulator.registration_count(n) - before[n] for n in names
        )
        failed = [e for e in events if e.time >= t_restart and e.kind == "dial-failed"]
        result["restart_dial_failures"] = len(failed)

        # 4/5. settle, then idle. The emulator's PodResources lists no pods, so
        # the server drops every allocation once its release grace (7 s) has
        # passed, at its next PodResources poll (every 2 s while it holds
        # any). That is load, not idling: wait for it (each release is one log
        # line at info level), bounded by --release-wait after the last Allocate.
        allocated = {(n, devices[n][-1]) for n in names}
        allocated |= {
            (
                names[i % len(names)],
                devices[names[i % len(names)]][(i // len(names)) % per_resource],
            )
            for i in range(args.allocs)
        }
        held = len(allocated)
        deadline = t_last_allocate + args.release_wait
        released = count_log_lines(log_path, log_file, b" released ")
        while released < held and time.monotonic() < deadline:
            time.sleep(0.5)
            released = count_log_lines(log_path, log_file, b" released ")
        result["allocations_held"] = held
        result["allocations_released_before_idle"] = released
        result["release_wait_s"] = time.monotonic() - t_last_allocate
        time.sleep(args.settle)
        ticks0, tasks0, snap0 = proc_cpu_ticks(pid), proc_tasks(pid), proc_snapshot(pid)
        t0 = time.monotonic()
        time.sleep(args.idle_seconds)
        ticks1, tasks1, snap1 = proc_cpu_ticks(pid), proc_tasks(pid), proc_snapshot(pid)
        elapsed = time.monotonic() - t0
        threads = thread_deltas(tasks0, tasks1, elapsed)
        result["idle_cpu_pct"] = 100.0 * (ticks1 - ticks0) / CLK_TCK / elapsed
        result["idle_cpu_pct_schedstat"] = sum(t["cpu_pct"] for t in threads)
        result["idle_wakeups_per_s"] = (snap1["ctxt_switches"] - snap0["ctxt_switches"]) / elapsed
        result["idle_threads"] = threads
        result["proc_idle"] = snap1
        result["cpu_s_total"] = ticks1 / CLK_TCK
        still = sum(1 for r in emulator.resources().values() if r.registered)
        result["registered_after_idle"] = still

        # 6. SIGTERM -> exit
        t_term = time.monotonic()
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(args.timeout)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
            code = None
        result["exit_s"] = time.monotonic() - t_term
        result["exit_code"] = code
        left = []
        with contextlib.suppress(FileNotFoundError):
            for entry in plugin_dir.iterdir():
                if entry.name != "kubelet.sock" and stat.S_ISSOCK(entry.lstat().st_mode):
                    left.append(entry.name)
        result["sockets_left"] = left
        server = None
        return result
    except BaseException:
        print_log_tail(log_file, log_path, f"{mode} run {run}")
        raise
    finally:
        if server is not None and server.poll() is None:
            server.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.wait(10)
        log_file.close()
        with contextlib.suppress(OSError):
            result["log_lines"] = len(log_path.read_bytes().splitlines())
        emulator.stop()
        shutil.rmtree(workdir, ignore_errors=True)


# ---------------------------------------------------------------------------
# Reporting

_PER_RUN = (
    "register_s",
    "ready_to_register_s",
    "spawn_to_first_register_s",
    "cpu_s_at_registered",
    "stime_s_at_registered",
    "majflt_at_registered",
    "allocate_first_p50",
    "allocate_last_p50",
    "allocate_server_cpu_us",
    "restart_s",
    "restart_first_register_s",
    "restart_server_cpu_s",
    "restart_kubelet_cpu_s",
    "idle_cpu_pct",
    "idle_cpu_pct_schedstat",
    "idle_wakeups_per_s",
    "allocations_released_before_idle",
    "release_wait_s",
    "exit_s",
)


def _spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def thread_label(index: int, name: str, process_name: str) -> str:
    if index == 0:
        return "main (event loop)"
    if name.startswith("notify-rs"):
        return f"{name} (watchfiles' Rust inotify thread)"
    if name == process_name:
        return f"{name} (dp-watch: watchfiles' blocking watcher)"
    return name


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"runs": len(runs)}
    out["allocate_pooled"] = summary([ms for r in runs for ms in r["allocate_ms"]])
    out["options_pooled"] = summary([ms for r in runs for ms in r["options_ms"]])
    for key in _PER_RUN:
        out[key] = _spread([r[key] for r in runs])
    out["allocate_run_p99"] = _spread([r["allocate"]["p99"] for r in runs])
    for phase in ("proc_registered", "proc_loaded", "proc_idle"):
        out[phase] = {
            key: _spread([r[phase][key] for r in runs])
            for key in ("rss_kb", "hwm_kb", "threads", "fds")
        }
    out["thread_names"] = runs[-1]["proc_idle"]["thread_names"]
    by_label: dict[str, list[tuple[float, float]]] = {}
    for r in runs:
        threads = sorted(r["idle_threads"], key=lambda t: t["tid"])
        for index, t in enumerate(threads):
            label = thread_label(index, t["name"], threads[0]["name"])
            by_label.setdefault(label, []).append((t["cpu_pct"], t["switches_per_s"]))
    out["idle_threads"] = {
        label: {
            "cpu_pct": statistics.median(v[0] for v in values),
            "switches_per_s": statistics.median(v[1] for v in values),
        }
        for label, values in by_label.items()
    }
    out["allocate_edge_calls"] = runs[0]["allocate_edge_calls"]
    out["exit_codes"] = sorted({r["exit_code"] for r in runs}, key=str)
    out["sockets_left"] = sorted({s for r in runs for s in r["sockets_left"]})
    out["restart_dial_failures"] = sum(r["restart_dial_failures"] for r in runs)
    out["server_cpus"] = sorted({c for r in runs for c in r["server_cpus"]})
    out["bench_cpus"] = sorted({c for r in runs for c in r["bench_cpus"]})
    return out


def extra_threads(names: Sequence[str]) -> list[str]:
    """Threads beyond the loop and what watchfiles needs.

    watchfiles' `awatch` runs its Rust watcher through `anyio.to_thread`, so it
    needs one worker thread (named like the process: "python" in a venv,
    "python3" from a system interpreter) besides its own notify-rs thread;
    anything else counts against the target. `names[0]` is the main thread's.
    """
    rest = list(names[1:])
    notify = [n for n in rest if n.startswith("notify-rs")]
    others = [n for n in rest if not n.startswith("notify-rs")]
    if notify and names and names[0] in others:
        others.remove(names[0])
    return others


def _fmt(value: float, fmt: str) -> str:
    return f"{value:{fmt}}"


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    """A markdown table of every mode side by side, then the verdicts."""
    modes = list(results)
    s = {m: results[m]["summary"] for m in modes}
    t = TARGETS
    rows: list[tuple[str, list[str], str]] = []

    def spread(label: str, key: str, fmt: str, scale: float = 1.0, target: str = "") -> None:
        cells = [
            f"{_fmt(s[m][key]['median'] * scale, fmt)} ({_fmt(s[m][key]['max'] * scale, fmt)})"
            for m in modes
        ]
        rows.append((label, cells, target))

    def pooled(label: str, which: str, key: str, target: str = "") -> None:
        rows.append((label, [f"{s[m][which][key]:.3f}" for m in modes], target))

    def proc(
        label: str,
        phase: str,
        key: str,
        fmt: str,
        scale: float = 1.0,
        target: str = "",
    ) -> None:
        cells = [
            f"{_fmt(v['median'] * scale, fmt)} ({_fmt(v['max'] * scale, fmt)})"
            for v in (s[m][phase][key] for m in modes)
        ]
        rows.append((label, cells, target))

    mb = 1 / 1024
    spread(
        "spawn -> all 64 registered + listed (s)",
        "register_s",
        ".3f",
        target=f"<= {t['register_s']:g} s",
    )
    spread("  spawn -> first Register (s)", "spawn_to_first_register_s", ".3f")
    spread("  first Register -> all listed (s)", "ready_to_register_s", ".3f")
    spread("  server CPU used by then (s)", "cpu_s_at_registered", ".2f")
    spread("    of which system time (s)", "stime_s_at_registered", ".2f")
    pooled("GetDevicePluginOptions p50 (ms)", "options_pooled", "p50")
    pooled("GetDevicePluginOptions p99 (ms)", "options_pooled", "p99")
    pooled("Allocate p50 (ms)", "allocate_pooled", "p50")
    pooled("Allocate p90 (ms)", "allocate_pooled", "p90")
    pooled(
        "Allocate p99 (ms)",
        "allocate_pooled",
        "p99",
        target=f"< {t['allocate_p99_ms']:g} ms",
    )
    pooled("Allocate max (ms)", "allocate_pooled", "max")
    spread("  Allocate p50, first calls (ms)", "allocate_first_p50", ".3f")
    spread("  Allocate p50, last calls (ms)", "allocate_last_p50", ".3f")
    spread("  server CPU per Allocate (us)", "allocate_server_cpu_us", ".0f")
    spread(
        "kubelet restart -> all re-registered (s)",
        "restart_s",
        ".3f",
        target=f"<= {t['restart_s']:g} s",
    )
    spread("  restart -> first Register (s)", "restart_first_register_s", ".3f")
    spread("  server CPU in restart window (s)", "restart_server_cpu_s", ".3f")
    spread("  kubelet-emulator CPU, same window (s)", "restart_kubelet_cpu_s", ".3f")
    proc("RSS after registration (MB)", "proc_registered", "rss_kb", ".1f", mb)
    proc(
        "RSS after Allocate load (MB)",
        "proc_loaded",
        "rss_kb",
        ".1f",
        mb,
        target=f"< {t['rss_mb']:g} MB",
    )
    proc("RSS after idle (MB)", "proc_idle", "rss_kb", ".1f", mb, target=f"< {t['rss_mb']:g} MB")
    proc("peak RSS, VmHWM (MB)", "proc_idle", "hwm_kb", ".1f", mb)
    proc(
        "threads",
        "proc_idle",
        "threads",
        ".0f",
        target=f"<= {t['threads']}",
    )
    proc("open fds", "proc_idle", "fds", ".0f")
    spread(
        "idle CPU, utime+stime ticks (% of a core)",
        "idle_cpu_pct",
        ".3f",
        target=f"< {t['idle_cpu_pct']:g} %",
    )
    spread("idle CPU, schedstat ns (% of a core)", "idle_cpu_pct_schedstat", ".3f")
    spread("idle context switches (/s, all threads)", "idle_wakeups_per_s", ".1f")
    spread("  allocations released before idle", "allocations_released_before_idle", ".0f")
    spread("  wait from last Allocate to idle (s)", "release_wait_s", ".1f")
    spread("SIGTERM -> exit (s)", "exit_s", ".3f")
    rows.append(("exit codes", [",".join(map(str, s[m]["exit_codes"])) for m in modes], "0"))
    rows.append(
        ("socket files left after exit", [str(len(s[m]["sockets_left"])) for m in modes], "0")
    )

    header = ["metric", *modes, "target"]
    table = [header] + [[label, *cells, target] for label, cells, target in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in table
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines.append("")
    lines.append(
        f"Cells: median (worst) over {args.runs} runs; rows with one number are percentiles "
        f"of all calls of all runs pooled ({args.allocs} Allocates and {args.baseline_calls} "
        "GetDevicePluginOptions per run). First/last calls: the "
        f"{s[modes[0]]['allocate_edge_calls']} calls at either end of each run's Allocate "
        "sequence (the server holds more allocations as a run goes on)."
    )
    lines.append("")
    lines.append("Idle CPU by thread (median over runs):")
    for m in modes:
        for label, v in s[m]["idle_threads"].items():
            lines.append(
                f"  {m:>12}  {label:<62} {v['cpu_pct']:6.3f} %  "
                f"{v['switches_per_s']:6.1f} switches/s"
            )

    lines.append("")
    lines.append("Targets (worst run, except Allocate: p99 of the pooled calls):")
    for m in modes:
        sm = s[m]
        rss = max(sm["proc_loaded"]["rss_kb"]["max"], sm["proc_idle"]["rss_kb"]["max"]) * mb
        extra = extra_threads(sm["thread_names"])
        checks = [
            (
                f"all registered <= {t['register_s']:g} s after start",
                sm["register_s"]["max"] <= t["register_s"],
                f"worst {sm['register_s']['max']:.3f} s",
            ),
            (
                f"Allocate p99 < {t['allocate_p99_ms']:g} ms",
                sm["allocate_pooled"]["p99"] < t["allocate_p99_ms"],
                f"{sm['allocate_pooled']['p99']:.3f} ms",
            ),
            (
                f"re-registered <= {t['restart_s'] * 1000:.0f} ms after restart",
                sm["restart_s"]["max"] <= t["restart_s"],
                f"worst {sm['restart_s']['max'] * 1000:.0f} ms",
            ),
            (f"RSS < {t['rss_mb']:g} MB", rss < t["rss_mb"], f"worst {rss:.1f} MB"),
            (
                "idle CPU < 0.5 % of a core",
                sm["idle_cpu_pct"]["max"] < t["idle_cpu_pct"],
                f"worst {sm['idle_cpu_pct']['max']:.3f} %",
            ),
            (
                "one loop thread + watchfiles' threads",
                not extra,
                f"{', '.join(sm['thread_names'])}"
                + (f"; extra: {', '.join(extra)}" if extra else ""),
            ),
            (
                "exit 0 on SIGTERM, sockets removed",
                sm["exit_codes"] == [0] and not sm["sockets_left"],
                f"codes {sm['exit_codes']}, {len(sm['sockets_left'])} sockets left",
            ),
        ]
        for label, ok, observed in checks:
            lines.append(f"  {m:>12}  {label:<40} {'met' if ok else 'MISSED':<7} {observed}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="repetitions per mode (default 5)")
    parser.add_argument("--allocs", type=int, default=2000, help="Allocate calls per run")
    parser.add_argument(
        "--baseline-calls", type=int, default=500, help="GetDevicePluginOptions calls per run"
    )
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--settle", type=float, default=2.0, help="seconds before idle sampling")
    parser.add_argument(
        "--release-wait",
        type=float,
        default=45.0,
        help="at most this long after the last Allocate, wait for the server to release the "
        "allocations (release grace 7 s + PodResources poll) before idle sampling; 0: don't",
    )
    parser.add_argument("--resources", type=int, default=64)
    parser.add_argument("--devices", type=int, default=64, help="functions per resource")
    parser.add_argument("--modes", default="single,per-resource")
    parser.add_argument("--timeout", type=float, default=30.0, help="per wait, seconds")
    parser.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error")
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="don't warm the page cache (host tree, server modules) before each server start",
    )
    parser.add_argument(
        "--watch-interval",
        type=float,
        default=WATCH_INTERVAL,
        help="seconds between looks at the emulator while waiting for registrations "
        f"(default {WATCH_INTERVAL}); 0 wakes the bench on every kubelet event",
    )
    parser.add_argument(
        "--share-cpus",
        action="store_true",
        help="let the server and the emulator share every CPU, rather than run the server "
        "on the last CPU and the emulator on the others",
    )
    add_server_python(parser)
    parser.add_argument("--json", metavar="PATH", help="write raw results here")
    args = parser.parse_args(argv)
    args.cpu_split = cpu_split(args.share_cpus)
    if args.cpu_split is not None:
        pin(os.getpid(), args.cpu_split[0])  # the emulator's threads, started later, inherit it
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not 1 <= args.devices <= 256:
        parser.error("--devices must be 1..256 (one bus of functions per ID)")
    if not 1 <= args.resources <= 100:
        parser.error("--resources must be 1..100 (resource names dev00..dev99)")
    if args.runs < 1 or args.allocs < 1 or args.baseline_calls < 1:
        parser.error("--runs, --allocs and --baseline-calls must be at least 1")

    names = resource_names(args.resources)
    load_before = os.getloadavg()
    version = source_version()
    root = Path(tempfile.mkdtemp(prefix="dpb-", dir="/tmp"))
    results: dict[str, dict[str, Any]] = {}
    try:
        t0 = time.monotonic()
        write_sysfs(bench_topology(args.resources, args.devices), root)
        config = root / "config.yaml"
        config.write_text(bench_config(args.resources))
        print(
            f"host: {args.resources} IDs x {args.devices} functions in {root} "
            f"(written in {time.monotonic() - t0:.1f} s)",
            file=sys.stderr,
        )
        # Alternate the modes run by run, so drift on the machine hits both alike.
        for run in range(args.runs):
            for mode in modes:
                r = run_once(mode, run, args, root, config, names)
                results.setdefault(mode, {"runs": []})["runs"].append(r)
                print(
                    f"{mode:>12} run {run}: registered {r['register_s']:.3f} s, "
                    f"Allocate p50 {r['allocate']['p50']:.3f} / p99 {r['allocate']['p99']:.3f} ms, "
                    f"restart {r['restart_s']:.3f} s, "
                    f"RSS {r['proc_idle']['rss_kb'] / 1024:.1f} MB, "
                    f"idle {r['idle_cpu_pct']:.3f} %, exit {r['exit_code']} in {r['exit_s']:.3f} s",
                    file=sys.stderr,
                )
    except BenchError as error:
        print(f"bench_serve: {error}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(root, ignore_errors=True)

    for mode in results:
        results[mode]["summary"] = aggregate(results[mode]["runs"])
    load_after = os.getloadavg()
    machine: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "source": version,
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "cpus": describe_cpus(args.cpu_split),
    }
    print(
        f"dp-server serve benchmark: {args.resources} resources x {args.devices} devices, "
        f"{args.runs} runs per mode, {args.allocs} Allocates per run, idle {args.idle_seconds:g} s"
    )
    print(
        f"machine: nproc {machine['nproc']}, Python {machine['python']}, {machine['platform']}, "
        f"{machine['date']}, load average before/after "
        f"{load_before[0]:.2f}/{load_after[0]:.2f}"
    )
    print(f"source: {version}")
    print(f"CPUs: {machine['cpus']}")
    for mode in results:
        summary_ = results[mode]["summary"]
        print(
            f"  {mode}: server threads allowed on {' / '.join(summary_['server_cpus'])}, "
            f"bench threads on {' / '.join(summary_['bench_cpus'])}"
        )
    print()
    print(report(results, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
