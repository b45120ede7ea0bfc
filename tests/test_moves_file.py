"""The moves file: what dp moved to vfio-pci, kept across restarts."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
from pathlib import Path

import pytest

from dp_core import Move, PciAddress
from dp_server.binding.moves_file import MovesFileError, MovesStore, read_moves, write_moves

GPU = Move(PciAddress.parse("0000:3b:00.0"), "nouveau", 59)
PINNED = Move(PciAddress.parse("0000:af:00.0"), "pci-stub", 135, pinned=True)
LOOSE = Move(PciAddress.parse("0000:18:00.0"), None, None)


def test_moves_written_are_read_back(tmp_path: Path) -> None:
    path = tmp_path / "state" / "moves.json"
    write_moves(path, (GPU, LOOSE, PINNED))
    assert read_moves(path) == (GPU, LOOSE, PINNED)
    assert json.loads(path.read_text())["moves"][0] == {
        "address": "0000:3b:00.0",
        "driver": "nouveau",
        "iommu_group": 59,
        "pinned": False,
    }
    write_moves(path, ())
    assert read_moves(path) == ()
    assert sorted(p.name for p in path.parent.iterdir()) == ["moves.json"]  # no partial left


def test_no_file_is_no_moves(tmp_path: Path) -> None:
    assert read_moves(tmp_path / "moves.json") == ()


@pytest.mark.parametrize(
    "text, complaint",
    [
        ("{", "not JSON"),
        ("[]", "not a version 1 moves file"),
        ('{"version": true, "moves": []}', "not a version 1 moves file"),
        ('{"version": 1, "moves": ""}', "not a version 1 moves file"),
        ('{"version": 1}', "not a version 1 moves file"),
        (
            '{"version": 1, "moves": [{"address": "0000:3b:00.0", '
            '"driver": "../../../usb/drivers/usb", "iommu_group": 59}]}',
            "$[0]",
        ),
        ('{"version": 2, "moves": []}', "not a version 1 moves file"),
        (
            '{"version": 1, "moves": [{"address": "3b:00", "driver": null, "iommu_group": 1}]}',
            "$[0].address",
        ),
        (
            '{"version": 1, "moves": [{"address": "0000:3b:00.0", "driver": 7, "iommu_group": 1}]}',
            "$[0].driver",
        ),
        (
            '{"version": 1, "moves": [{"address": "0000:3b:00.0", "driver": "x", "iommu_group": 1},'
            ' {"address": "0000:3b:00.0", "driver": null, "iommu_group": 1}]}',
            "moved twice: 0000:3b:00.0",
        ),
        (
            '{"version": 1, "moves": [{"address": "0000:3b:00.0", "driver": "x", '
            '"iommu_group": 1, "pinned": "yes"}]}',
            "$[0].pinned",
        ),
        (
            '{"version": 1, "moves": [{"address": "0000:3b:00.0", "driver": "x", '
            '"iommu_group": true}]}',
            "$[0].iommu_group",
        ),
        (
            '{"version": 1, "moves": [{"address": "0000:3b:00.0", "driver": "x"}]}',
            "required field missing @ $[0].iommu_group",
        ),
        (
            '{"version": 1, "moves": [{"address": "0000:3b:00.0", "driver": "x", "iommu_group": 1, '
            '"when": 0}]}',
            "extra fields found (when) @ $[0]",
        ),
    ],
)
def test_a_bad_file_is_an_error_naming_it_and_what_is_wrong(
    tmp_path: Path, text: str, complaint: str
) -> None:
    path = tmp_path / "moves.json"
    path.write_text(text)
    with pytest.raises(MovesFileError) as raised:
        read_moves(path)
    assert str(raised.value).startswith(f"{path}: ")
    assert complaint in str(raised.value)


def test_the_store_logs_what_it_cannot_read_or_write_and_carries_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "moves.json").write_text("{")
    store = MovesStore(str(tmp_path))
    with caplog.at_level(logging.ERROR, logger="dp"):
        assert store.recall() == ()
        blocked = MovesStore(str(tmp_path / "moves.json"))  # a file where the directory should be
        blocked.keep((GPU,))
    assert [r.getMessage() for r in caplog.records] == ["moves-unreadable", "moves-unwritable"]
    assert str(tmp_path / "moves.json") in caplog.records[0].dp_fields["reason"]  # type: ignore[attr-defined]
    nowhere = MovesStore(None)
    nowhere.keep((GPU,))
    assert nowhere.recall() == ()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a filesystem needs root (CI runs as root)")
def test_a_write_that_fails_leaves_the_old_file_and_nothing_else(tmp_path: Path) -> None:
    """A full disk, for real: a 64 KiB tmpfs with the old file in it, filled up."""
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "dp-test", str(disk)], check=True)
    try:
        path = disk / "moves.json"
        write_moves(path, (GPU,))
        filler = disk / "filler"
        with pytest.raises(OSError) as full, open(filler, "wb") as file:
            while True:
                file.write(b"\0" * 4096)
                file.flush()
        assert full.value.errno == errno.ENOSPC
        many = tuple(Move(PciAddress(0, 1, n >> 3, n & 7), "nouveau", n) for n in range(256))
        with pytest.raises(OSError) as raised:
            write_moves(path, many)
        assert raised.value.errno == errno.ENOSPC
        assert sorted(p.name for p in disk.iterdir()) == ["filler", "moves.json"]
        assert read_moves(path) == (GPU,)
    finally:
        subprocess.run(["umount", str(disk)], check=True)
