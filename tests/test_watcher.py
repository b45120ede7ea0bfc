"""When the server takes a config file to have changed, whatever links lead to it."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from dp_server.host.watcher import DirectoryWatcher, FileVersion


def configmap(root: Path) -> Path:
    """A ConfigMap volume as the kubelet writes it: config.yaml -> ..data/config.yaml."""
    (root / "..v1").mkdir()
    (root / "..v1" / "config.yaml").write_text("a: 1\n")
    (root / "..data").symlink_to("..v1")
    (root / "config.yaml").symlink_to("..data/config.yaml")
    return root / "config.yaml"


def configmap_update(root: Path) -> None:
    (root / "..v2").mkdir()
    (root / "..v2" / "config.yaml").write_text("a: 2\n")
    (root / "..data_tmp").symlink_to("..v2")
    os.replace(root / "..data_tmp", root / "..data")


def sibling_link(root: Path) -> Path:
    (root / "config.prod.yaml").write_text("a: 1\n")
    (root / "config.yaml").symlink_to("config.prod.yaml")
    return root / "config.yaml"


def swapped_directory(root: Path) -> Path:
    """A deploy tool's layout: config.yaml -> current/config.yaml, current -> releases/N."""
    for release in ("1", "2"):
        (root / "releases" / release).mkdir(parents=True)
        (root / "releases" / release / "config.yaml").write_text(f"a: {release}\n")
    (root / "current").symlink_to("releases/1")
    (root / "config.yaml").symlink_to("current/config.yaml")
    return root / "config.yaml"


def swap_directory(root: Path) -> None:
    (root / "current.tmp").symlink_to("releases/2")
    os.replace(root / "current.tmp", root / "current")


def plain(root: Path) -> Path:
    (root / "config.yaml").write_text("a: 1\n")
    return root / "config.yaml"


def rewrite(name: str) -> Callable[[Path], None]:
    def update(root: Path) -> None:
        (root / name).write_text("a: 22\n")

    return update


def rename_over(root: Path) -> None:
    (root / ".config.yaml.tmp").write_text("a: 22\n")
    os.replace(root / ".config.yaml.tmp", root / "config.yaml")


CASES: list[tuple[str, Callable[[Path], Path], Callable[[Path], None]]] = [
    ("ConfigMap ..data swap", configmap, configmap_update),
    (
        "edit the target of a sibling link",
        sibling_link,
        lambda r: (r / "config.prod.yaml").write_text("a: 22\n"),
    ),
    (
        "write through a sibling link",
        sibling_link,
        lambda r: (r / "config.yaml").write_text("a: 22\n"),
    ),
    ("swap a directory link", swapped_directory, swap_directory),
    ("write in place", plain, rewrite("config.yaml")),
    ("rename a new file over it", plain, rename_over),
]


@pytest.mark.parametrize(
    ("layout", "update"), [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES]
)
def test_every_way_of_changing_the_config_is_seen(
    tmp_path: Path, layout: Callable[[Path], Path], update: Callable[[Path], None]
) -> None:
    version = FileVersion(layout(tmp_path))
    assert not version.changed()
    (tmp_path / "notes.txt").write_text("not the config")  # a neighbour is no change
    assert not version.changed()
    update(tmp_path)
    assert version.changed()
    assert not version.changed()  # once per change


def test_a_config_that_goes_away_and_comes_back_is_a_change_each_time(tmp_path: Path) -> None:
    path = plain(tmp_path)
    version = FileVersion(path)
    path.unlink()
    assert version.changed()
    assert not version.changed()
    path.write_text("a: 3\n")
    assert version.changed()


async def _next_batch_with(
    batches: AsyncIterator[set[Path]], wanted: Path, timeout: float = 5.0
) -> set[Path]:
    """Batches until one names `wanted`; their union."""
    seen: set[Path] = set()
    async with asyncio.timeout(timeout):
        while wanted not in seen:
            seen |= await anext(batches)
    return seen


@pytest.mark.asyncio
async def test_a_directory_made_again_is_reported_and_watched_again(tmp_path: Path) -> None:
    watched = tmp_path / "device-plugins"
    watched.mkdir()
    watcher = DirectoryWatcher([watched], debounce_ms=20, recheck_ms=100)
    batches = watcher.changes()
    try:
        first = asyncio.ensure_future(_next_batch_with(batches, watched / "a.sock"))
        await asyncio.sleep(0.3)  # the thread is watching
        (watched / "a.sock").touch()
        await first
        shutil.rmtree(watched)
        watched.mkdir()
        await _next_batch_with(batches, watched)
        # Reported again once the new watch is in place (the old inotify watch
        # died with the old directory): from here on, its entries are seen.
        await _next_batch_with(batches, watched)
        (watched / "b.sock").touch()
        await _next_batch_with(batches, watched / "b.sock")
    finally:
        watcher.stop()


@pytest.mark.asyncio
async def test_a_directory_missing_at_start_is_watched_once_it_exists(tmp_path: Path) -> None:
    vfio = tmp_path / "vfio"
    watcher = DirectoryWatcher([vfio], debounce_ms=20, recheck_ms=100)
    batches = watcher.changes()
    try:
        appeared = asyncio.ensure_future(_next_batch_with(batches, vfio))
        await asyncio.sleep(0.3)
        vfio.mkdir()
        await appeared
        await _next_batch_with(batches, vfio)  # again, with the watch in place
        (vfio / "93").touch()
        await _next_batch_with(batches, vfio / "93")
    finally:
        watcher.stop()


def test_a_change_counts_once_the_file_has_stayed_the_same_for_the_settle_time(
    tmp_path: Path,
) -> None:
    path = plain(tmp_path)
    version = FileVersion(path, settle=1.0)
    version.noticed(now=10.0)
    assert version.due_at is None  # nothing changed
    path.write_text("")  # an in-place write: truncated first
    version.noticed(now=11.0)
    assert version.due_at == 12.0 and version.empty()
    assert not version.settled(now=11.5)
    path.write_text("a: 3\n")  # ... then written, half a second later
    assert not version.settled(now=12.0)  # changed again: wait again
    assert version.due_at == 13.0 and not version.empty()
    assert version.settled(now=13.0)
    assert version.due_at is None and not version.settled(now=20.0)
