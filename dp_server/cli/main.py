"""`dp-server`: scan, serve and demo."""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import math
import os
import signal
import sys
from collections.abc import Callable, Collection, Sequence
from typing import NoReturn

from dp_core import Config, PciId, SocketMode, build_inventory, plan_bindings
from dp_core.config import DEVICE_PLUGIN
from dp_server.cli.settings import pci_names
from dp_server.config.loader import ConfigFileError, read_config_file
from dp_server.host.roots import root_problems
from dp_server.host.scanner import scan_host
from dp_server.monitoring.logs import configure_logging

__all__ = ["main"]

EXIT_CONFIG = 2  # a bad config or flag, `scan --sysfs` or `--dev` naming no such root included
EXIT_FAILED = 1  # the server stopped itself (a restart is what it needs), or output failed
EXIT_PIPE = 141  # the reader went away (`| head`), as for a process SIGPIPE ended
DRA_CDI_SPEC_DIR = "/var/run/cdi"
# A rescan reads all of sysfs's PCI tree; more often than once a second is a
# busy loop on a large host, and less than daily leaves a change unseen for long.
RESCAN_INTERVAL_RANGE = (1.0, 86400.0)
_log = logging.getLogger("dp.cli")


def load_settings(
    path: str | None, kubevirt_resources: Collection[str] | None = None
) -> tuple[Config, dict[PciId, str]]:
    """The config and, in pci-ids naming mode, the PCI ID database names; notes logged."""
    loaded = read_config_file(path, kubevirt_resources)
    loaded.log_notes()
    names, missing = pci_names(loaded.config)
    if missing is not None:
        _log.warning(
            "pci-ids-missing",
            extra={"dp_fields": {"fallback": "vendor_device names"}},
        )
    return loaded.config, names


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage mistake said in one line (as every other error is)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_CONFIG, f"{self.prog}: {message} (see {self.prog} --help)\n")


