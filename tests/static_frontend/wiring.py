"""The static front end in the running server: a directory the operator
controls. `<consumer>.run` there means the consumer runs; the front end
writes `<consumer>.devices` (JSON: its devices and IOMMU groups) once it has
them, or `<consumer>.refused` with the reason, and removes the first when
the consumer stops. Nothing here decides: the core does."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from dp_core import Config, Ledger, MetricFamily
from dp_server.config.settings import Settings
from dp_server.loop import Loop, Readiness, Services, Timer
from dp_server.runtime.frontends import Plug

from .core import (
    NAME,
    ConsumerHanded,
    ConsumerRefused,
    ConsumerStarted,
    ConsumerStopped,
    StaticFrontend,
)


class StaticRuntime:
    """`FrontendRuntime` of the static front end, on `directory`."""

    def __init__(
        self, ledger: Ledger, directory: Path, consumers: Mapping[str, Sequence[str]]
    ) -> None:
        self.directory = directory
        self.frontend = StaticFrontend(ledger, consumers)
        self._asked: set[str] = set()  # consumers the shell asked to run

    @property
    def name(self) -> str:
        return NAME

    @property
    def core(self) -> StaticFrontend:
        return self.frontend

    def attach(self, loop: Loop, services: Services) -> None:
        self._loop = loop
        loop.on(ConsumerHanded, self._handed)
        loop.on(ConsumerRefused, self._refused)

    def timers(self) -> Sequence[Timer]:
        return ()

    def watched(self) -> Sequence[Path]:
        return (self.directory,)

    def recall(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)

    async def start(self) -> None:
        pass

    async def restore(self) -> None:
        wanted = {path.stem for path in self.directory.glob("*.run")}
        now = self._loop.now()
        for consumer in sorted(wanted - self._asked):
            self._loop.feed(ConsumerStarted(consumer, now))
        for consumer in sorted(self._asked - wanted):
            self._loop.feed(ConsumerStopped(consumer, now))
            (self.directory / f"{consumer}.devices").unlink(missing_ok=True)
        self._asked = wanted

    async def close(self) -> None:
        pass

    async def closed(self) -> None:
        pass

    def readiness(self) -> Readiness:
        return Readiness(True, f"{len(self._asked)} static consumers")

    def remarks(self) -> Sequence[str]:
        return ()

    def families(self) -> Iterable[MetricFamily]:
        return ()

    def serving(self) -> Mapping[str, object]:
        return {"static_directory": str(self.directory)}

    def _handed(self, effect: ConsumerHanded) -> None:
        devices = {"devices": list(effect.devices), "iommu_groups": list(effect.groups)}
        (self.directory / f"{effect.consumer}.devices").write_text(json.dumps(devices))
        (self.directory / f"{effect.consumer}.refused").unlink(missing_ok=True)

    def _refused(self, effect: ConsumerRefused) -> None:
        (self.directory / f"{effect.consumer}.refused").write_text(effect.reason)


def static_plug(directory: Path, consumers: Mapping[str, Sequence[str]]) -> Plug:
    """The registration line's entry: the static front end on `directory`."""

    def plug(settings: Settings, config: Config, ledger: Ledger) -> StaticRuntime:
        return StaticRuntime(ledger, directory, consumers)

    return plug
