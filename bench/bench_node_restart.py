"""How long a restarted node takes before dp's devices are allocatable again.

A kubelet that has just started lists no pods through PodResources until it
has synced them from the API server (at first it does not answer, then it
answers with no pods). Until then dp holds back the group
siblings of every device the kubelet's checkpoint gives a pod (kubelet_sync),
so the node's devices come back in two steps:

- registered: every resource registered and listed again; every device that
  cannot split a group is allocatable from here;
- synced: dp trusts PodResources (its `kubelet-synced` log line): the groups
  of running VMs stay held, as they must, and the group of a VM deleted while
  the kubelet was down is allocatable again (the `deleted` rows: the kubelet
  drops the VM's devices once synced, and dp sees it at its next poll and the
  checkpoint write that follows). A dp that ran through the restart holds its
  own allocation of the VM's drive besides, until `release_grace` (7 s) after
  it was made: the VM is made that much older (`--vm-age`) for that case.

Each run: the fixture node (7 resources; two NVMe drives share IOMMU group
93), the grpcio kubelet emulator in this process with the measured start-up
(`--refuse`, `--empty`), `dp-server serve` as a process of its own; a VM
holds one NVMe drive; then the kubelet restarts under dp (`kubelet`) or dp and
the kubelet restart together (`together`), with the VM still running or
deleted meanwhile. Times are from the new kubelet.sock (the emulator's
restart). Prints medians and p99 over the runs.

    python bench/bench_node_restart.py [--runs 10] [--server-python PATH]
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_serve import add_server_python, percentile, print_log_tail, server_env  # noqa: E402

from dp_server.cli.demo import DEMO_CONFIG  # noqa: E402
from dp_testing.emulator import KubeletEmulator, Startup  # noqa: E402
from dp_testing.topology import fixture_topology, write_sysfs  # noqa: E402

NVME = "devices.kubevirt.io/nvme"
RESOURCES = 7
ORDERS = ("kubelet", "together")
VMS = ("running", "deleted")


def serve(args: argparse.Namespace, host: Path, work: Path) -> tuple[subprocess.Popen[bytes], Any]:
    log = open(work / "server.log", "ab")  # noqa: SIM115 - closed by the caller
    command = [
        *(args.server_python, "-m", "dp_server", "serve"),
        *("--sysfs", str(host / "sys"), "--dev", str(host / "dev")),
        *("--config", str(host / "config.yaml"), "--device-plugin-dir", str(work / "dp")),
        *("--pod-resources-socket", str(work / "pr.sock"), "--rescan-interval", "3600"),
        *("--log-format", "json", "--state-dir", ""),
    ]
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=server_env(host))
    return server, log


def synced_at(log_path: Path, since_wall: float, timeout: float) -> float:
    """Wall-clock time of the server's first `kubelet-synced` after `since_wall`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log_path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") == "kubelet-synced" and record["ts"] >= since_wall - 0.001:
                return float(record["ts"])
        time.sleep(0.02)
    raise TimeoutError("the server never trusted PodResources")


def last_list(emulator: KubeletEmulator, since: float, healthy: int | None = None) -> float:
    """When the last resource was first listed after `since` (or, with `healthy`,
    when NVMe was first listed with that many healthy devices)."""
    firsts: dict[str, float] = {}
    for event in emulator.events_of("list"):
        if event.time < since or event.resource in firsts:
            continue
        if healthy is not None and (
            event.resource != NVME or not event.detail.endswith(f"{healthy} healthy")
        ):
            continue
        firsts[event.resource] = event.time
    return max(firsts.values())


