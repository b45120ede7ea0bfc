"""What a front end's wiring is to the server: the protocol `Runtime` and
monitoring iterate over, so that neither names a front end.

A front end's wiring is made before the node, from the settings, the config
and the node's one ledger, and makes its core front end (`core`); once the
node and the loop exist it is attached (`attach`: the effect handlers it
registers, its connections to the loop). Then the runtime drives every
wiring alike through its life: `recall` (what an earlier run left), `start`,
`restore` whenever one of the directories it `watched` changes (and at every
rescan), `close` and `closed`; and monitoring asks each for its readiness,
its health remarks and its metric families.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs

from dp_core import Frontend, MetricFamily

from .core import Loop
from .memory import CollectionPolicy
from .timers import Timer

__all__ = ["FrontendLost", "FrontendRuntime", "Readiness", "Services", "Spawn"]


class Spawn(Protocol):
    def __call__(
        self, coroutine: Coroutine[Any, Any, Any], *, essential: str | None = None
    ) -> Any: ...


@attrs.frozen
class Services:
    """What the runtime lends every front end's wiring."""

    spawn: Spawn  # a background task; `essential` ones fail /healthz when they end
    memory: CollectionPolicy
    stopping: Callable[[], bool]


@attrs.frozen
class Readiness:
    """A front end's part of /readyz: when `ready`, what it serves (a noun
    phrase: `3 resources`); otherwise why it is not ready."""

    ready: bool
    detail: str


class FrontendLost(Exception):
    """A front end cannot go on, and only a restart of dp can mend it (the
    kubelet's directory removed from under it)."""


class FrontendRuntime(Protocol):
    """One front end's wiring in the running server."""

    @property
    def name(self) -> str:
        """Its core front end's name (`frontend:` in the config)."""
        ...

    @property
    def core(self) -> Frontend[object]:
        """The core front end it wires, made with the node's ledger."""
        ...

    def attach(self, loop: Loop, services: Services) -> None:
        """Register its effects' handlers on `loop` and connect what feeds it."""
        ...

    def timers(self) -> Sequence[Timer]: ...

    def watched(self) -> Sequence[Path]:
        """Directories whose changes it must see: each change calls `restore`."""
        ...

    def recall(self) -> None:
        """Take up what an earlier run left (after the first host scan, before serving)."""
        ...

    async def start(self) -> None:
        """Start serving (SettingsError if it cannot)."""
        ...

    async def restore(self) -> None:
        """Look again at what is outside dp's hands (sockets deleted, the
        kubelet restarted); FrontendLost if only a restart can mend it."""
        ...

    async def close(self) -> None:
        """Stop serving: end streams, close and remove sockets."""
        ...

    async def closed(self) -> None:
        """After every background task has ended: close its clients."""
        ...

    def readiness(self) -> Readiness: ...

    def remarks(self) -> Sequence[str]:
        """What /healthz should say about it without failing (a restart would
        not mend it): `CDI specs not in place: ...`."""
        ...

    def families(self) -> Iterable[MetricFamily]:
        """Its wiring's own metric families (the core front end's come with the
        node's, `dp_core.collect`)."""
        ...

    def serving(self) -> Mapping[str, object]:
        """Its fields of the `serving` log line."""
        ...
