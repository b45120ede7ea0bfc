"""Memory over a long life: many Allocates on one connection, then kubelet restarts.

A plugin connection lives as long as the kubelet, and every Allocate,
GetPreferredAllocation or PreStartContainer is a new HTTP/2 stream on it. This
starts `dp-server serve` on the same 64 × 64 host as `bench_serve.py`, then
makes `--calls` Allocates of one device of one resource (each replaces the
last, so the core holds one allocation) and prints the server's RSS and the
Allocate p50/p99 of every block of `--step` calls. Per-stream state that is
never dropped shows as RSS growing with the call count. Then the kubelet
restarts `--restarts` times; after each, once every resource is registered
again and a second and a half has passed, the RSS is printed: what a restart
leaves behind shows as RSS growing with the restart count.

    python bench/bench_soak.py [--calls 20000] [--step 5000] [--restarts 6] [--mode single]
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import (
    WATCH_INTERVAL,
    BenchError,
    add_server_python,  # noqa: E402
    all_listed_at,
    bench_config,
    bench_topology,
    percentile,
    proc_status,
    resource_names,
    restart_kubelet,
    serve_command,
    server_env,
    warm_page_cache,
)

from dp_testing.emulator import KubeletEmulator  # noqa: E402
from dp_testing.topology import write_sysfs  # noqa: E402


def rss_mb(pid: int) -> float:
    return int(proc_status(pid)["VmRSS"].split()[0]) / 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--step", type=int, default=5000)
    parser.add_argument("--restarts", type=int, default=6)
    parser.add_argument("--mode", default="single", choices=("single", "per-resource"))
    add_server_python(parser)
    args = parser.parse_args(argv)

    host = Path(tempfile.mkdtemp(prefix="dps-"))
    write_sysfs(bench_topology(64, 64), host)
    config = host / "config.yaml"
    config.write_text(bench_config(64))
    names = resource_names(64)
    warm_page_cache(host)  # and compile the bytecode, as an installed package has it
    with KubeletEmulator(host / "dp", pod_resources_socket=host / "pr.sock") as emulator:
        command = serve_command(
            args.server_python,
            host,
            config,
            host / "dp",
            host / "pr.sock",
            args.mode,
            log_level="warning",
        )
        log = open(host / "server.log", "wb")  # noqa: SIM115 - closed with the server
        server = subprocess.Popen(command, stdout=log, stderr=log, env=server_env(host))
        try:
            if not emulator.wait_registered(names, 30, listed=True):
                raise SystemExit("the server did not register every resource within 30 s")
            resource = names[0]
            device = sorted(emulator.resources()[resource].devices)[-1]
            emulator.allocate(resource, [device])
            time.sleep(1)
            start = rss_mb(server.pid)
            print(
                f"{args.mode}: {args.calls} Allocates of {device} on {resource}; "
                f"server log {host / 'server.log'}"
            )
            print("| calls | RSS (MB) | growth (MB) | Allocate p50 (ms) | p99 (ms) |")
            print("|---|---|---|---|---|")
            print(f"| 0 | {start:.1f} | | | |")
            done = 0
            while done < args.calls:
                latencies = []
                for _ in range(min(args.step, args.calls - done)):
                    t0 = time.perf_counter()
                    emulator.allocate(resource, [device])
                    latencies.append((time.perf_counter() - t0) * 1000)
                done += len(latencies)
                now = rss_mb(server.pid)
                print(
                    f"| {done} | {now:.1f} | {now - start:+.1f} | "
                    f"{percentile(latencies, 50):.3f} | {percentile(latencies, 99):.3f} |",
                    flush=True,
                )
            if args.restarts:
                print()
                print("| kubelet restarts | RSS (MB) | growth (MB) | re-registered in (s) |")
                print("|---|---|---|---|")
                print(f"| 0 | {rss_mb(server.pid):.1f} | | |")
            for restart in range(1, args.restarts + 1):
                try:
                    restarted, _ = restart_kubelet(emulator, names, 30, WATCH_INTERVAL)
                except BenchError as error:
                    raise SystemExit(f"restart {restart}: {error}") from None
                took = all_listed_at(emulator.events, set(names), restarted) - restarted
                time.sleep(1.5)  # past the collection a second after re-registering
                now = rss_mb(server.pid)
                print(f"| {restart} | {now:.1f} | {now - start:+.1f} | {took:.2f} |", flush=True)
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(10)
            log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