def run_once(args: argparse.Namespace, host: Path, order: str, vm: str) -> dict[str, float]:
    work = Path(tempfile.mkdtemp(prefix="n-", dir=host))
    startup = Startup(refuse=args.refuse, empty=args.empty)
    emulator = KubeletEmulator(work / "dp", pod_resources_socket=work / "pr.sock", startup=startup)
    emulator.start()
    server, log = serve(args, host, work)
    try:
        if not emulator.wait_registered(emulator.resources() or [NVME], args.timeout, listed=True):
            raise TimeoutError("not registered")
        emulator.wait_for(lambda e: len(e.resources()) == RESOURCES, args.timeout)
        assert emulator.wait_registered(list(emulator.resources()), args.timeout, listed=True)
        emulator.admit("vm-a", "compute", {NVME: 1})
        admitted = time.monotonic()
        # dp holds the group: the other drive turns Unhealthy.
        assert emulator.wait_for(lambda e: e.allocatable()[NVME] == 1, args.timeout)
        removed = ["vm-a"] if vm == "deleted" else []
        if (order, vm) == ("kubelet", "deleted"):
            time.sleep(max(0.0, admitted + args.vm_age - time.monotonic()))
        if order == "together":
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=10)
        emulator.restart(removed=removed)
        t0 = emulator.last_restart
        assert t0 is not None
        t0_wall = time.time() - (time.monotonic() - t0)
        if order == "together":
            server, _ = serve(args, host, work)
        names = list(emulator.resources())
        assert emulator.wait_for(
            lambda e: all(any(ev.time >= t0 for ev in e.events_of("list", name)) for name in names),
            args.timeout,
            interval=0.005,
        )
        result = {"registered": last_list(emulator, t0) - t0}
        trusted = synced_at(work / "server.log", t0_wall, args.timeout)
        result["synced"] = trusted - t0_wall
        if vm == "deleted":
            assert emulator.wait_for(
                lambda e: e.allocatable()[NVME] == 2, args.timeout, interval=0.005
            )
            result["free"] = last_list(emulator, t0, healthy=2) - t0
        else:
            time.sleep(0.3)  # the running VM's group stays held once dp trusts PodResources
            assert emulator.allocatable()[NVME] == 1
        result["kubelet_synced"] = emulator.synced_at - t0
        return result
    except BaseException:
        print_log_tail(log, work / "server.log", f"{order}, {vm}")
        raise
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=10)
        log.close()
        emulator.stop()
        shutil.rmtree(work, ignore_errors=True)


def cell(values: list[float]) -> str:
    return f"{percentile(values, 50):.2f} ({percentile(values, 99):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="runs of each case (10)")
    parser.add_argument("--refuse", type=float, default=0.3, help="s PodResources refuses (0.3)")
    parser.add_argument("--empty", type=float, default=1.0, help="s it then lists no pods (1.0)")
    parser.add_argument(
        "--vm-age",
        type=float,
        default=31.0,
        help="s between the VM's admission and a kubelet restart under dp that deletes it "
        "(31: past dp's release grace, 7 s, as for a VM that ran a while)",
    )
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--json", type=Path, help="also write every sample here")
    add_server_python(parser)
    args = parser.parse_args()

    host = Path(tempfile.mkdtemp(prefix="dpn-"))
    try:
        write_sysfs(fixture_topology(), host)
        (host / "config.yaml").write_text(DEMO_CONFIG)
        samples: dict[str, list[dict[str, float]]] = {}
        for run in range(args.runs):
            for order in ORDERS:
                for vm in VMS:
                    result = run_once(args, host, order, vm)
                    samples.setdefault(f"{order}/{vm}", []).append(result)
                    print(f"run {run + 1} {order}/{vm}: {result}", file=sys.stderr)
    finally:
        shutil.rmtree(host, ignore_errors=True)
    print(
        f"\n{args.runs} runs each; the kubelet lists its pods {args.refuse + args.empty:.2f} s "
        "after its start. Seconds from the new kubelet.sock, median (p99):\n"
    )
    print("| restart | VM | all registered | dp trusts PodResources | deleted VM's group free |")
    print("|---|---|---|---|---|")
    for key, rows in samples.items():
        order, vm = key.split("/")
        free = cell([r["free"] for r in rows]) if vm == "deleted" else "held, as it must be"
        registered = cell([r["registered"] for r in rows])
        synced = cell([r["synced"] for r in rows])
        print(f"| {order} | {vm} | {registered} | {synced} | {free} |")
    if args.json is not None:
        args.json.write_text(json.dumps(samples, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
