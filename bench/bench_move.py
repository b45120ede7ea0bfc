#!/usr/bin/env python3
"""Benchmark a live move of a resource from the device plugin to DRA, end to end.

`dp-server serve` runs as its own process on the fixture node (two NVMe drives
in IOMMU group 93), with a config file it watches, against three emulators in
this process: the grpcio kubelet (device plugins and PodResources), the
grpcio DRA kubelet, and the API server (on a loop of its own). Each round:

1. A VM (`vm-<n>`) is admitted with one NVMe drive through the device plugin.
2. **Move**: the config is written again (atomically) with the NVMe entry on
   `frontend: dra`. Timed from the rename to (a) the kubelet emulator's
   allocatable for `devices.kubevirt.io/nvme` being 0, and (b) the API
   emulator holding a complete pool generation with both drives (tainted:
   the VM holds their group); the move's time is the later of the two. The
   API writes it costs are counted once both hold and `--settle` s passed.
3. The VM runs until `--hold` s after its admission, and a random 0 to
   `--jitter` s more (so that the deletion falls anywhere between two of dp's
   PodResources polls, as a real one does), then is deleted: the emulator's
   PodResources stops listing it at once (a real kubelet does once the pod's
   containers have stopped). **Release**: timed from the deletion
   to the first pool generation with a drive free (no taint), and to a claim
   allocated that drive being prepared (NodePrepareResources answered
   without error), the claim made and asked for as soon as the drive is free
   (the scheduler and kubelet take no time here).
4. **Move back**: the claim is unprepared and deleted, the config written with
   `frontend: device-plugin`; timed to the kubelet's allocatable being 2 and
   the drives gone from the pool, with its API writes.

Pool times are those of the API emulator's store events; the kubelet's
allocatable is looked at every millisecond.

Usage: python3 bench/bench_move.py [--rounds 10] [--hold 8] [--jitter 10]
       [--settle 1] [--seed 1] [--server-python PATH] [--json results.json]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_dra import NODE, SCHEMA, ApiThread, Pool, kubeconfig, state_of  # noqa: E402
from bench_serve import (  # noqa: E402
    BenchError,
    add_server_python,
    print_log_tail,
    serve_command,
    server_env,
    source_version,
    stop_server,
    summary,
)

from dp_testing.dra_kubelet import Claim, DraKubeletEmulator  # noqa: E402
from dp_testing.emulator import KubeletEmulator  # noqa: E402
from dp_testing.topology import fixture_topology, write_sysfs  # noqa: E402

DRIVER = "vfio.dp.example.com"
NVME = "devices.kubevirt.io/nvme"
DRIVES = ("pci-0000-5e-00-0", "pci-0000-5e-01-0")  # the fixture's pair, IOMMU group 93
LOOK = 0.001  # how often the kubelet emulator's allocatable is looked at


def config(frontend: str) -> str:
    return (
        f"dra: {{driverName: {DRIVER}}}\n"
        "permittedHostDevices:\n"
        "  pciHostDevices:\n"
        '    - pciVendorSelector: "144D:A808"\n'
        f"      resourceName: {NVME}\n"
        f"      frontend: {frontend}\n"
        "sharedDevices:\n"
        "  devices.kubevirt.io/kvm: {enabled: false}\n"
        "  devices.kubevirt.io/tun: {enabled: false}\n"
        "  devices.kubevirt.io/vhost-net: {enabled: false}\n"
    )


def write_config(path: Path, text: str) -> float:
    """Write `path` as an operator's tooling does (a rename); the time of the rename."""
    scratch = path.with_suffix(".new")
    scratch.write_text(text)
    os.replace(scratch, path)
    return time.perf_counter()


def until(check: Callable[[], bool], timeout: float, what: str) -> float:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise BenchError(f"{what}: not within {timeout} s")
        time.sleep(LOOK)
    return time.perf_counter()


def pool_until(
    api: ApiThread, pool: Pool, check: Callable[[dict[str, Any]], bool], timeout: float, what: str
) -> float:
    """The time of the first store event after which `check` holds of the pool
    (no slices at all: an empty pool)."""
    deadline = time.monotonic() + timeout
    while True:
        while pool.seen < len(api.events):
            at, event = api.events[pool.seen]
            pool.seen += 1
            pool.apply(event)
            current = pool.current() if pool.slices else {}
            if current is not None and check(current):
                return at
        if time.monotonic() > deadline:
            raise BenchError(f"{what}: not within {timeout} s; pool {pool.current()}")
        time.sleep(LOOK)


def writes(api: ApiThread) -> dict[str, int]:
    counts = api.call(lambda: dict(api.api.requests))
    return {f"{verb} {res}": n for (verb, res), n in counts.items() if verb != "get"}


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    keys = sorted(set(after) | set(before))
    changed = {k: after.get(k, 0) - before.get(k, 0) for k in keys}
    return {k: n for k, n in changed.items() if n and not k.startswith(("list ", "watch "))}


