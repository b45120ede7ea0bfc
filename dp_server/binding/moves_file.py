"""What dp moved to vfio-pci, kept in the state directory across restarts.

The core reports every change as `MovesChanged`; the file holds the last one,
and a restarted dp hands it back as `MovesRecalled`. Without it, a dp
restarted between moving part of an IOMMU group and giving it back would see
the moved functions on vfio-pci and could not tell them from functions
someone else put there, so they would stay there, of use to no one.

The file is JSON, written whole to a temporary file and renamed over the old
one, so a crash leaves the old file or the new one, never half of either
(`files.RecordStore`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import cattrs

from dp_core import Move, MovesRecalled, PciAddress
from dp_server.files import RecordKind, RecordsFileError, RecordStore, register_strict_scalars

__all__ = ["MOVES_FILE", "MovesFileError", "MovesStore", "read_moves", "write_moves"]

MOVES_FILE = "moves.json"
_VERSION = 1

_converter = cattrs.Converter(forbid_extra_keys=True)


def _address(value: Any, _: Any) -> PciAddress:
    if not isinstance(value, str):
        raise TypeError(f"expected a PCI address, got {value!r}")
    return PciAddress.parse(value)


register_strict_scalars(_converter)
_converter.register_structure_hook(PciAddress, _address)
_converter.register_unstructure_hook(PciAddress, str)


class MovesFileError(RecordsFileError):
    """A moves file that cannot be read; the message names the file and what is wrong."""


MOVES = RecordKind(
    MOVES_FILE, Move, "moves", _VERSION, _converter, check=MovesRecalled, error=MovesFileError
)


class MovesStore(RecordStore[Move]):
    """The moves file of a state directory (or at `path`); with neither, moves
    are kept nowhere. One that cannot be read recalls nothing: nothing is
    given back that only this file says dp moved."""

    def __init__(self, state_dir: str | None = None, *, path: Path | None = None) -> None:
        super().__init__(MOVES, state_dir, path=path)


def read_moves(path: Path) -> tuple[Move, ...]:
    """The moves in `path`; none when there is no such file."""
    return MovesStore(path=path).read()


def write_moves(path: Path, moves: tuple[Move, ...]) -> None:
    """Replace `path` with `moves`, atomically; raises OSError."""
    MovesStore(path=path).write(moves)
