"""`serve --cdi-spec-dir` on the fixture node, against the kubelet emulator: the specs
written, Allocate's cdi_devices resolved by an independent reader, and a directory
that cannot be written."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging

import pytest
from cdi_reader import DeviceNode, read_dir, resolve
from cdi_schema import schema_errors
from prometheus_client.parser import text_string_to_metric_families

from dp_server.cli.main import build_parser

from e2e_harness import ALL, GPU, KVM, QAT, VGPU, Harness

LOCAL = ("127.0.0.1", 0)


def _get(port: int, path: str) -> tuple[int, str]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


async def _status(harness: Harness, path: str) -> tuple[int, str]:
    assert harness.runtime is not None and harness.runtime.status_address is not None
    return await asyncio.to_thread(_get, harness.runtime.status_address[1], path)


async def _metric(harness: Harness, name: str) -> float:
    _, body = await _status(harness, "/metrics")
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} is not reported")


def test_the_flag_is_off_by_default() -> None:
    parser = build_parser()
    assert parser.parse_args(["serve"]).cdi_spec_dir is None
    args = parser.parse_args(["serve", "--cdi-spec-dir", "/var/run/cdi"])
    assert args.cdi_spec_dir == "/var/run/cdi"


async def test_allocate_names_devices_the_written_specs_resolve_to_its_nodes(
    harness: Harness,
) -> None:
    cdi = harness.root / "cdi"
    cdi.mkdir()
    (cdi / "nvidia.yaml").write_text("foreign\n")
    await harness.serve(cdi_spec_dir=str(cdi))
    files = sorted(path.name for path in cdi.iterdir())
    assert len(files) == len(ALL) + 1 and "nvidia.yaml" in files
    for name in files:
        if name.endswith(".json"):
            assert schema_errors(json.loads((cdi / name).read_bytes())) == [], name
    specs = read_dir(cdi)
    assert len(specs) == len(ALL)
    # Every advertised device whose nodes exist is in its resource's spec, under its
    # own name, healthy or not: the fixture's 0000:d8:00.0 is Unhealthy (a sibling on
    # snd_hda_intel) and listed; 0000:6b:00.4's /dev/vfio/111 is missing, and it is not.
    listed = await harness.kubelet("resources")
    missing_node = {"0000:6b:00.4"}
    for resource in ALL:
        ids = {d.id for d in listed[resource].devices.values()}
        (spec,) = [s for s in specs if s.kind.endswith("/dp-" + resource.partition("/")[2])]
        assert set(spec.devices) == ids - missing_node, resource
    assert not listed[GPU].devices["0000:d8:00.0"].healthy

    responses = await harness.kubelet("admit", "vm", "compute", {GPU: 1, KVM: 1, VGPU: 1, QAT: 2})
    for resource, response in responses.items():
        names = [device.name for device in response.cdi_devices]
        assert len(names) == (2 if resource == QAT else 1), resource
        resolved: set[DeviceNode] = set()
        for name in names:
            edits = resolve(specs, name)
            resolved.update(edits.device_nodes)
        given = {DeviceNode(d.container_path, d.host_path, d.permissions) for d in response.devices}
        assert resolved == given, resource
        # The env var stays Allocate's: it lists every device of the container.
        if resource == QAT:
            (value,) = response.envs.values()
            assert len(value.split(",")) == 2 and all(n.split("=")[1] in value for n in names)
    assert (cdi / "nvidia.yaml").read_text() == "foreign\n"


async def test_shutdown_leaves_the_specs_and_a_restart_rewrites_them(harness: Harness) -> None:
    cdi = harness.root / "cdi"
    cdi.mkdir()
    await harness.serve(cdi_spec_dir=str(cdi))
    written = {path.name: path.read_bytes() for path in cdi.iterdir()}
    assert len(written) == len(ALL)
    assert harness.runtime is not None
    harness.runtime.stop()
    async with asyncio.timeout(10):  # shut down once its socket is removed
        while [name for name in harness.sockets() if name != "kubelet.sock"]:
            await asyncio.sleep(0.02)
    assert {path.name: path.read_bytes() for path in cdi.iterdir()} == written
    # While dp was away, one file was lost and one resource's file is left over.
    lost = sorted(written)[0]
    (cdi / lost).unlink()
    (cdi / "dp-example.com_gone.json").write_bytes(written[sorted(written)[1]])
    await harness.start_server(cdi_spec_dir=str(cdi))
    assert {path.name: path.read_bytes() for path in cdi.iterdir()} == written


async def test_a_missing_directory_leaves_allocate_without_cdi_names_until_it_exists(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="dp")
    cdi = harness.root / "cdi"
    runtime = await harness.serve(cdi_spec_dir=str(cdi), metrics_address=LOCAL)
    response = await harness.kubelet("allocate", GPU, ["0000:3b:00.0"])
    assert list(response.cdi_devices) == [] and len(response.devices) == 2
    runtime.rescan()  # each scan retries; the error is logged once
    runtime.rescan()
    errors = [r for r in caplog.records if r.getMessage() == "cdi-specs-not-written"]
    assert len(errors) == 1
    fields = errors[0].dp_fields  # type: ignore[attr-defined]
    assert fields["reason"] == f"cannot list {cdi}: No such file or directory"
    status, health = await _status(harness, "/healthz")
    assert status == 200
    assert f"CDI specs not in place: cannot list {cdi}: No such file or directory" in health
    assert await _metric(harness, "dp_cdi_specs_ok") == 0
    assert await _metric(harness, "dp_cdi_specs") == 0  # none is in place: no directory
    assert await _metric(harness, "dp_cdi_spec_errors_total") == 3

    cdi.mkdir()
    runtime.rescan()
    assert len(read_dir(cdi)) == len(ALL)
    assert await _metric(harness, "dp_cdi_specs_ok") == 1
    assert await _metric(harness, "dp_cdi_specs") == len(ALL)
    assert "CDI" not in (await _status(harness, "/healthz"))[1]
    assert [r.getMessage() for r in caplog.records].count("cdi-specs-written") == 1
    response = await harness.kubelet("allocate", GPU, ["0000:3b:00.0"])
    (name,) = [device.name for device in response.cdi_devices]
    assert resolve(read_dir(cdi), name).device_nodes == tuple(
        DeviceNode(d.container_path, d.host_path, d.permissions) for d in response.devices
    )
