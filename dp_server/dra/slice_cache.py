"""What the publisher knows of its ResourceSlices on the API server: the newest state of each.

Two streams tell it: the watch, and the answers to its own writes. They are
not ordered against each other: someone else's change to a slice can come
down the watch before the answer to dp's own, older, write of it. Keeping
whichever came last would forget the newer change, and dp would believe the
server holds what it wrote. So each slice keeps the state with the highest
resourceVersion, and a deletion is remembered (with its version) until the
next list, so an older answer cannot bring a deleted slice back. Comparing
resourceVersions as integers is what client-go's mutation cache does
(`cache.NewIntegerResourceVersionMutationCache`); a version that is not an
integer is taken as newer.
"""

from __future__ import annotations

from collections.abc import Iterable

from lightkube.resources.resource_v1 import ResourceSlice

__all__ = ["SliceCache", "slice_name"]


def slice_name(obj: ResourceSlice) -> str:
    assert obj.metadata is not None and obj.metadata.name is not None
    return obj.metadata.name


def _version(obj: ResourceSlice) -> int | None:
    text = obj.metadata.resourceVersion if obj.metadata is not None else None
    try:
        return int(text) if text else None
    except ValueError:
        return None


def _before(version: int | None, than: int | None) -> bool:
    """Whether `version` is known to come before `than` (None: not an integer)."""
    return version is not None and than is not None and version < than


class SliceCache:
    """This node's slices of one driver by name, each at the newest version seen."""

    def __init__(self, items: Iterable[ResourceSlice] = ()) -> None:
        self._slices = {slice_name(s): s for s in items}
        self._deleted: dict[str, int | None] = {}

    def values(self) -> list[ResourceSlice]:
        return list(self._slices.values())

    def __len__(self) -> int:
        return len(self._slices)

    def put(self, obj: ResourceSlice) -> bool:
        """Keep `obj` unless a newer state of it (or its deletion) is known; whether kept."""
        name = slice_name(obj)
        version = _version(obj)
        if name in self._deleted:
            gone = self._deleted[name]
            if gone is None or _before(version, gone) or version == gone:
                return False
        known = self._slices.get(name)
        if known is not None and _before(version, _version(known)):
            return False
        self._slices[name] = obj
        return True

    def delete(self, obj: ResourceSlice) -> None:
        """`obj` is gone (a DELETED event: the object with the deletion's version)."""
        name = slice_name(obj)
        self._slices.pop(name, None)
        self._deleted[name] = _version(obj)

    def deleted_by_us(self, name: str) -> None:
        """We deleted `name`: the watch will bring the version of the deletion."""
        known = self._slices.pop(name, None)
        self._deleted[name] = _version(known) if known is not None else None
