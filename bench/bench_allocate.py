"""Allocate round trips alone, with the server's CPU per call, optionally on one vCPU.

Starts `dp-server serve` on the 64 x 64 host of `bench_serve.py` against the
grpcio emulator, makes `--calls` Allocates round-robin over the resources, and
prints the round trip p50 / p90 / p99 and the server's CPU time per call
(utime + stime over the calls). With `--pin`, this process (the emulator) and
the server both run on vCPU 0 only: the difference to an unpinned run is what
cross-vCPU wake-ups cost on the machine. A plugin must not pin itself; this
is a measurement of the machine, not a setting.

    python bench/bench_allocate.py [--calls 5000] [--runs 3] [--pin]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import (
    CLK_TCK,
    add_server_python,  # noqa: E402
    bench_config,
    bench_topology,
    percentile,
    proc_cpu_ticks,
    resource_names,
    serve_command,
    server_env,
    warm_page_cache,
)

from dp_testing.emulator import KubeletEmulator  # noqa: E402
from dp_testing.topology import write_sysfs  # noqa: E402


def timed_allocates(
    emulator: KubeletEmulator, pid: int, names: list[str], calls: int, settle: float = 0.0
) -> tuple[list[float], float]:
    """`calls` Allocates round-robin over `names`, after one untimed each.

    Returns each round trip in ms and the server's CPU (utime + stime) per call in µs.
    """
    devices = {n: sorted(emulator.resources()[n].devices) for n in names}
    for name in names:
        emulator.allocate(name, [devices[name][-1]])
    time.sleep(settle)
    before = proc_cpu_ticks(pid)
    latencies = []
    for i in range(calls):
        name = names[i % len(names)]
        device = devices[name][(i // len(names)) % len(devices[name])]
        t0 = time.perf_counter()
        emulator.allocate(name, [device])
        latencies.append((time.perf_counter() - t0) * 1000.0)
    return latencies, (proc_cpu_ticks(pid) - before) / CLK_TCK / calls * 1e6


def one_run(python: str, host: Path, calls: int, pin: bool) -> tuple[list[float], float]:
    names = resource_names(64)
    config = host / "config.yaml"
    with KubeletEmulator(host / "dp", pod_resources_socket=host / "pr.sock") as emulator:
        command = serve_command(
            python, host, config, host / "dp", host / "pr.sock", "single", "warning"
        )
        with open(host / "server.log", "wb") as log:
            server = subprocess.Popen(command, stdout=log, stderr=log, env=server_env(host))
        try:
            if pin:
                os.sched_setaffinity(server.pid, {0})
            if not emulator.wait_registered(names, 30, listed=True):
                raise SystemExit("the server did not register every resource within 30 s")
            latencies, cpu = timed_allocates(emulator, server.pid, names, calls, settle=0.5)
        finally:
            server.terminate()
            server.wait(10)
    return latencies, cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--pin", action="store_true", help="emulator and server on vCPU 0")
    add_server_python(parser)
    args = parser.parse_args(argv)
    if args.pin:
        os.sched_setaffinity(0, {0})  # before the emulator's threads start
    host = Path(tempfile.mkdtemp(prefix="dpa-"))
    write_sysfs(bench_topology(64, 64), host)
    (host / "config.yaml").write_text(bench_config(64))
    warm_page_cache(host)
    print(f"{'pinned to vCPU 0' if args.pin else 'unpinned'}, {args.calls} Allocates per run")
    for run in range(args.runs):
        latencies, cpu = one_run(args.server_python, host, args.calls, args.pin)
        print(
            f"  run {run}: p50 {percentile(latencies, 50):.3f} / p90 "
            f"{percentile(latencies, 90):.3f} / p99 {percentile(latencies, 99):.3f} ms, "
            f"server CPU {cpu:.0f} us per call",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
