"""Carrying out the core's effects: one handler per kind of effect.

The node decides; each handler here only does what its effect says, through
the sub-system that owns it (streams, Register calls, PodResources polls,
sysfs moves, the moves file, logs).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import attrs

from dp_core import (
    AttributeConnection,
    BindDevice,
    CdiSpecsChanged,
    CdiSpecsWritten,
    ClaimPrepared,
    ClaimRefused,
    ClaimsChanged,
    ClaimUnprepared,
    Effect,
    EndStream,
    HealthChanged,
    Input,
    Log,
    MovesChanged,
    PoolChanged,
    Publish,
    PublishHealth,
    RefreshAllocations,
    Register,
    Reject,
    Reply,
    UnbindDevice,
)
from dp_server.binding.moves_file import MovesStore
from dp_server.binding.queue import BindQueue
from dp_server.cdi import SpecDirectory
from dp_server.deviceplugin.pod_resources import PodResourcesPoller
from dp_server.deviceplugin.register_client import RegisterClient
from dp_server.deviceplugin.streams import Streams
from dp_server.monitoring.logs import emit

if TYPE_CHECKING:
    from dp_server.runtime.dra import DraRuntime

__all__ = ["EffectRunner"]

_log = logging.getLogger("dp.runtime")


class EffectRunner:
    def __init__(
        self,
        *,
        streams: Streams,
        registers: RegisterClient,
        pods: PodResourcesPoller,
        binds: BindQueue,
        moves: MovesStore,
        cdi: SpecDirectory | None,
        dra: DraRuntime | None = None,
        feed: Callable[[Input], object],
        spawn: Callable[[Coroutine[Any, Any, None]], object],
        now: Callable[[], float],
        stopping: Callable[[], bool],
    ) -> None:
        self._streams = streams
        self._registers = registers
        self._pods = pods
        self._binds = binds
        self._moves = moves
        self._cdi = cdi
        self._dra = dra
        self._feed = feed
        self._spawn = spawn
        self._now = now
        self._stopping = stopping
        self._handlers: dict[type[Any], Callable[[Any], None]] = {
            Publish: self._publish,
            EndStream: self._end_stream,
            Register: self._register,
            Log: emit,
            RefreshAllocations: self._refresh_allocations,
            BindDevice: self._move,
            UnbindDevice: self._move,
            MovesChanged: self._keep_moves,
            CdiSpecsChanged: self._keep_cdi_specs,
            AttributeConnection: self._log_attribution,
            ClaimPrepared: self._claim_prepared,
            ClaimUnprepared: self._claim_unprepared,
            ClaimsChanged: self._keep_claims,
            PoolChanged: self._publish_pool,
            PublishHealth: self._publish_health,
            # Answered by whoever fed the call (Runtime.call, DraRuntime.prepare).
            Reply: _nothing,
            Reject: _nothing,
            ClaimRefused: _nothing,
            # Logged through the Log effect that comes with it.
            HealthChanged: _nothing,
        }

    def handles(self, kind: type[Any]) -> bool:
        return kind in self._handlers

    def run(self, effect: Effect) -> None:
        self._handlers[type(effect)](effect)

    def _publish(self, effect: Publish) -> None:
        self._streams.publish(effect.stream, effect.resource, effect.devices)

    def _end_stream(self, effect: EndStream) -> None:
        self._streams.end(effect.stream, effect.reason)

    def _register(self, effect: Register) -> None:
        if not self._stopping():
            self._spawn(self._registers.call(effect))

    def _refresh_allocations(self, effect: RefreshAllocations) -> None:
        self._pods.request(self._now())

    def _move(self, effect: BindDevice | UnbindDevice) -> None:
        if not self._stopping():
            self._spawn(self._binds.submit(effect))

    def _keep_moves(self, effect: MovesChanged) -> None:
        self._moves.keep(effect.moves)

    def _keep_cdi_specs(self, effect: CdiSpecsChanged) -> None:
        if self._cdi is None:
            return
        # In the same turn: an Allocate read after this one names only specs in place.
        result = self._cdi.sync(effect.specs)
        self._feed(CdiSpecsWritten(result.in_place, result.problem))

    # The DRA effects exist only with the config's `dra`, which makes a DraRuntime.

    def _claim_prepared(self, effect: ClaimPrepared) -> None:
        if self._dra is not None:
            self._dra.claim_prepared(effect)

    def _claim_unprepared(self, effect: ClaimUnprepared) -> None:
        if self._dra is not None:
            self._dra.claim_unprepared(effect)

    def _keep_claims(self, effect: ClaimsChanged) -> None:
        if self._dra is not None:
            self._dra.claims_changed(effect)

    def _publish_pool(self, effect: PoolChanged) -> None:
        if self._dra is not None:
            self._dra.pool_changed(effect)

    def _publish_health(self, effect: PublishHealth) -> None:
        if self._dra is not None:
            self._dra.publish_health(effect)

    def _log_attribution(self, effect: AttributeConnection) -> None:
        _log.debug("connection-bound", extra={"dp_fields": attrs.asdict(effect)})


def _nothing(effect: object) -> None:
    pass
