"""The layers and the absence of import cycles, as pyproject.toml's
import-linter contracts state them (docs/architecture.md draws them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tools import installed_tool

ROOT = Path(__file__).resolve().parent.parent


def test_every_import_contract_is_kept() -> None:
    command = installed_tool("lint-imports")
    assert command is not None, "import-linter is a test dependency: pip install -e '.[test]'"
    run = subprocess.run(
        [command, "--config", str(ROOT / "pyproject.toml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "BROKEN" not in run.stdout
    kept = [line for line in run.stdout.splitlines() if line.endswith(" KEPT")]
    assert len(kept) >= 5, run.stdout


def test_the_server_command_loads_no_test_support() -> None:
    probe = (
        "import sys\n"
        "import dp_server.cli, dp_server.runtime.runtime\n"
        "print(sorted(m for m in ('dp_testing', 'hypothesis', 'pytest', 'grpc') "
        "if m in sys.modules))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert run.stdout.strip() == "[]"
