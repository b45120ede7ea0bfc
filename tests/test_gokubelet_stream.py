"""gokubelet's stream mode, which the real-kernel guest drives, against `dp-server serve`.

The guest's scenarios change the host while dp serves and wait for the
kubelet to hear of it; here the same client and kubelet run on the fixture
host, where a VFIO node is removed by hand.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dp_server.cli.demo import DEMO_CONFIG
from dp_testing.topology import fixture_topology, write_sysfs

import go_kubelet

GPU = "nvidia.com/TU104GL_Tesla_T4"


def test_events_and_allocate_on_demand(gokubelet: Path, tmp_path: Path) -> None:
    sysfs, dev = write_sysfs(fixture_topology(), tmp_path / "host")
    config = tmp_path / "config.yaml"
    config.write_text(DEMO_CONFIG)
    kubelet = go_kubelet.StreamingKubelet(gokubelet, tmp_path / "dp")
    server = subprocess.Popen(
        [sys.executable, "-m", "dp_server", "serve", "--config", str(config)]
        + ["--sysfs", str(sysfs), "--dev", str(dev), "--device-plugin-dir", str(tmp_path / "dp")]
        + ["--pod-resources-socket", str(tmp_path / "pod-resources.sock")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        listed = kubelet.wait_list(GPU, lambda devices: len(devices) == 3, timeout=30)
        assert listed is not None, kubelet.events
        assert kubelet.wait(lambda e: e == {**e, "event": "registered", "resource": GPU}, 0)
        health = {d["id"]: d["health"] for d in listed["devices"]}
        assert health == {
            "0000:3b:00.0": "Healthy",
            "0000:af:00.0": "Healthy",
            "0000:d8:00.0": "Unhealthy",
        }

        answer = kubelet.allocate(GPU, ["0000:3b:00.0"])
        assert answer["error"] == ""
        (container,) = answer["containers"]
        assert [d["host_path"] for d in container["devices"]] == ["/dev/vfio/vfio", "/dev/vfio/59"]
        assert container["envs"] == {"PCI_RESOURCE_NVIDIA_COM_TU104GL_TESLA_T4": "0000:3b:00.0"}
        refused = kubelet.allocate(GPU, ["0000:d8:00.0"])
        assert (
            refused["error"].startswith("FailedPrecondition: ")
            and "0000:d8:00.0" in refused["error"]
        ), refused

        # The node goes: the next list has the device Unhealthy, and says when it came.
        (dev / "vfio" / "175").unlink()
        changed = kubelet.wait_list(
            GPU,
            lambda devices: {d["id"]: d["health"] for d in devices}["0000:af:00.0"] == "Unhealthy",
            timeout=30,
        )
        assert changed is not None and changed["at"] > listed["at"]
    finally:
        end = kubelet.close()
        server.terminate()
        _, log = server.communicate(timeout=30)
    assert end == {**(end or {}), "event": "end", "errors": []}, kubelet.events
    assert server.returncode == 0 and "Traceback" not in log


@pytest.mark.parametrize("command", ["allocate", "shout loudly", "allocate nvidia.com/x a b"])
def test_a_bad_command_is_an_error_at_the_end(
    gokubelet: Path, tmp_path: Path, command: str
) -> None:
    kubelet = go_kubelet.StreamingKubelet(gokubelet, tmp_path / "dp")
    kubelet.send(command)
    end = kubelet.close()
    assert end is not None and end["errors"] == [f"unknown command {command!r}".replace("'", '"')]
