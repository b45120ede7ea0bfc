"""Which file changes the server acts on."""

from __future__ import annotations

from pathlib import Path

import pytest

from dp_server.watcher import touches_file


@pytest.mark.parametrize(
    ("name", "touches"),
    [
        ("config.yaml", True),
        ("..data", True),
        ("..data_tmp", True),
        ("..2026_11_22_08_00_00.123", True),
        ("notes.txt", False),
        ("config.yaml.swp", False),
        ("pr.sock", False),
    ],
)
def test_which_changes_beside_the_config_file_reload_it(name: str, touches: bool) -> None:
    config = Path("/etc/dp/config.yaml")
    assert touches_file({Path("/etc/dp") / name}, config) is touches
    assert not touches_file({Path("/elsewhere") / name}, config)
