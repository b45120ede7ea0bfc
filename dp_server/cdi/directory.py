"""A CDI spec directory (`/var/run/cdi`) in which dp keeps its own spec files.

dp's files are the ones whose names start with its prefix (`dp-`) and end in
`.json`; nothing else in the directory is ever opened, written or removed.
Each file is written only when its content changed, through a temporary
file in the same directory (a name that does not end in `.json` or `.yaml`,
which runtimes skip) that is flushed to disk and renamed over the old one,
so a runtime reads the old spec or the new one and never half of one.
Nothing is removed at shutdown: a runtime creating a container meanwhile
still resolves the names the kubelet was given.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import attrs

from dp_core import SPEC_PREFIX, CdiSpec
from dp_server.cdi.document import render
from dp_server.files import sync_directory, write_atomically

__all__ = ["SpecDirectory", "SyncResult"]

_SUFFIX = ".json"
_TEMPORARY = ".tmp"


@attrs.frozen
class SyncResult:
    """The specs that are in the directory as asked, and why the rest are not ("" if none)."""

    in_place: tuple[CdiSpec, ...]
    problem: str = ""


class SpecDirectory:
    """One spec directory, of which this process keeps the files named `<prefix>*.json`."""

    def __init__(self, path: str | os.PathLike[str], *, prefix: str = SPEC_PREFIX) -> None:
        self.path = Path(path)
        self.prefix = prefix

    def file_of(self, spec: CdiSpec) -> Path:
        return self.path / f"{spec.name}{_SUFFIX}"

    def sync(self, specs: Iterable[CdiSpec]) -> SyncResult:
        """Make dp's files in the directory exactly `specs`: write the ones that
        differ, remove the ones no spec names. Never raises for the directory's
        state; the result says what could not be done."""
        specs = tuple(specs)
        for spec in specs:
            if not spec.name.startswith(self.prefix):
                raise ValueError(f"spec {spec.name!r} is not named {self.prefix}*")
        problems: list[str] = []
        try:
            present = {entry.name for entry in os.scandir(self.path)}
        except OSError as error:
            return SyncResult((), self._problem("cannot list", self.path, error))
        in_place = []
        written = False
        for spec in specs:
            target = self.file_of(spec)
            data = render(spec)
            try:
                if target.name in present and _content(target) == data:
                    in_place.append(spec)
                    continue
                write_atomically(target, data)
                written = True
                in_place.append(spec)
            except OSError as error:
                problems.append(self._problem("cannot write", target, error))
        wanted = {self.file_of(spec).name for spec in specs}
        for name in sorted(present - wanted):
            if self._ours(name) or self._our_temporary(name):
                try:
                    (self.path / name).unlink()
                except FileNotFoundError:
                    pass
                except OSError as error:
                    problems.append(self._problem("cannot remove", self.path / name, error))
        if written:
            try:
                sync_directory(self.path)
            except OSError as error:
                problems.append(self._problem("cannot flush", self.path, error))
        return SyncResult(tuple(in_place), "; ".join(problems))

    def _ours(self, name: str) -> bool:
        return name.startswith(self.prefix) and name.endswith(_SUFFIX)

    def _our_temporary(self, name: str) -> bool:
        # Left behind by a write a crash cut short: `.<prefix>....json.XXXX.tmp`.
        return name.startswith("." + self.prefix) and name.endswith(_TEMPORARY)

    @staticmethod
    def _problem(what: str, path: Path, error: OSError) -> str:
        return f"{what} {path}: {error.strerror or error}"


def _content(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
