"""The committed generated code must match what `scripts/gen_protos.py` produces.

Both generated trees (betterproto2 for the server, protobuf `api_pb2` for the
kubelet emulator) are committed; a proto edit without regeneration would make
the two gRPC stacks disagree silently, so this fails loudly instead.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_fresh() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr or proc.stdout


def test_emulator_messages_import_side_by_side() -> None:
    """Both api.proto files register in one descriptor pool without clashing."""
    from dp_testing.emulator.pb.deviceplugin.v1beta1 import api_pb2 as dp_pb2
    from dp_testing.emulator.pb.podresources.v1 import api_pb2 as pr_pb2

    assert dp_pb2.DESCRIPTOR.package == "v1beta1"
    assert pr_pb2.DESCRIPTOR.package == "v1"
    assert dp_pb2.DESCRIPTOR.services_by_name["Registration"].full_name == "v1beta1.Registration"
    assert pr_pb2.DESCRIPTOR.services_by_name["PodResourcesLister"].methods_by_name["List"]


def test_emulator_dra_messages_import_side_by_side() -> None:
    """The DRA and registration protos keep the kubelet's package names, hence its RPC paths."""
    from dp_testing.emulator.pb.dra.v1 import api_pb2 as dra_v1
    from dp_testing.emulator.pb.dra.v1beta1 import api_pb2 as dra_v1beta1
    from dp_testing.emulator.pb.pluginregistration.v1 import api_pb2 as reg

    for module, version in ((dra_v1, "v1"), (dra_v1beta1, "v1beta1")):
        service = module.DESCRIPTOR.services_by_name["DRAPlugin"]
        assert service.full_name == f"k8s.io.kubelet.pkg.apis.dra.{version}.DRAPlugin"
        assert sorted(service.methods_by_name) == [
            "NodePrepareResources",
            "NodeUnprepareResources",
        ]
        device = module.DESCRIPTOR.message_types_by_name["Device"]
        assert [(f.name, f.number) for f in device.fields] == [
            ("request_names", 1),
            ("pool_name", 2),
            ("device_name", 3),
            ("cdi_device_ids", 4),
        ]
    registration = reg.DESCRIPTOR.services_by_name["Registration"]
    assert registration.full_name == "pluginregistration.Registration"
    assert sorted(registration.methods_by_name) == ["GetInfo", "NotifyRegistrationStatus"]


def test_server_dra_modules_do_not_shadow_the_device_plugin_ones() -> None:
    """betterproto2 names modules after proto packages: the DRA ones nest under k8s/."""
    from dp_server.proto import pluginregistration, v1, v1beta1
    from dp_server.proto.k8s.io.kubelet.pkg.apis.dra import v1 as dra_v1
    from dp_server.proto.k8s.io.kubelet.pkg.apis.dra import v1beta1 as dra_v1beta1

    assert hasattr(v1beta1, "DevicePluginBase") and hasattr(v1, "ListPodResourcesRequest")
    assert "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources" in (
        dra_v1.DraPluginBase().__mapping__()
    )
    assert "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodeUnprepareResources" in (
        dra_v1beta1.DraPluginBase().__mapping__()
    )
    assert "/pluginregistration.Registration/GetInfo" in (
        pluginregistration.RegistrationBase().__mapping__()
    )


@pytest.mark.parametrize("version", ["v1alpha1", "v1"])
def test_the_dra_health_stream_keeps_the_kubelets_package_and_fields(version: str) -> None:
    """The kubelet 1.36 calls /v1alpha1.DRAResourceHealth/NodeWatchResources,
    the 1.37 one /v1.DRAResourceHealth/NodeWatchResources: the same messages."""
    import importlib

    server = importlib.import_module(f"dp_server.proto.{version}")
    health = importlib.import_module(f"dp_testing.emulator.pb.drahealth.{version}.api_pb2")

    service = health.DESCRIPTOR.services_by_name["DRAResourceHealth"]
    assert service.full_name == f"{version}.DRAResourceHealth"
    assert not service.methods_by_name["NodeWatchResources"].client_streaming
    assert service.methods_by_name["NodeWatchResources"].server_streaming
    device = health.DESCRIPTOR.message_types_by_name["DeviceHealth"]
    assert [(f.name, f.number) for f in device.fields] == [
        ("device", 1),
        ("health", 2),
        ("last_updated_time", 3),
        ("health_check_timeout_seconds", 4),
        ("message", 5),
    ]
    assert [
        (v.name, v.number) for v in health.DESCRIPTOR.enum_types_by_name["HealthStatus"].values
    ] == [
        ("UNKNOWN", 0),
        ("HEALTHY", 1),
        ("UNHEALTHY", 2),
    ]
    assert f"/{version}.DRAResourceHealth/NodeWatchResources" in (
        server.DraResourceHealthBase().__mapping__()
    )


def test_the_health_v1_shares_its_package_with_podresources_and_no_name() -> None:
    """Both protos' package is plain `v1`: one server module holds both."""
    from dp_server.proto import v1
    from dp_testing.emulator.pb.drahealth.v1 import api_pb2 as health
    from dp_testing.emulator.pb.podresources.v1 import api_pb2 as podresources

    names = [set(module.DESCRIPTOR.message_types_by_name) for module in (health, podresources)]
    assert names[0] and names[1] and not names[0] & names[1]
    assert {"/v1.PodResourcesLister/List", "/v1.DRAResourceHealth/NodeWatchResources"} <= (
        set(v1.PodResourcesListerBase().__mapping__())
        | set(v1.DraResourceHealthBase().__mapping__())
    )
