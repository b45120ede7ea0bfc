#!/usr/bin/env python3
"""Peak memory of `dp-server serve` with both front ends under load: what the
DaemonSet's memory request and limit are set from.

One server process (`python -m dp_server serve`) serves, at the same time:

- the device-plugin front end: `--dp-ids` vendor:device IDs x `--functions`
  functions (default 64 x 64 = 4,096 devices, bench_serve's load) plus the
  shared devices kvm, tun and vhost-net, to the grpcio kubelet emulator with
  its PodResources API. `--pods` pods are admitted one device each (and so
  held, listed by PodResources), then `--allocs` more Allocate calls are made;
- the DRA front end: `--dra-ids` IDs x `--functions` functions, plus 4 IOMMU
  groups of two functions (default 8 x 64 + 8 = 520 devices), published as
  ResourceSlices to the API-server emulator (every write checked against the
  schema); `--claims` claims are prepared one device each and held;
- while the claims and pods are held: `--health-changes` removals and returns
  of a DRA device's /dev/vfio node, each republishing the pool's slices, with
  the host rescanned every `--rescan-interval` seconds (each rescan builds a
  new host model beside the old one until the old one is collected).

At the end it reads the server's peak resident set (`VmHWM` of
/proc/<pid>/status, what the kernel's memory cgroup limit compares with) and
its RSS then. Usage:

    python3 bench/bench_memory.py [--server-python PATH] [--json results.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_dra import (  # noqa: E402
    DRIVER,
    NODE,
    SCHEMA,
    ApiThread,
    Pool,
    attribute,
    check_prepared,
    dra_topology,
    kubeconfig,
    make_claims,
    state_of,
)
from bench_serve import (  # noqa: E402
    VENDOR,
    BenchError,
    add_server_python,
    print_log_tail,
    proc_snapshot,
    resource_names,
    serve_command,
    server_env,
    source_version,
    stop_server,
    warm_page_cache,
)

from dp_testing.dra_kubelet import DraKubeletEmulator  # noqa: E402
from dp_testing.emulator import KubeletEmulator  # noqa: E402
from dp_testing.topology import write_sysfs  # noqa: E402

SHARED = ("devices.kubevirt.io/kvm", "devices.kubevirt.io/tun", "devices.kubevirt.io/vhost-net")


def config_text(dra_ids: int, dp_ids: int, dra: bool) -> str:
    """IDs 0..dra_ids-1 and the two-function groups' ID on DRA, the rest on
    the device-plugin front end, and the shared devices on (the most dp
    serves). Without `dra`, the DRA IDs are not selected at all."""
    total = dra_ids + dp_ids
    names = resource_names(total + 1)
    lines = [f"dra: {{driverName: {DRIVER}}}"] if dra else []
    lines += ["permittedHostDevices:", "  pciHostDevices:"]
    for i, name in enumerate(names):
        if not dra and (i < dra_ids or i == total):
            continue
        lines.append(f'    - pciVendorSelector: "{VENDOR:04X}:{0x1000 + i:04X}"')
        lines.append(f'      resourceName: "{name}"')
        if i < dra_ids or i == total:
            lines.append("      frontend: dra")
    lines.append("sharedDevices:")
    lines += [f"  {name}: {{count: 110}}" for name in SHARED]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    total = args.dra_ids + args.dp_ids
    dp_names = resource_names(total + 1)[args.dra_ids : total]
    config = root / "config.yaml"
    config.write_text(config_text(args.dra_ids, args.dp_ids, not args.device_plugin_only))
    work = Path(tempfile.mkdtemp(prefix="w-", dir=root))
    cdi, state, registry, plugins, dp_dir = (
        work / n for n in ("cdi", "state", "reg", "plugins", "dp")
    )
    for d in (cdi, state, registry, plugins, dp_dir):
        d.mkdir()
    log_path = work / "server.log"
    api = ApiThread(SCHEMA)
    (work / "kubeconfig").write_text(kubeconfig(api.api.url))
    dra_kubelet = DraKubeletEmulator(registry, poll_interval=0.02).start()
    kubelet = KubeletEmulator(dp_dir, pod_resources_socket=work / "pr.sock").start()
    result: dict[str, Any] = {}
    server: subprocess.Popen[bytes] | None = None
    log_file = open(log_path, "wb")  # noqa: SIM115 - closed in finally
    try:
        command = [
            *serve_command(
                args.server_python, root, config, dp_dir, work / "pr.sock", "single", "info"
            ),
            # After serve_command's --rescan-interval 3600: the last one counts.
            *("--rescan-interval", str(args.rescan_interval), "--state-dir", str(state)),
        ]
        if not args.device_plugin_only:
            command += [
                *("--node-name", NODE, "--kubeconfig", str(work / "kubeconfig")),
                *("--plugins-registry-dir", str(registry), "--plugins-dir", str(plugins)),
                *("--cdi-spec-dir", str(cdi)),
            ]
        warm_page_cache(root)
        server = subprocess.Popen(
            command, stdout=log_file, stderr=subprocess.STDOUT, env=server_env(root), cwd=work
        )
        pid = server.pid
        if not kubelet.wait_registered([*dp_names, *SHARED], args.timeout, listed=True):
            raise BenchError(f"not every device-plugin resource registered in {args.timeout} s")
        pool = Pool()
        if not args.device_plugin_only:
            dra_kubelet.wait_for("registered", DRIVER, timeout=args.timeout)
            expected = args.dra_ids * args.functions + 3 * 4
            if pool.until(api.events, lambda p: len(p) == expected, args.timeout) is None:
                raise BenchError(f"no complete pool of {expected} devices in {args.timeout} s")
        result["proc_started"] = proc_snapshot(pid)

        # The device-plugin front end: pods holding devices, then Allocates.
        for i in range(args.pods):
            kubelet.admit(f"pod-{i}", "vm", {dp_names[i % len(dp_names)]: 1})
        devices = {n: sorted(kubelet.resources()[n].devices) for n in dp_names}
        for i in range(args.allocs):
            name = dp_names[i % len(dp_names)]
            kubelet.allocate(name, [devices[name][(i // len(dp_names)) % len(devices[name])]])
        result["proc_dp_loaded"] = proc_snapshot(pid)

        if args.device_plugin_only:
            return finish(args, result, pid, server, api, kubelet)

        # The DRA front end: claims prepared and held.
        current = pool.current()
        assert current is not None
        by_group: dict[int, str] = {}
        for name in sorted(n for n in current if not n.startswith("iommu-group-")):
            by_group.setdefault(int(attribute(current[name], "iommuGroup")), name)
        free = [by_group[g] for g in sorted(by_group)]
        if len(free) < args.claims:
            raise BenchError(f"{len(free)} IOMMU groups, fewer than --claims {args.claims}")
        claims = make_claims(api, "held", free[: args.claims])
        for claim, device in zip(claims, free, strict=False):
            check_prepared(dra_kubelet.prepare(DRIVER, [claim]), [claim], [device], cdi)
        result["proc_claims_held"] = proc_snapshot(pid)

        # Slices republished while everything is held, with rescans running.
        targets = [(by_group[g], g) for g in sorted(by_group)[:: max(1, len(by_group) // 20)]]
        for i in range(args.health_changes):
            device, group = targets[i % len(targets)]
            node = root / "dev" / "vfio" / str(group)
            for change, wanted in ((node.unlink, False), (node.touch, True)):
                change()
                if (
                    pool.until(
                        api.events,
                        lambda p, d=device, w=wanted: (state_of(p.get(d)) == "healthy") is w,
                        10,
                    )
                    is None
                ):
                    raise BenchError(f"{device}: the slices did not follow {node} in 10 s")
        return finish(args, result, pid, server, api, kubelet)
    except BaseException:
        print_log_tail(log_file, log_path, "memory run")
        raise
    finally:
        stop_server(server)
        log_file.close()
        kubelet.stop()
        dra_kubelet.stop()
        api.stop()


def finish(
    args: argparse.Namespace,
    result: dict[str, Any],
    pid: int,
    server: subprocess.Popen[bytes],
    api: ApiThread,
    kubelet: KubeletEmulator,
) -> dict[str, Any]:
    time.sleep(2 * args.rescan_interval)  # a rescan or two more, and their collection
    result["proc_end"] = proc_snapshot(pid)
    result["slice_writes"] = api.call(lambda: api.api.writes)
    result["rejected_by_schema"] = len(api.call(lambda: list(api.api.rejected)))
    result["pods_listed"] = len(kubelet.pods())
    if server.poll() is not None:
        raise BenchError(f"the server exited with {server.returncode}")
    return result


def report(r: dict[str, Any], args: argparse.Namespace) -> str:
    def mib(kb: int) -> str:
        return f"{kb / 1024:.1f} MiB"

    dra = "no DRA" if args.device_plugin_only else f"{args.dra_ids} x {args.functions} + 8 DRA"
    lines = [
        f"dp {r['version']}, Python {r['python']}; "
        f"{args.dp_ids} x {args.functions} device-plugin devices + shared devices, "
        f"{dra} devices",
        "| phase | RSS | peak (VmHWM) | threads |",
        "|---|---|---|---|",
    ]
    phases = [
        ("started, everything registered and published", "proc_started"),
        (f"{args.pods} pods admitted, {args.allocs} Allocates", "proc_dp_loaded"),
        (f"{args.claims} claims prepared and held", "proc_claims_held"),
        (
            (
                ""
                if args.device_plugin_only
                else f"{args.health_changes} health changes republished, "
            )
            + f"rescans every {args.rescan_interval:g} s",
            "proc_end",
        ),
    ]
    for label, key in phases:
        if key not in r:
            continue
        p = r[key]
        lines.append(f"| {label} | {mib(p['rss_kb'])} | {mib(p['hwm_kb'])} | {p['threads']} |")
    lines.append(
        f"\nPeak RSS {mib(r['proc_end']['hwm_kb'])}; slice writes {r['slice_writes']}, "
        f"refused by the schema {r['rejected_by_schema']}; pods listed {r['pods_listed']}"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp-ids", type=int, default=64, help="device-plugin IDs (64)")
    parser.add_argument("--dra-ids", type=int, default=8, help="DRA IDs (8)")
    parser.add_argument("--functions", type=int, default=64, help="functions per ID (64)")
    parser.add_argument("--pods", type=int, default=512, help="pods admitted, 1 device each")
    parser.add_argument("--allocs", type=int, default=2000, help="Allocate calls (2000)")
    parser.add_argument("--claims", type=int, default=400, help="claims held (400)")
    parser.add_argument("--health-changes", type=int, default=20, help="(20)")
    parser.add_argument("--rescan-interval", type=float, default=2.0, help="seconds (2)")
    parser.add_argument("--timeout", type=float, default=120.0, help="per wait, seconds")
    parser.add_argument(
        "--device-plugin-only",
        action="store_true",
        help="no dra section: the device-plugin front end alone (the base DaemonSet)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the raw results here")
    add_server_python(parser)
    args = parser.parse_args(argv)
    # Short: unix socket paths must stay under 108 bytes.
    with tempfile.TemporaryDirectory(prefix="dpm-", dir="/tmp") as tmp:
        root = Path(tmp)
        write_sysfs(dra_topology(args.dra_ids + args.dp_ids, args.functions, 4), root)
        try:
            result = run(args, root)
        except BenchError as error:
            print(f"bench_memory: {error}", file=sys.stderr)
            return 1
    result["version"] = source_version()
    result["python"] = platform.python_version()
    result["command"] = " ".join(["python3", *sys.argv])
    print(report(result, args))
    if args.json:
        with contextlib.suppress(OSError):
            Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