def make_claim(api: ApiThread, name: str, device: str) -> Claim:
    def create() -> Claim:
        obj = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "devices": {"requests": [{"name": "disk", "exactly": {"deviceClassName": "vfio"}}]}
            },
            "status": {
                "allocation": {
                    "devices": {
                        "results": [
                            {"request": "disk", "driver": DRIVER, "pool": NODE, "device": device}
                        ]
                    }
                }
            },
        }
        created = api.api.store.create("resourceclaims", "default", obj)
        return Claim("default", created["metadata"]["uid"], name)

    return api.call(create)


def one_round(
    n: int,
    args: argparse.Namespace,
    api: ApiThread,
    pool: Pool,
    kubelet: KubeletEmulator,
    dra: DraKubeletEmulator,
    config_path: Path,
    rng: random.Random,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    hold = args.hold + rng.uniform(0, args.jitter)
    admitted = time.monotonic()
    kubelet.admit(f"vm-{n}", "compute", {NVME: 1})

    # The move.
    pool.until(api.events, lambda _: True, 0)
    before = writes(api)
    t0 = write_config(config_path, config("dra"))
    t_alloc = until(lambda: kubelet.allocatable().get(NVME, 0) == 0, 30, "allocatable 0")
    t_pool = pool_until(
        api, pool, lambda p: all(d in p for d in DRIVES), 30, "both drives in the pool"
    )
    time.sleep(args.settle)
    pool.until(api.events, lambda _: True, 0)
    out["move_allocatable_s"] = t_alloc - t0
    out["move_pool_s"] = t_pool - t0
    out["move_s"] = max(t_alloc, t_pool) - t0
    out["move_writes"] = delta(writes(api), before)
    current = pool.current() or {}
    out["held_shown_as"] = sorted({state_of(current.get(d)) for d in DRIVES})

    # The holder's deletion, and the waiting claim.
    time.sleep(max(0.0, admitted + hold - time.monotonic()))
    out["held_s"] = time.monotonic() - admitted
    pool.until(api.events, lambda _: True, 0)
    before = writes(api)
    t_del = time.perf_counter()
    kubelet.remove_pod(f"vm-{n}")

    def free(p: dict[str, Any]) -> bool:
        return any(state_of(p.get(d)) == "healthy" for d in DRIVES)

    t_free = pool_until(api, pool, free, 60, "a drive free in the pool")
    current = pool.current() or {}
    device = next(d for d in DRIVES if state_of(current.get(d)) == "healthy")
    claim = make_claim(api, f"wait-{n}", device)
    result = dra.prepare(DRIVER, [claim])[claim.uid]
    t_prep = time.perf_counter()
    if result.error:
        raise BenchError(f"round {n}: Prepare of {device} failed: {result.error}")
    out["release_free_s"] = t_free - t_del
    out["release_prepared_s"] = t_prep - t_del
    out["release_writes"] = delta(writes(api), before)

    # Back to the device plugin.
    errors = dra.unprepare(DRIVER, [claim])
    if errors.get(claim.uid):
        raise BenchError(f"round {n}: Unprepare failed: {errors}")
    api.call(lambda: api.api.store.delete("resourceclaims", "default", claim.name))
    pool.until(api.events, lambda _: True, 0)
    before = writes(api)
    t0 = write_config(config_path, config("device-plugin"))
    t_alloc = until(lambda: kubelet.allocatable().get(NVME, 0) == 2, 30, "allocatable 2")
    t_pool = pool_until(api, pool, lambda p: not any(d in p for d in DRIVES), 30, "drives gone")
    time.sleep(args.settle)
    pool.until(api.events, lambda _: True, 0)
    out["back_s"] = max(t_alloc, t_pool) - t0
    out["back_writes"] = delta(writes(api), before)
    return out


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    host = root / "host"
    write_sysfs(fixture_topology(), host)
    work = Path(tempfile.mkdtemp(prefix="w-", dir=root))
    cdi, state, registry, plugins, dp = (work / n for n in ("cdi", "state", "reg", "plugins", "dp"))
    for d in (cdi, state, registry, plugins, dp):
        d.mkdir()
    config_path = work / "config.yaml"
    config_path.write_text(config("device-plugin"))
    api = ApiThread(SCHEMA)
    (work / "kubeconfig").write_text(kubeconfig(api.api.url))
    kubelet = KubeletEmulator(dp, pod_resources_socket=work / "pr.sock").start()
    dra = DraKubeletEmulator(registry, poll_interval=0.02).start()
    log_path = work / "server.log"
    log_file = open(log_path, "wb")  # noqa: SIM115 - closed in finally
    server: subprocess.Popen[bytes] | None = None
    result: dict[str, Any] = {"rounds": []}
    try:
        command = [
            *serve_command(
                args.server_python, host, config_path, dp, work / "pr.sock", "single", "info"
            ),
            *("--node-name", NODE, "--kubeconfig", str(work / "kubeconfig")),
            *("--plugins-registry-dir", str(registry), "--plugins-dir", str(plugins)),
            *("--cdi-spec-dir", str(cdi), "--state-dir", str(state)),
        ]
        server = subprocess.Popen(
            command, stdout=log_file, stderr=subprocess.STDOUT, env=server_env(host), cwd=work
        )
        dra.wait_for("registered", DRIVER, timeout=30)
        until(lambda: kubelet.allocatable().get(NVME, 0) == 2, 30, "NVMe registered")
        pool = Pool()
        rng = random.Random(args.seed)
        for n in range(args.rounds):
            one = one_round(n, args, api, pool, kubelet, dra, config_path, rng)
            result["rounds"].append(one)
            print(
                f"round {n}: move {one['move_s']:.3f} s, free {one['release_free_s']:.3f} s, "
                f"prepared {one['release_prepared_s']:.3f} s, back {one['back_s']:.3f} s",
                file=sys.stderr,
            )
        if server.poll() is not None:
            raise BenchError(f"the server exited with {server.returncode}")
        result["rejected_by_schema"] = api.call(lambda: list(api.api.rejected))
        return result
    except BaseException:
        print_log_tail(log_file, log_path, "move run")
        raise
    finally:
        stop_server(server)
        log_file.close()
        if args.server_log:
            with contextlib.suppress(OSError):
                shutil.copyfile(log_path, args.server_log)
        dra.stop()
        kubelet.stop()
        api.stop()


def report(result: dict[str, Any]) -> str:
    rounds = result["rounds"]
    lines = ["| measurement | n | p50 | p90 | p99 | max |", "|---|---|---|---|---|---|"]
    rows = [
        ("config written -> allocatable 0 (s)", "move_allocatable_s"),
        ("config written -> both drives in the pool (s)", "move_pool_s"),
        ("move: the later of the two (s)", "move_s"),
        ("holder deleted -> a drive free in the pool (s)", "release_free_s"),
        ("holder deleted -> the waiting claim prepared (s)", "release_prepared_s"),
        ("move back: allocatable 2 and drives out of the pool (s)", "back_s"),
    ]
    for label, key in rows:
        s = summary([r[key] for r in rounds])
        lines.append(
            f"| {label} | {s['n']} | {s['p50']:.3f} | {s['p90']:.3f} | {s['p99']:.3f} | "
            f"{s['max']:.3f} |"
        )

    def writes_line(key: str) -> str:
        seen = sorted({json.dumps(r[key], sort_keys=True) for r in rounds})
        return "; ".join(
            ", ".join(f"{k}: {v}" for k, v in json.loads(s).items()) or "none" for s in seen
        )

    shown = sorted({s for r in rounds for s in r["held_shown_as"]})
    lines += [
        "",
        f"API writes per move: {writes_line('move_writes')}",
        f"API writes per release (deletion to Prepare): {writes_line('release_writes')}",
        f"API writes per move back: {writes_line('back_writes')}",
        f"held drives shown in the pool as: {', '.join(shown)}; objects the API emulator "
        f"refused: {len(result['rejected_by_schema'])}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="moves and moves back (10)")
    parser.add_argument(
        "--hold",
        type=float,
        default=8.0,
        help="s from a VM's admission to its deletion (8: past dp's release grace, as for "
        "a VM that ran a while)",
    )
    parser.add_argument(
        "--jitter", type=float, default=10.0, help="up to this many s more, at random (10)"
    )
    parser.add_argument(
        "--settle", type=float, default=1.0, help="s after a move before its writes are counted"
    )
    parser.add_argument("--seed", type=int, default=1, help="of the random holds (1)")
    add_server_python(parser)
    parser.add_argument("--json", metavar="PATH", help="write raw results here")
    parser.add_argument("--server-log", metavar="PATH", help="keep the server's log here")
    args = parser.parse_args(argv)
    if args.rounds < 1 or min(args.hold, args.jitter, args.settle) < 0:
        parser.error("--rounds must be >= 1, --hold, --jitter and --settle >= 0")
    version = source_version()
    root = Path(tempfile.mkdtemp(prefix="dpm-", dir="/tmp"))
    load_before = os.getloadavg()
    try:
        result = run(args, root)
    except BenchError as error:
        print(f"bench_move: {error}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
    machine = {
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "server_python": args.server_python,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python3", *sys.argv]),
        "source": version,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }
    print(f"a move of {NVME} (2 drives, one IOMMU group) between the device plugin and DRA")
    print(
        f"machine: nproc {machine['nproc']}, Python {machine['python']} (server: "
        f"{args.server_python}), {machine['date']}, load average before/after "
        f"{load_before[0]:.2f}/{machine['loadavg_after'][0]:.2f}"
    )
    print(
        f"source: {version}; {args.rounds} rounds, each holder deleted {args.hold:g}-"
        f"{args.hold + args.jitter:g} s after its admission"
    )
    print()
    print(report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "args": vars(args), "results": result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
