"""Time the core's Allocate, without sockets: `Node.handle` plus the wire encoding.

Builds the same 64 resources × 64 devices host and config as `bench_serve.py`,
registers every resource through the core's inputs the way a kubelet does
(connection, GetDevicePluginOptions, Register reply, ListAndWatch), then times
`--allocs` Allocates of one device each, round-robin over the resources, with
the answer encoded as the server sends it. Prints p50, p99 and max in
microseconds: the share of an Allocate round trip that is ours, as opposed to
grpclib's, h2's and asyncio's (compare `bench_serve.py`'s Allocate rows).

    python bench/bench_core.py [--allocs N] [--resources R] [--devices D]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

from dp_core import (
    AllocateRequested,
    ConnectionOpened,
    HostObserved,
    KubeletStarted,
    OptionsRequested,
    Register,
    RegistrationSucceeded,
    Reply,
    SocketMode,
    StandardNode,
    WatchStarted,
)
from dp_server.config.loader import parse_config
from dp_server.deviceplugin import wire
from dp_testing.topology import to_snapshot

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import bench_config, bench_topology, resource_names  # noqa: E402


def live_node(resources: int, devices: int) -> tuple[StandardNode, dict[str, int]]:
    """A node with every resource registered, bound to a connection and watched."""
    node = StandardNode(
        parse_config(bench_config(resources), "bench"), socket_mode=SocketMode.SINGLE
    )
    ids = itertools.count(1)
    pending = node.handle(HostObserved(to_snapshot(bench_topology(resources, devices)), 0.0))
    pending += node.handle(KubeletStarted(0.0))
    connection_of: dict[str, int] = {}
    while registers := [e for e in pending if isinstance(e, Register)]:
        pending = []
        for register in registers:
            connection = next(ids)
            pending += node.handle(ConnectionOpened(connection, 0.0, None))
            pending += node.handle(OptionsRequested(connection, next(ids), 0.0))
            pending += node.handle(RegistrationSucceeded(register.resource, register.attempt, 0.0))
            pending += node.handle(WatchStarted(connection, next(ids), 0.0))
            connection_of[register.resource] = connection
    return node, connection_of


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--allocs", type=int, default=4000, help="timed Allocates (4000)")
    parser.add_argument("--resources", type=int, default=64, help="resources (64)")
    parser.add_argument("--devices", type=int, default=64, help="devices per resource (64)")
    args = parser.parse_args(argv)

    node, connection_of = live_node(args.resources, args.devices)
    names = resource_names(args.resources)
    if sorted(connection_of) != sorted(names):
        print(f"only {len(connection_of)} of {len(names)} resources registered", file=sys.stderr)
        return 1
    devices = {name: [d.id for d in node.device_plugin.advertised(name)] for name in names}
    calls = itertools.count(1_000_000)
    micros = []
    for i in range(args.allocs):
        name = names[i % len(names)]
        device = devices[name][(i // len(names)) % len(devices[name])]
        started = time.perf_counter()
        effects = node.handle(
            AllocateRequested(connection_of[name], next(calls), ((device,),), float(i) * 1e-3)
        )
        answer = next(e.answer for e in effects if isinstance(e, Reply))
        wire.allocate_response(answer)  # type: ignore[arg-type]
        micros.append((time.perf_counter() - started) * 1e6)
    micros.sort()
    p99 = micros[min(len(micros) - 1, int(len(micros) * 0.99))]
    print(
        f"core Allocate + encoding, {args.resources} x {args.devices}, {args.allocs} calls, "
        f"{len(node.device_plugin.allocations)} allocations held at the end: "
        f"p50 {statistics.median(micros):.0f} us, p99 {p99:.0f} us, max {micros[-1]:.0f} us"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
