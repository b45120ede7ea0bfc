"""The emulated API server's objects: resourceVersions, generateName, conflicts, watch history.

Objects are plain JSON dicts kept by (resource, namespace, name). Every
change takes the next resourceVersion (one counter for the whole store, as
etcd's revision is) and is kept in a bounded history that watches are served
from; a watch from a version older than the history holds is answered with
410 Gone, as the real server does after a compaction.
"""

from __future__ import annotations

import copy
import random
import uuid
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import attrs

__all__ = ["ApiFailure", "Event", "Store", "field_value", "parse_field_selector"]

Obj = dict[str, Any]

# What apimachinery's generateName appends: 5 characters without vowels or look-alikes.
_SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"


class ApiFailure(Exception):
    """An answer other than success, as a `Status` object with `code`, `reason` and message."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message

    def status(self) -> Obj:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }


@attrs.frozen
class Event:
    type: str  # ADDED, MODIFIED, DELETED
    resource: str
    namespace: str
    object: Obj
    version: int


def parse_field_selector(text: str) -> list[tuple[str, str, bool]]:
    """`a=b,c!=d` as (field, value, equal) triples; `==` is `=`."""
    terms = []
    for part in filter(None, text.split(",")):
        if "!=" in part:
            field, value = part.split("!=", 1)
            terms.append((field, value, False))
        elif "==" in part:
            field, value = part.split("==", 1)
            terms.append((field, value, True))
        elif "=" in part:
            field, value = part.split("=", 1)
            terms.append((field, value, True))
        else:
            raise ApiFailure(400, "BadRequest", f"invalid field selector: {part!r}")
    return terms


def field_value(obj: Obj, path: str) -> str:
    node: Any = obj
    for key in path.split("."):
        node = node.get(key) if isinstance(node, dict) else None
    return "" if node is None else str(node)


class Store:
    """All objects of the emulated server, and the history that watches read."""

    def __init__(self, *, history: int = 1000, rng: random.Random | None = None) -> None:
        self._objects: dict[tuple[str, str, str], Obj] = {}
        self._version = 0
        self._history: deque[Event] = deque(maxlen=history)
        # Versions at or below this one are no longer in the history (compacted).
        self._compacted = 0
        self._rng = rng or random.Random(0)
        self._listeners: list[Callable[[Event], None]] = []

    @property
    def version(self) -> int:
        return self._version

    def objects(self, resource: str, namespace: str = "") -> list[Obj]:
        return [
            copy.deepcopy(o)
            for (r, ns, _), o in sorted(self._objects.items())
            if r == resource and (not namespace or ns == namespace)
        ]

    def everything(self) -> list[Obj]:
        """Every object of every resource (not copies: read them, do not change them)."""
        return list(self._objects.values())

    def everything_with_keys(self) -> list[tuple[str, str, Obj]]:
        """(resource, namespace, object) for every object, as `everything`."""
        return [(r, ns, o) for (r, ns, _), o in sorted(self._objects.items())]

    def get(self, resource: str, namespace: str, name: str) -> Obj:
        try:
            return copy.deepcopy(self._objects[(resource, namespace, name)])
        except KeyError:
            raise ApiFailure(404, "NotFound", f'{resource} "{name}" not found') from None

    def create(self, resource: str, namespace: str, obj: Obj, *, dry_run: bool = False) -> Obj:
        """Store `obj` as new. `dry_run`: the answer the server would give, with a
        UID and a name but no resourceVersion, and nothing stored (`dryrun.go`)."""
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            prefix = meta.get("generateName")
            if not prefix:
                raise ApiFailure(
                    422, "Invalid", "metadata.name or metadata.generateName is required"
                )
            meta["name"] = prefix + "".join(self._rng.choice(_SUFFIX_ALPHABET) for _ in range(5))
        name = meta["name"]
        if (resource, namespace, name) in self._objects:
            raise ApiFailure(409, "AlreadyExists", f'{resource} "{name}" already exists')
        if meta.get("resourceVersion"):
            raise ApiFailure(422, "Invalid", "metadata.resourceVersion must be unset on create")
        if namespace:
            meta["namespace"] = namespace
        meta["uid"] = str(uuid.UUID(int=self._rng.getrandbits(128), version=4))
        meta["creationTimestamp"] = _now()
        meta["generation"] = 1
        if dry_run:
            return obj
        return self._put(resource, namespace, name, obj, "ADDED")

    def update(
        self,
        resource: str,
        namespace: str,
        name: str,
        obj: Obj,
        *,
        status: bool,
        dry_run: bool = False,
    ) -> Obj:
        """PUT: the body's resourceVersion, when set, must be the stored one (else 409).
        `dry_run`: the answer, at the stored resourceVersion, and nothing stored."""
        current = self.get(resource, namespace, name)
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        if meta.get("name", name) != name:
            raise ApiFailure(400, "BadRequest", "the name of the object does not match the URL")
        given = meta.get("resourceVersion")
        if given and given != current["metadata"]["resourceVersion"]:
            raise ApiFailure(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {resource} "{name}": the object has been '
                "modified; please apply your changes to the latest version and try again",
            )
        kept = current["metadata"]
        if status:
            # The status subresource changes only the status.
            merged = current
            merged["status"] = obj.get("status")
        else:
            merged = obj
            merged["metadata"] = {**meta, "name": name}
            for key in ("uid", "creationTimestamp", "namespace"):
                if key in kept:
                    merged["metadata"][key] = kept[key]
            merged["metadata"]["generation"] = kept.get("generation", 1) + (
                obj.get("spec") != current.get("spec")
            )
            if "status" in current:
                merged["status"] = current["status"]
        if dry_run:
            merged["metadata"]["resourceVersion"] = kept["resourceVersion"]
            return merged
        return self._put(resource, namespace, name, merged, "MODIFIED")

    def delete(self, resource: str, namespace: str, name: str, *, dry_run: bool = False) -> Obj:
        obj = self.get(resource, namespace, name)
        if dry_run:
            return obj
        del self._objects[(resource, namespace, name)]
        self._version += 1
        obj["metadata"]["resourceVersion"] = str(self._version)
        self._record(Event("DELETED", resource, namespace, obj, self._version))
        return obj

    def _put(self, resource: str, namespace: str, name: str, obj: Obj, kind: str) -> Obj:
        self._version += 1
        obj["metadata"]["resourceVersion"] = str(self._version)
        self._objects[(resource, namespace, name)] = obj
        self._record(Event(kind, resource, namespace, copy.deepcopy(obj), self._version))
        return copy.deepcopy(obj)

    def _record(self, event: Event) -> None:
        if len(self._history) == self._history.maxlen and self._history:
            self._compacted = self._history[0].version
        self._history.append(event)
        for listener in list(self._listeners):
            listener(event)

    def compact(self) -> None:
        """Forget the history: a watch from any version before now gets 410 Gone."""
        self._history.clear()
        self._compacted = self._version

    def events_since(self, version: int) -> list[Event]:
        """Events after `version`, or 410 Gone if some of them are no longer kept."""
        if version < self._compacted:
            raise ApiFailure(
                410, "Expired", f"too old resource version: {version} ({self._compacted})"
            )
        return [e for e in self._history if e.version > version]

    def listen(self, callback: Callable[[Event], None]) -> Callable[[], None]:
        self._listeners.append(callback)
        return lambda: self._listeners.remove(callback)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
