"""The committed generated code must match what `scripts/gen_protos.py` produces.

Both generated trees (betterproto2 for the server, protobuf `api_pb2` for the
kubelet emulator) are committed; a proto edit without regeneration would make
the two gRPC stacks disagree silently, so this fails loudly instead.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
