"""When the server takes a config file to have changed, whatever links lead to it."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from dp_server.watcher import FileVersion


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
