"""What dp moved to vfio-pci, kept in the state directory across restarts.

The core reports every change as `MovesChanged`; the file holds the last one,
and a restarted dp hands it back as `MovesRecalled`. Without it, a dp
restarted between moving part of an IOMMU group and giving it back would see
the moved functions on vfio-pci and could not tell them from functions
someone else put there, so they would stay there, of use to no one.

The file is JSON, written whole to a temporary file and renamed over the old
one, so a crash leaves the old file or the new one, never half of either.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import cattrs

from dp_core import Move, MovesRecalled, PciAddress
from dp_server.config.hooks import register_strict_scalars
from dp_server.files import RecordsFileError, read_records, write_records

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


_log = logging.getLogger("dp.runtime")


class MovesStore:
    """The moves file of a state directory; with no directory, moves are kept nowhere."""

    def __init__(self, state_dir: str | None) -> None:
        self.path = None if state_dir is None else Path(state_dir) / MOVES_FILE

    def recall(self) -> tuple[Move, ...]:
        """The moves kept last; none if the file is missing or unreadable (logged)."""
        if self.path is None:
            return ()
        try:
            return read_moves(self.path)
        except MovesFileError as error:
            # Nothing is given back that only this file says dp moved.
            _log.error("moves-unreadable", extra={"dp_fields": {"reason": str(error)}})
            return ()

    def keep(self, moves: tuple[Move, ...]) -> None:
        if self.path is None:
            return
        try:
            write_moves(self.path, moves)
        except OSError as error:
            reason = f"{self.path}: {error.strerror or error}"
            _log.error("moves-unwritable", extra={"dp_fields": {"reason": reason}})


class MovesFileError(RecordsFileError):
    """A moves file that cannot be read; the message names the file and what is wrong."""


def read_moves(path: Path) -> tuple[Move, ...]:
    """The moves in `path`; none when there is no such file."""
    try:
        moves = read_records(path, Move, key="moves", version=_VERSION, converter=_converter)
    except RecordsFileError as error:
        raise MovesFileError(str(error)) from None
    try:
        MovesRecalled(moves)  # what the core will be handed must be valid input
    except ValueError as error:
        raise MovesFileError(f"{path}: {error}") from None
    return moves


def write_moves(path: Path, moves: tuple[Move, ...]) -> None:
    """Replace `path` with `moves`, atomically; raises OSError."""
    write_records(path, moves, key="moves", version=_VERSION, converter=_converter)
