"""Time `scan_host` on a large generated host.

Writes a generated topology (default 10,000 PCI functions) to a temporary
directory once, checks that one scan returns exactly the expected snapshot (a
fast scan of the wrong answer is worth nothing), then times `--runs` scans and
prints min, median, p99 and max in milliseconds. The target is a median under
1 s for 10,000 functions on a 2-core machine.

    python bench/bench_scan.py [--devices N] [--runs K] [--seed S] [--dir DIR]

`--dir` picks where the tree is written; the default is /dev/shm when it
exists, because tmpfs, like sysfs, is memory-backed, so the numbers reflect
the scanner rather than a disk's dentry cache.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from dp_server.host.scanner import scan_host
from dp_testing.generator import generate_topology
from dp_testing.topology import SHARED_DEV_PATHS, to_snapshot, write_sysfs


def _percentile(samples: list[float], fraction: float) -> float:
    """Nearest-rank percentile: with few runs p99 is the maximum, stated plainly."""
    ordered = sorted(samples)
    rank = max(1, min(len(ordered), round(fraction * len(ordered) + 0.5)))
    return ordered[rank - 1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=10_000, help="PCI functions (10000)")
    parser.add_argument("--runs", type=int, default=15, help="timed scans, at least 7 (15)")
    parser.add_argument("--seed", type=int, default=0, help="topology seed (0)")
    default_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None
    parser.add_argument("--dir", default=default_dir, help="where to write the tree")
    args = parser.parse_args(argv)
    if args.runs < 7:
        parser.error("--runs must be at least 7")

    started = time.perf_counter()
    topology = generate_topology(args.devices, seed=args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="dp-bench-scan-", dir=args.dir))
    try:
        sysfs_root, dev_root = write_sysfs(topology, workdir)
        setup = time.perf_counter() - started
        expected = to_snapshot(topology, SHARED_DEV_PATHS)
        first = scan_host(sysfs_root, dev_root, SHARED_DEV_PATHS)  # also warms caches
        if first != expected:
            print("scan result differs from the expected snapshot", file=sys.stderr)
            return 1

        samples: list[float] = []
        cpu: list[float] = []
        for _ in range(args.runs):
            gc.collect()
            begin, begin_cpu = time.perf_counter(), time.process_time()
            scan_host(sysfs_root, dev_root, SHARED_DEV_PATHS)
            samples.append((time.perf_counter() - begin) * 1000)
            cpu.append((time.process_time() - begin_cpu) * 1000)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print(
        f"scan_host: {len(topology.pci)} PCI functions, {len(first.iommu_groups)} groups, "
        f"{len(topology.mdevs)} mdevs; tree in {args.dir or tempfile.gettempdir()}, "
        f"written in {setup:.1f} s; {args.runs} runs on {os.cpu_count()} CPUs"
    )
    print(
        f"wall: min {min(samples):.0f} ms  median {statistics.median(samples):.0f} ms  "
        f"p99 {_percentile(samples, 0.99):.0f} ms  max {max(samples):.0f} ms"
    )
    # CPU time is less sensitive to other processes on a shared machine; the load
    # average says how shared it was while the runs went on.
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"cpu:  min {min(cpu):.0f} ms  median {statistics.median(cpu):.0f} ms  "
        f"max {max(cpu):.0f} ms; 1-min load average at the end {load:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