def seconds_between(low: float, high: float) -> Callable[[str], float]:
    """An argparse type: a number of seconds from `low` to `high`."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not low <= value <= high:  # NaN is in no range
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a number of seconds from {low:g} to {high:g}"
            )
        return value

    return parse


def _host_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sysfs", default="/sys", help="sysfs root (default: /sys)")
    parser.add_argument("--dev", default="/dev", help="dev root (default: /dev)")
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="YAML config file: dp's own or a KubeVirt CR (default: none, which serves "
        "every function bound to vfio-pci and kvm, tun and vhost-net)",
    )
    _kubevirt_resources_argument(parser)


def _kubevirt_resources_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kubevirt-resources",
        type=resource_names,
        default=None,
        metavar="NAME[,NAME...]",
        help="with a KubeVirt CR as --config: serve only these of the entries it leaves to "
        "outside plugins (externalResourceProvider: true); the others are left to another "
        "outside plugin (default: serve all of them)",
    )


def resource_names(text: str) -> tuple[str, ...]:
    """An argparse type: a comma-separated list of resource names, at least one."""
    names = tuple(name.strip() for name in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of names")
    return names


def _log_arguments(parser: argparse.ArgumentParser, default_level: str) -> None:
    parser.add_argument(
        "--log-format", choices=("text", "json"), default="text", help="(default: text)"
    )
    parser.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default=default_level,
        help=f"(default: {default_level})",
    )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dp")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dp-server",
        description="One-socket Kubernetes device plugin for VFIO, mdev and shared devices.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    scan = commands.add_parser("scan", help="show what would be advertised; changes nothing")
    _host_arguments(scan)
    scan.add_argument(
        "--format", choices=("table", "json"), default="table", help="(default: table)"
    )

    classes = commands.add_parser(
        "device-classes",
        help="print the DeviceClass of each resource the config serves through DRA (YAML)",
    )
    classes.add_argument(
        "--config",
        required=True,
        metavar="FILE",
        help="YAML config file: dp's own or a KubeVirt CR",
    )
    _kubevirt_resources_argument(classes)

    serve = commands.add_parser("serve", help="serve the kubelet")
    _host_arguments(serve)
    serve.add_argument(
        "--device-plugin-dir",
        default="/var/lib/kubelet/device-plugins",
        metavar="DIR",
        help="the kubelet's device-plugin directory, where its kubelet.sock is and dp's "
        "socket goes; the kubelet makes it, dp waits for it "
        "(default: /var/lib/kubelet/device-plugins)",
    )
    serve.add_argument(
        "--pod-resources-socket",
        default="/var/lib/kubelet/pod-resources/kubelet.sock",
        metavar="PATH",
        help="the kubelet's PodResources API, which says what pods hold "
        "(default: /var/lib/kubelet/pod-resources/kubelet.sock)",
    )
    serve.add_argument(
        "--socket-mode",
        choices=[mode.value for mode in SocketMode],
        default=SocketMode.SINGLE.value,
        help="one socket for every resource, or one per resource (default: single)",
    )
    serve.add_argument(
        "--rescan-interval",
        type=seconds_between(*RESCAN_INTERVAL_RANGE),
        default=30.0,
        metavar="SECONDS",
        help="seconds between full host rescans, from 1 to 86400; changes in /dev/vfio are "
        "seen at once besides (default: 30)",
    )
    serve.add_argument(
        "--state-dir",
        default="/run/dp",
        help="where to keep what dp moved to vfio-pci, so a restarted dp can give it back: "
        "a host directory that outlives the pod but not a reboot, which undoes the moves "
        "(default /run/dp; '' keeps nothing)",
    )
    serve.add_argument(
        "--cdi-spec-dir",
        default=None,
        metavar="DIR",
        help="keep a CDI spec per resource in DIR and name the devices in Allocate's "
        "cdi_devices: /var/run/cdi is where runtimes look (default: off; "
        f"{DRA_CDI_SPEC_DIR} when the config has dra, whose claims always get CDI specs)",
    )
    dra = serve.add_argument_group("the DRA front end (with the config's dra section)")
    dra.add_argument(
        "--kubeconfig",
        default=None,
        metavar="FILE",
        help="how to reach the API server (default: the pod's service account)",
    )
    dra.add_argument(
        "--node-name",
        default=os.environ.get("NODE_NAME") or None,
        metavar="NAME",
        help="this node's name, which names its ResourceSlice pool (default: $NODE_NAME)",
    )
    dra.add_argument(
        "--plugins-registry-dir",
        default="/var/lib/kubelet/plugins_registry",
        metavar="DIR",
        help="the kubelet's plugin watcher directory, for <driver>-reg.sock "
        "(default /var/lib/kubelet/plugins_registry)",
    )
    dra.add_argument(
        "--plugins-dir",
        default="/var/lib/kubelet/plugins",
        metavar="DIR",
        help="where <driver>/dra.sock and the claims' device metadata go "
        "(default /var/lib/kubelet/plugins)",
    )
    serve.add_argument(
        "--metrics-address",
        default=None,
        metavar="HOST:PORT",
        help="serve /metrics, /healthz and /readyz over HTTP here: :9475 (every address), "
        "127.0.0.1:9475, [::1]:9475 (default: off)",
    )
    _log_arguments(serve, "info")

    demo = commands.add_parser(
        "demo", help="serve the built-in fixture node to a built-in kubelet emulator"
    )
    demo.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="YAML config to serve the fixture node with (default: the demo's own)",
    )
    _kubevirt_resources_argument(demo)
    demo.add_argument(
        "--socket-mode",
        choices=[mode.value for mode in SocketMode],
        default="single",
        help="(default: single)",
    )
    # The demo prints its own report; only real trouble belongs on stderr.
    _log_arguments(demo, "error")
    return parser


def parse_address(text: str) -> tuple[str | None, int]:
    """`host:port`, `:port` (every address, IPv4 and IPv6) or `[v6]:port`, as (host, port)."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"{text!r} is not HOST:PORT (for example :9475 or 127.0.0.1:9475)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"{text!r}: write an IPv6 host in brackets, as [{host}]:{port_text}")
    return host or None, int(port_text)


def _scan(args: argparse.Namespace) -> int:
    import json

    from dp_server.cli.explain import explain
    from dp_server.cli.report import frontend_rows, inventory_document, inventory_table

    loaded = read_config_file(args.config, args.kubevirt_resources)
    config = loaded.config
    names, missing = pci_names(config)
    shared_paths = [device.path for device in config.enabled_shared_devices]
    snapshot = scan_host(args.sysfs, args.dev, dev_paths=shared_paths)
    # What `serve` would bind, shown and never done: scan writes nothing.
    plan = plan_bindings(snapshot, config)
    # The device-plugin API's view: a device DRA offers is listed as skipped, saying so.
    whole = build_inventory(snapshot, config, names, plan)
    inventory = whole.offered_by(DEVICE_PLUGIN)
    explained = explain(loaded, snapshot, args.sysfs, [missing] if missing else [])
    driver = config.dra.driver_name if config.dra is not None else None
    frontends = frontend_rows(whole, driver)
    if args.format == "json":
        document = inventory_document(inventory, snapshot, plan, explained, frontends)
        print(json.dumps(document, indent=2))
    else:
        print(inventory_table(inventory, snapshot, plan, explained, frontends))
    # The report says what is wrong with the place; the status lets a script
    # tell it from a host where nothing matches, which is an answer (0).
    return EXIT_CONFIG if root_problems(args.sysfs, args.dev) else 0


