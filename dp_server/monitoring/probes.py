"""What the probes and /metrics say of the serving process: the policy.

`/healthz` (liveness) fails only on what a restart can mend: the timer loop
or a task dp cannot work without has ended. `/readyz` (readiness, which makes
a DaemonSet rollout wait for each node) passes once every resource is
registered with the kubelet, and the DRA driver, with the config's `dra`:
once every front end says it is ready. Each is a pure function of a
`ServerView`; the HTTP server is `endpoint`.
"""

from __future__ import annotations

import functools
import importlib.metadata

import attrs

from dp_core import MetricFamily, Sample, collect
from dp_server.monitoring.view import ServerView

__all__ = ["Check", "build_info", "runtime_families", "runtime_health", "runtime_readiness"]


@attrs.frozen
class Check:
    """The answer to a probe: whether it passes, and a line saying why."""

    ok: bool
    detail: str


@functools.cache
def build_info() -> MetricFamily:
    """dp_build_info: always 1, with the installed dp's version ("unknown" if not installed)."""
    try:
        version = importlib.metadata.version("dp")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return MetricFamily(
        "gauge",
        "dp_build_info",
        "Always 1; the version label says which dp is running.",
        (Sample((("version", version),), 1),),
    )


def runtime_health(view: ServerView) -> Check:
    # Only what a restart can mend fails the probe. Host scans that keep
    # failing would fail again after a restart, and the node would lose its
    # resources meanwhile; they show in the log and in the scan metrics.
    if view.timer_stopped():
        return Check(False, "the timer loop has stopped: no rescans, ticks or re-registrations")
    # A task that meets outages by retrying inside has ended: a bug, which a
    # restart cures. An outage never ends one, so it never fails this probe.
    ended = {name: why for name, why in view.essential_tasks().items() if why}
    if ended:
        shown = "; ".join(f"{name} ({why})" for name, why in sorted(ended.items()))
        return Check(False, f"a task dp cannot work without has ended: {shown}")
    # What a front end remarks on does not fail it either (CDI specs that
    # cannot be written: a restart would not make the directory writable).
    remarks = [remark for frontend in view.frontends for remark in frontend.remarks()]
    specs = "".join(f"; {remark}" for remark in remarks)
    if view.last_rescan is None:
        return Check(True, f"ok: starting{specs}")
    age = view.now() - view.last_rescan[0]
    failing = f", {view.rescan_failures} failed since start" if view.rescan_failures else ""
    return Check(True, f"ok: last host scan {age:.1f} s ago{failing}{specs}")


def runtime_readiness(view: ServerView) -> Check:
    """Ready once every front end is; else the last one's reason that is not
    (DRA's, when both wait: its driver registers once, resources often)."""
    parts = [frontend.readiness() for frontend in view.frontends]
    waiting = [part.detail for part in parts if not part.ready]
    if waiting:
        return Check(False, waiting[-1])
    return Check(
        True, f"ok: {' and '.join(part.detail for part in parts)} registered with the kubelet"
    )


def runtime_families(view: ServerView) -> list[MetricFamily]:
    """dp's own families: the core's, the shell's host scans, and dp_build_info.

    The `process_*` metrics are not here: prometheus-client's ProcessCollector
    adds them in the registry `start_status` builds.
    """
    shell = [
        MetricFamily(
            "counter",
            "dp_host_scan_failures_total",
            "Host scans that raised instead of finishing (each logged as rescan-failed).",
            (Sample((), view.rescan_failures),),
        )
    ]
    if view.last_rescan is not None:
        when, took = view.last_rescan
        shell.append(
            MetricFamily(
                "gauge",
                "dp_host_scan_duration_seconds",
                "How long reading sysfs and /dev took in the last host scan that finished.",
                (Sample((), round(took, 6)),),
            )
        )
        shell.append(
            MetricFamily(
                "gauge",
                "dp_host_scan_age_seconds",
                "Seconds since the last host scan that finished.",
                (Sample((), round(view.now() - when, 3)),),
            )
        )
    tasks = view.essential_tasks()
    if tasks:
        shell.append(
            MetricFamily(
                "gauge",
                "dp_task_running",
                "1 while a task dp cannot work without runs, 0 once it has ended "
                "(logged as essential-task-ended; /healthz fails).",
                tuple(
                    Sample((("task", name),), 0 if why else 1)
                    for name, why in sorted(tasks.items())
                ),
            )
        )
    wiring = [family for frontend in view.frontends for family in frontend.families()]
    return [*collect(view.node), *shell, *wiring, build_info()]
