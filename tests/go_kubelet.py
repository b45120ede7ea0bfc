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
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).parent / "gokubelet" / "main.go"
GOPATH = Path("/usr/share/gocode")  # where Debian's golang-*-dev packages put their source
PACKAGES = "golang-go golang-google-grpc-dev"

__all__ = ["PACKAGES", "awaiting_change", "build", "missing", "report", "start", "start_dra"]


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
    timeout: float = 30.0,
) -> subprocess.Popen[str]:
    """Run gokubelet as the kubelet's DRA side (tests/gokubelet/dra.go) on `registry_dir`.

    It registers the first DRA plugin whose socket appears there, prepares and
    unprepares `claims` (namespace, name, uid), then for each restart forgets
    the plugin, registers it again and prepares the claims again; the report
    comes on stdout at the end (`report`).
    """
    return subprocess.Popen(
        [
            str(binary),
            *("-dra-registry", str(registry_dir), "-timeout", f"{timeout}s"),
            *("-dra-claims", ",".join("/".join(claim) for claim in claims)),
            *("-dra-restarts", str(restarts), "-dra-services", ",".join(services)),
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