def _device_classes(args: argparse.Namespace) -> int:
    from dp_core.dra import device_classes
    from dp_server.cli.deviceclasses import render

    loaded = read_config_file(args.config, args.kubevirt_resources)
    names, _ = pci_names(loaded.config)
    classes, problems = device_classes(loaded.config, names)
    if problems:
        for problem in problems:
            say_error(f"{args.config}: {problem}")
        return EXIT_CONFIG
    print(render(classes), end="")
    return 0


async def _serve_until_signalled(args: argparse.Namespace) -> int:
    from dp_server.runtime.runtime import Runtime, Settings, SettingsError

    config, names = load_settings(args.config, args.kubevirt_resources)
    metrics_address = None
    if args.metrics_address is not None:
        try:
            metrics_address = parse_address(args.metrics_address)
        except ValueError as error:
            say_error(f"--metrics-address: {error}")
            return EXIT_CONFIG
    settings = Settings(
        sysfs=args.sysfs,
        dev=args.dev,
        device_plugin_dir=args.device_plugin_dir,
        pod_resources_socket=args.pod_resources_socket,
        socket_mode=SocketMode(args.socket_mode),
        rescan_interval=args.rescan_interval,
        config_path=args.config,
        metrics_address=metrics_address,
        state_dir=args.state_dir or None,
        cdi_spec_dir=args.cdi_spec_dir or (DRA_CDI_SPEC_DIR if config.dra is not None else None),
        node_name=args.node_name or None,
        plugins_registry_dir=args.plugins_registry_dir,
        plugins_dir=args.plugins_dir,
        kubeconfig=args.kubeconfig or None,
    )
    try:
        runtime = Runtime(
            settings,
            config,
            pci_names=names,
            reload=lambda: load_settings(args.config, args.kubevirt_resources),
        )
    except SettingsError as error:
        say_error(error)
        return EXIT_CONFIG
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, runtime.stop)
    try:
        await runtime.run()
    except SettingsError as error:
        say_error(error)
        return EXIT_CONFIG
    if runtime.failure is not None:
        say_error(runtime.failure)
        return EXIT_FAILED
    return 0


def _exit_now_if_a_write_hangs(code: int) -> None:
    """Leave at once if a sysfs write the stop gave up on is still running.

    Its daemon thread may be stuck in the kernel for good; the interpreter's
    shutdown would not wait for it, but a thread that wakes to log during
    that shutdown can abort the process over stderr's lock. Everything dp
    owes is done by now (sockets removed, moves file written): flush the logs
    and go.
    """
    from dp_server.binding.queue import writes_running

    if writes_running():
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def say_error(message: object) -> None:
    """An error for the operator on stderr, every line of it marked as dp-server's."""
    for line in str(message).splitlines() or [""]:
        print(f"dp-server: {line}", file=sys.stderr)


def _quiet_after_broken_pipe() -> int:
    # The reader left (`dp-server scan | head`).
    _discard_stdout()
    return EXIT_PIPE


# A write to stdout that fails for good: a full disk or device, a quota, I/O.
_CANNOT_WRITE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})


def _discard_stdout() -> None:
    # What is still buffered must not raise again when the interpreter
    # flushes stdout on its way out.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # scan's report holds its warnings (the config's notes, what it could not
    # read); logged too, each would be printed twice.
    configure_logging(getattr(args, "log_format", "text"), getattr(args, "log_level", "error"))
    try:
        if args.command == "scan":
            code = _scan(args)
            sys.stdout.flush()  # a reader that left is found here, not at exit
            return code
        if args.command == "device-classes":
            code = _device_classes(args)
            sys.stdout.flush()
            return code
        if args.command == "serve":
            code = asyncio.run(_serve_until_signalled(args))
            _exit_now_if_a_write_hangs(code)
            return code
        if args.command == "demo":
            from dp_server.cli.demo import run_demo
            from dp_server.cli.demo_node import DemoError

            try:
                code = run_demo(args)
            except DemoError as error:
                say_error(f"demo: {error}")
                return EXIT_CONFIG
            sys.stdout.flush()
            return code
    except ConfigFileError as error:
        say_error(error)
        return EXIT_CONFIG
    except BrokenPipeError:
        return _quiet_after_broken_pipe()
    except OSError as error:
        if error.errno not in _CANNOT_WRITE or error.filename is not None:
            raise
        # stdout is full or failing (`scan > /dev/full`): a line, not a traceback.
        say_error(f"{args.command}: cannot write the output: {error.strerror}")
        _discard_stdout()
        return EXIT_FAILED
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
