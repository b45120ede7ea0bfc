"""Serving as the kubelet's own gRPC stack sees it: `dp-server serve` against gokubelet.

`bench_serve.py` measures against the grpcio emulator, whose Python client
spends some 250 µs of CPU on each call itself. gokubelet
(tests/gokubelet/main.go) is the kubelet's device manager on grpc-go, the
real kubelet's stack: this runs it against the same 64 × 64 host, in both
socket modes, and prints what it measured:

- start: from spawning the server to the last resource's first device list;
- Allocate round trips, one device each, round-robin over the resources
  (p50/p90/p99 of all calls of all runs pooled);
- kubelet restarts (the kubelet stops, every socket is deleted, kubelet.sock
  is served again): from kubelet.sock being back to the last first list.

Needs Debian's golang-go and golang-google-grpc-dev.

    python bench/bench_gokubelet.py [--runs 3] [--allocs 5000] [--restarts 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from bench_serve import (  # noqa: E402
    BenchError,
    add_server_python,
    bench_config,
    bench_topology,
    cpu_split,
    describe_cpus,
    percentile,
    pin,
    serve_command,
    server_env,
    warm_page_cache,
)

from dp_testing.topology import write_sysfs  # noqa: E402

import go_kubelet  # noqa: E402


def run_once(
    binary: Path, mode: str, host: Path, config: Path, args: argparse.Namespace
) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="g-", dir=host))
    plugin_dir = workdir / "dp"
    kubelet = go_kubelet.start(
        binary,
        plugin_dir,
        expect=args.resources,
        allocs=args.allocs,
        restarts=args.restarts,
        timeout=args.timeout,
    )
    if args.cpu_split is not None:
        pin(kubelet.pid, args.cpu_split[0])
    warm_page_cache(host)
    time.sleep(0.2)  # let kubelet.sock appear: start is timed from the server's spawn
    command = serve_command(
        args.server_python, host, config, plugin_dir, workdir / "pr.sock", mode, "info"
    )
    log = open(workdir / "server.log", "wb")  # noqa: SIM115 - closed below
    spawned = time.time()
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=server_env(host))
    if args.cpu_split is not None:
        pin(server.pid, args.cpu_split[1])
    try:
        report = go_kubelet.report(kubelet, timeout=args.timeout * (3 + args.restarts))
    finally:
        server.terminate()
        server.wait(10)
        log.close()
    if report["errors"] or report["exit_code"] != 0:
        raise BenchError(f"gokubelet: {report['errors']} (server log in {workdir})")
    return {
        "start_s": report["registered_at_unix"] - spawned,
        "allocate_ms": report["allocate_ms"],
        "restart_s": report["restart_s"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--allocs", type=int, default=5000)
    parser.add_argument("--restarts", type=int, default=5)
    parser.add_argument("--resources", type=int, default=64)
    parser.add_argument("--devices", type=int, default=64)
    parser.add_argument("--modes", default="single,per-resource")
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument(
        "--share-cpus",
        action="store_true",
        help="let the server and gokubelet share every CPU, as bench_serve.py --share-cpus",
    )
    add_server_python(parser)
    args = parser.parse_args(argv)
    args.cpu_split = cpu_split(args.share_cpus)
    why = go_kubelet.missing()
    if why is not None:
        parser.error(why)

    host = Path(tempfile.mkdtemp(prefix="dpg-"))
    write_sysfs(bench_topology(args.resources, args.devices), host)
    config = host / "config.yaml"
    config.write_text(bench_config(args.resources))
    binary = go_kubelet.build(host)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    for run in range(args.runs):
        for mode in modes:  # alternate, so drift on the machine hits both alike
            r = run_once(binary, mode, host, config, args)
            results[mode].append(r)
            calls = sorted(r["allocate_ms"])
            print(
                f"{mode:>12} run {run}: start {r['start_s']:.3f} s, Allocate p50 "
                f"{percentile(calls, 50):.3f} / p99 {percentile(calls, 99):.3f} ms, restarts "
                + " ".join(f"{s:.3f}" for s in r["restart_s"])
                + " s",
                file=sys.stderr,
            )

    print(
        f"gokubelet (grpc-go) against dp-server serve, {args.resources} resources x "
        f"{args.devices} devices, {args.runs} runs per mode"
    )
    print(f"CPUs: {describe_cpus(args.cpu_split, 'gokubelet')}")
    print(f"{'':34} " + " ".join(f"{mode:>14}" for mode in modes))

    def row(label: str, values: list[str]) -> None:
        print(f"{label:34} " + " ".join(f"{v:>14}" for v in values))

    def median_worst(values: list[float], fmt: str) -> str:
        return f"{statistics.median(values):{fmt}} ({max(values):{fmt}})"

    row(
        "start -> all listed (s)",
        [median_worst([r["start_s"] for r in results[m]], ".3f") for m in modes],
    )
    for q in (50, 90, 99):
        row(
            f"Allocate p{q} (ms, pooled)",
            [
                f"{percentile(sorted(c for r in results[m] for c in r['allocate_ms']), q):.3f}"
                for m in modes
            ],
        )
    row(
        "restart -> all listed (s)",
        [median_worst([s for r in results[m] for s in r["restart_s"]], ".3f") for m in modes],
    )
    print(f"Cells: median (worst); {args.allocs} Allocates and {args.restarts} restarts per run.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
