"""The runnable examples run, and say what they promise."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_plugin_author_example_drives_the_core_to_an_allocation() -> None:
    script = EXAMPLES / "plugin_author.py"
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=True
    )
    out = result.stdout
    assert "registered nvidia.com/TU104GL_Tesla_T4 on connection 2" in out
    assert (
        "Publish on stream 2 for nvidia.com/TU104GL_Tesla_T4: 1 devices (0000:3b:00.0), 1 Healthy"
        in out
    )
    assert "  devices: /dev/vfio/vfio, /dev/vfio/10\n" in out
    assert "  env: {'PCI_RESOURCE_NVIDIA_COM_TU104GL_TESLA_T4': '0000:3b:00.0'}\n" in out
    assert "Allocate 0000:00:00.0: INVALID_ARGUMENT: unknown device ID '0000:00:00.0'" in out
    assert "dp_resource_allocated_devices{'resource': 'nvidia.com/TU104GL_Tesla_T4'} = 1" in out
    held = "IOMMU group 10 is held by allocation #1 of nvidia.com/TU104GL_Tesla_T4 (0000:3b:00.0)"
    assert held in out


def test_plugin_author_example_needs_nothing_but_dp_core() -> None:
    tree = ast.parse((EXAMPLES / "plugin_author.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported == {"__future__", "dp_core"}
