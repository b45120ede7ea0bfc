"""`RecordStore`: a state file written whole at each change, and read back."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import cattrs
import pytest

from dp_server.files import RecordKind, RecordsFileError, RecordStore


@attrs.frozen
class Held:
    name: str
    groups: tuple[int, ...]


def _check(records: tuple[Held, ...]) -> None:
    names = [r.name for r in records]
    if len(set(names)) != len(names):
        raise ValueError(f"a name twice in {names}")


KIND = RecordKind("held.json", Held, "held", 3, cattrs.Converter(), check=_check)


def test_each_write_holds_exactly_the_records_given_then(tmp_path: Path) -> None:
    """Records unchanged since the last write are not converted again; the
    file is still exactly what a store writing them for the first time writes."""
    a, b, c = Held("a", (1,)), Held("b", (2, 3)), Held("c", (4,))
    writes = [(a, b), (b, c), (c, attrs.evolve(b, groups=(5,))), (), (a,), (a, a)]
    store = RecordStore(KIND, path=tmp_path / "kept.json")
    for records in writes:
        store.write(records)
        fresh = tmp_path / "fresh.json"
        RecordStore(KIND, path=fresh).write(records)  # a store that never wrote before
        kept = (tmp_path / "kept.json").read_bytes()
        assert kept == fresh.read_bytes()
        expected = {
            "version": 3,
            "held": [{"name": r.name, "groups": list(r.groups)} for r in records],
        }
        assert kept == json.dumps(expected, separators=(",", ":")).encode() + b"\n"
        if len(set(records)) == len(records):
            assert store.read() == tuple(records)


def test_a_record_the_check_refuses_is_named_with_the_file(tmp_path: Path) -> None:
    store = RecordStore(KIND, path=tmp_path / "kept.json")
    store.write((Held("a", (1,)), Held("a", (2,))))
    with pytest.raises(RecordsFileError, match=r"kept\.json: a name twice in \['a', 'a'\]"):
        store.read()
