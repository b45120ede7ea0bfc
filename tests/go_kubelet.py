"""Build and run `gokubelet` (tests/gokubelet/main.go), a kubelet device manager
on grpc-go, the real kubelet's gRPC stack.

It builds from Debian's packages alone (`golang-go`, `golang-google-grpc-dev`;
`.ci/run` installs them), in GOPATH mode against /usr/share/gocode.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).parent / "gokubelet" / "main.go"
GOPATH = Path("/usr/share/gocode")  # where Debian's golang-*-dev packages put their source
PACKAGES = "golang-go golang-google-grpc-dev"

__all__ = [
    "PACKAGES",
    "StreamingKubelet",
    "awaiting_change",
    "build",
    "health_changes",
    "missing",
    "report",
    "start",
    "start_dra",
]


def missing() -> str | None:
    """Why gokubelet cannot be built here, or None if it can."""
    if shutil.which("go") is None:
        return f"no `go` on PATH (apt-get install {PACKAGES})"
    if not (GOPATH / "src" / "google.golang.org" / "grpc").is_dir():
        return f"no grpc-go under {GOPATH} (apt-get install {PACKAGES})"
    return None


def build(directory: Path) -> Path:
    """Compile gokubelet into `directory`; raises with go's output on failure."""
    binary = directory / "gokubelet"
    # Static (no cgo): it also runs in a guest with no C library of its own.
    env = {
        **os.environ,
        "GO111MODULE": "off",
        "GOPATH": str(GOPATH),
        "GOFLAGS": "",
        "CGO_ENABLED": "0",
    }
    result = subprocess.run(
        ["go", "build", "-o", str(binary), *map(str, sorted(SOURCE.parent.glob("*.go")))],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode != 0:
        raise RuntimeError(f"go build {SOURCE} failed:\n{result.stdout}{result.stderr}")
    return binary


def start(
    binary: Path,
    plugin_dir: Path,
    *,
    expect: int,
    allocs: int = 0,
    restarts: int = 0,
    dial: str = "sync",
    await_change: float = 0.0,
    break_connection: bool = False,
    linger: float = 0.0,
    timeout: float = 30.0,
    pod_resources: Path | None = None,
    sync: tuple[float, float] = (0.0, 0.0),
    pods: dict[str, str] | None = None,
    admit: str | None = None,
    admit_after: str | None = None,
    admit_delay: float = 0.0,
) -> subprocess.Popen[str]:
    """Serve kubelet.sock in `plugin_dir`; the report comes on stdout at the end.

    With `await_change`, once the sample calls are done gokubelet writes
    `awaiting-change` on stderr and waits that long for device lists to be
    sent again (see `awaiting_change`). With `break_connection`, it then closes
    the first resource's connection and times its return (`break_s`); a
    client whose stream ended is held `linger` seconds before it is dropped.

    With `pod_resources` it serves PodResources List there, from its pods
    (tests/gokubelet/pods.go): nothing listens for `sync[0]` seconds after a
    start, then no pods are listed for `sync[1]`, then the active pods:
    `pods` (namespace/name -> UID, the ones the API server has bound here) and
    those it admits. `admit` admits default/vm-a (UID uid-vm-a) with one
    device of that resource once listed; `admit_after` admits default/vm-b
    once synced, `admit_delay` later; then it reports and stops."""
    plugin_dir.mkdir(parents=True, exist_ok=True)
    pod_flags: list[str] = []
    if pod_resources is not None:
        pod_flags += ["-pod-resources", str(pod_resources)]
        pod_flags += ["-sync-refuse", f"{sync[0]}s", "-sync-empty", f"{sync[1]}s"]
    if pods:
        pod_flags += ["-pods", ",".join(f"{key}={uid}" for key, uid in pods.items())]
    if admit is not None:
        pod_flags += ["-admit", admit]
    if admit_after is not None:
        pod_flags += ["-admit-after", admit_after, "-admit-delay", f"{admit_delay}s"]
    return subprocess.Popen(
        [
            str(binary),
            *("-dir", str(plugin_dir), "-expect", str(expect), "-dial", dial),
            *("-allocs", str(allocs), "-restarts", str(restarts), "-timeout", f"{timeout}s"),
            *("-await-change", f"{await_change}s", "-linger", f"{linger}s"),
            *(("-break",) if break_connection else ()),
            *pod_flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def start_dra(
    binary: Path,
    registry_dir: Path,
    claims: list[tuple[str, str, str]],
    *,
    restarts: int = 0,
    services: tuple[str, ...] = ("v1.DRAPlugin", "v1beta1.DRAPlugin"),
    health_expect: tuple[str, ...] = (),
    health_retry: float = 5.0,
    health_opens: int = 0,
    release: str = "1.36",
    timeout: float = 30.0,
) -> subprocess.Popen[str]:
    """Run gokubelet as the kubelet's DRA side (tests/gokubelet/dra.go) on `registry_dir`.

    It registers the first DRA plugin whose socket appears there, opening its
    health stream (again `health_retry` s after each end) as a kubelet of
    `release` does ("1.36": v1alpha1, always; "1.37": v1 if the plugin
    advertised it, else v1alpha1 if it advertised that, else none), prepares `claims`
    (namespace, name, uid), follows the first claim's health until it has
    read each of `health_expect` in turn (each change a `health <uid> <state>`
    line on stderr: `health_changes`), waits until it has asked for the health
    stream `health_opens` times, unprepares them, then for each restart
    forgets the plugin, registers it again and prepares the claims again; the
    report comes on stdout at the end (`report`).
    """
    return subprocess.Popen(
        [
            str(binary),
            *("-dra-registry", str(registry_dir), "-timeout", f"{timeout}s"),
            *("-dra-claims", ",".join("/".join(claim) for claim in claims)),
            *("-dra-restarts", str(restarts), "-dra-services", ",".join(services)),
            *("-dra-health-expect", ",".join(health_expect)),
            *("-dra-health-retry", f"{health_retry}s"),
            *("-dra-health-opens", str(health_opens)),
            *("-dra-release", release),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def awaiting_change(kubelet: subprocess.Popen[str]) -> bool:
    """Block until gokubelet waits for a device list change; False if it ended first."""
    assert kubelet.stderr is not None
    for line in kubelet.stderr:
        if line.strip() == "awaiting-change":
            return True
    return False


def health_changes(kubelet: subprocess.Popen[str]) -> Iterator[tuple[str, str]]:
    """Each change of the followed claim's health, (uid, state), as gokubelet sees it."""
    assert kubelet.stderr is not None
    for line in kubelet.stderr:
        words = line.split()
        if len(words) == 3 and words[0] == "health":
            yield words[1], words[2]


def report(kubelet: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    """Wait for gokubelet to finish its scenario and return its JSON report."""
    out, err = kubelet.communicate(timeout=timeout)
    try:
        result: dict[str, Any] = json.loads(out)
    except json.JSONDecodeError:
        raise AssertionError(
            f"gokubelet exited {kubelet.returncode} without a report:\n{out}{err}"
        ) from None
    result["exit_code"] = kubelet.returncode
    result["stderr"] = err
    return result


Event = dict[str, Any]


class StreamingKubelet:
    """gokubelet -stream (tests/gokubelet/stream.go): each registration and
    device list as it comes, and Allocate when asked.

    Only the standard library, so the real-kernel guest runs it as well.
    Waits are on the events themselves: `wait` returns as soon as one that
    satisfies the check has arrived, however loaded the machine is.
    """

    def __init__(
        self, binary: Path | str, plugin_dir: Path | str, pod_resources: Path | None = None
    ) -> None:
        """`pod_resources`: also serve the PodResources API there (no pod holds anything)."""
        Path(plugin_dir).mkdir(parents=True, exist_ok=True)
        extra = ["-pod-resources", str(pod_resources)] if pod_resources else []
        self.process = subprocess.Popen(
            [str(binary), "-stream", "-dir", str(plugin_dir), *extra],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.events: list[Event] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                event = {"event": "garbage", "line": line}
            with self._changed:
                self.events.append(event)
                self._changed.notify_all()
        with self._changed:
            self.events.append({"event": "exited"})
            self._changed.notify_all()

    def wait(self, check: Callable[[Event], bool], timeout: float, after: int = 0) -> Event | None:
        """The first event from index `after` on that satisfies `check`, or None at `timeout`."""
        deadline = time.monotonic() + timeout
        seen = after
        with self._changed:
            while True:
                for event in self.events[seen:]:
                    if check(event):
                        return event
                seen = len(self.events)
                if self.events and self.events[-1]["event"] == "exited":
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._changed.wait(left)

    def devices(self, resource: str) -> list[dict[str, Any]] | None:
        """The resource's latest device list, or None before its first."""
        with self._changed:
            for event in reversed(self.events):
                if event["event"] == "list" and event["resource"] == resource:
                    devices: list[dict[str, Any]] = event["devices"] or []
                    return devices
        return None

    def wait_list(
        self, resource: str, check: Callable[[list[dict[str, Any]]], bool], timeout: float
    ) -> Event | None:
        """The first list of `resource` (the current one included) that satisfies `check`."""
        with self._changed:
            start = max(
                (
                    i
                    for i, e in enumerate(self.events)
                    if e["event"] == "list" and e["resource"] == resource
                ),
                default=len(self.events),
            )
        return self.wait(
            lambda e: (
                e["event"] == "list" and e["resource"] == resource and check(e["devices"] or [])
            ),
            timeout,
            after=start,
        )

    def allocate(self, resource: str, ids: list[str], timeout: float = 30.0) -> Event:
        with self._changed:
            after = len(self.events)
        self.send(f"allocate {resource} {','.join(ids)}")
        answer = self.wait(
            lambda e: e["event"] == "allocated" and e["resource"] == resource, timeout, after
        )
        if answer is None:
            raise AssertionError(f"no answer to Allocate({resource}, {ids}) within {timeout} s")
        return answer

    def send(self, line: str) -> None:
        """One command line, as stream.go reads them."""
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def close(self, timeout: float = 30.0) -> Event | None:
        """Stop the kubelet; its "end" event (with any errors it saw), or None."""
        try:
            self.send("quit")
        except (BrokenPipeError, ValueError):
            pass
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._reader.join(timeout)
        return next((e for e in self.events if e["event"] == "end"), None)
