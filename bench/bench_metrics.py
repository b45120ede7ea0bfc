"""What `--metrics-address` costs, and what a scrape of /metrics costs.

For each run, starts `dp-server serve` on the 64 x 64 host of `bench_serve.py`
against the grpcio emulator twice, without and with `--metrics-address` (the
order alternating between runs), and
measures in each: RSS and threads after registration and a settle, the
Allocate round trip p50 / p99 and the server's CPU per Allocate (the Tally
counts every call). With metrics on it also scrapes /metrics `--scrapes`
times and reports the scrape's p50 / p99, the body size and the series count
(dp's families and prometheus-client's process_* and python_info, all rendered
by prometheus-client on the server's own loop).

    python bench/bench_metrics.py [--runs 4] [--calls 3000] [--scrapes 200]
"""

from __future__ import annotations

import argparse
import http.client
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_allocate import timed_allocates  # noqa: E402
from bench_serve import (
    CLK_TCK,
    add_server_python,  # noqa: E402
    bench_config,
    bench_topology,
    percentile,
    proc_cpu_ticks,
    proc_status,
    resource_names,
    serve_command,
    server_env,
    warm_page_cache,
)

from dp_testing.emulator import KubeletEmulator  # noqa: E402
from dp_testing.topology import write_sysfs  # noqa: E402


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def scrape(port: int) -> tuple[float, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        started = time.perf_counter()
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        body = response.read()
        elapsed = (time.perf_counter() - started) * 1000.0
        if response.status != 200:
            raise SystemExit(f"/metrics answered {response.status}: {body[:200]!r}")
        return elapsed, body
    finally:
        connection.close()


def one_run(
    python: str, host: Path, metrics: bool, calls: int, scrapes: int, settle: float
) -> dict[str, Any]:
    names = resource_names(64)
    port = free_port()
    result: dict[str, Any] = {}
    with KubeletEmulator(host / "dp", pod_resources_socket=host / "pr.sock") as emulator:
        command = serve_command(
            python,
            host,
            host / "config.yaml",
            host / "dp",
            host / "pr.sock",
            "single",
            "warning",
        )
        if metrics:
            command += ["--metrics-address", f"127.0.0.1:{port}"]
        with open(host / "server.log", "wb") as log:
            server = subprocess.Popen(command, stdout=log, stderr=log, env=server_env(host))
        try:
            if not emulator.wait_registered(names, 30, listed=True):
                raise SystemExit("the server did not register every resource within 30 s")
            time.sleep(settle)
            status = proc_status(server.pid)
            result["rss_mb"] = int(status["VmRSS"].split()[0]) / 1024
            result["threads"] = int(status["Threads"])
            latencies, result["cpu_us"] = timed_allocates(emulator, server.pid, names, calls)
            result["p50"] = percentile(latencies, 50)
            result["p99"] = percentile(latencies, 99)
            if metrics:
                times, body = [], b""
                before = proc_cpu_ticks(server.pid)
                for _ in range(scrapes):
                    elapsed, body = scrape(port)
                    times.append(elapsed)
                result["scrape_cpu_ms"] = (
                    (proc_cpu_ticks(server.pid) - before) / CLK_TCK / scrapes * 1e3
                )
                result["scrape_p50"] = percentile(times, 50)
                result["scrape_p99"] = percentile(times, 99)
                result["body_kb"] = len(body) / 1024
                result["series"] = sum(
                    1 for line in body.splitlines() if line and not line.startswith(b"#")
                )
        finally:
            server.terminate()
            server.wait(10)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--scrapes", type=int, default=200)
    parser.add_argument("--settle", type=float, default=5.0, help="seconds before RSS is read")
    add_server_python(parser)
    args = parser.parse_args(argv)
    host = Path(tempfile.mkdtemp(prefix="dpm-"))
    write_sysfs(bench_topology(64, 64), host)
    (host / "config.yaml").write_text(bench_config(64))
    warm_page_cache(host)
    print(f"64 resources x 64 devices, {args.calls} Allocates per server, single-socket mode")
    for run in range(args.runs):
        # Alternate which server goes first, so a drift in the machine's speed
        # does not always land on the same side.
        for metrics in (False, True) if run % 2 == 0 else (True, False):
            r = one_run(args.server_python, host, metrics, args.calls, args.scrapes, args.settle)
            line = (
                f"  run {run} metrics {'on ' if metrics else 'off'}: RSS {r['rss_mb']:.1f} MB, "
                f"{r['threads']} threads, Allocate p50 {r['p50']:.3f} / p99 {r['p99']:.3f} ms, "
                f"server CPU {r['cpu_us']:.0f} us per call"
            )
            if metrics:
                line += (
                    f"; /metrics p50 {r['scrape_p50']:.2f} / p99 {r['scrape_p99']:.2f} ms, "
                    f"server CPU {r['scrape_cpu_ms']:.2f} ms per scrape, "
                    f"{r['body_kb']:.0f} KiB, {r['series']} series"
                )
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
